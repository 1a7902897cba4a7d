"""``bgeserve bulk INPUT... --output DIR``: the command line of a bulk job."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
from pathlib import Path

EPILOG = """\
The model comes from the same BGE_M3_* variables as `bgeserve serve` (BGE_M3_MODEL_PATH,
BGE_M3_MODEL, BGE_M3_EP, BGE_M3_WORKERS, BGE_M3_MAX_SEQ_LENGTH, ...). Texts longer than
BGE_M3_MAX_SEQ_LENGTH tokens are truncated and flagged (column `truncated`).

Output: Parquet shards in DIR, each written under a temporary name and renamed when complete,
with columns id (string), n_tokens, truncated, and per output dense (fixed-size float32
list), sparse_indices / sparse_values, colbert. A rerun with the same arguments resumes: it
keeps every finished shard and embeds only the rows they do not hold; another model (even at
the same path), other options or a changed input is refused. Inputs are known by absolute path:
a moved input is embedded again (a warning says so). Rows without a string text or without an
id are reported in the log and written to no shard; ids are not deduplicated, but ids written
more than once are counted in the summary and named in a warning.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``bgeserve bulk``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="JSONL (.jsonl/.ndjson/.json), Parquet or CSV files (.jsonl.gz and "
                        ".csv.gz too), or folders of them")
    parser.add_argument("--output", required=True, metavar="DIR", help="folder of the shards")
    parser.add_argument("--text-column", default="text",
                        help="column (key) of the texts (default: text)")
    parser.add_argument("--id-column", default="id",
                        help="column (key) of the row ids (default: id)")
    parser.add_argument("--outputs", default="dense,sparse",
                        help="any of dense, sparse, colbert, comma-separated (default: "
                        "dense,sparse)")
    parser.add_argument("--shard-rows", type=int, default=None,
                        help="rows per shard (default 1024; 64 with colbert)")
    parser.add_argument("--progress", choices=("auto", "bar", "log"), default="auto",
                        help="a progress bar (auto: on a terminal) or log lines every 10 s")
    ray = parser.add_argument_group("Ray (pip install 'bgeserve[ray]')")
    ray.add_argument("--ray", action="store_true",
                     help="run as a Ray Data pipeline over an actor pool of "
                     "bgeserve.ray.Embedder (input and output on storage every node sees)")
    ray.add_argument("--ray-address", default=None,
                     help="the cluster to join (default: RAY_ADDRESS, else a local Ray)")
    ray.add_argument("--cpus-per-actor", type=float, default=None,
                     help="CPUs of each Embedder actor (default: one actor per node, using "
                     "all its CPUs but one, which reads and writes)")


def os_error_message(exc: OSError, output: str) -> str:
    """What failed, naming the file (or, when the error names none, the --output folder)."""
    where = exc.filename if exc.filename is not None else f"--output {output}"
    if exc.errno == errno.ENOSPC or "No space left" in str(exc):
        return (f"no space left on the device writing {where}: free some space and run the "
                "same command again; it keeps the finished shards and resumes")
    return f"{exc.strerror or exc}: {where}"


class Terminated(BaseException):
    """SIGTERM (a container stopped, a scheduler's time limit): the job stops as for Ctrl-C.
    A BaseException, so that no handler of errors takes it for one."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated


def run(args: argparse.Namespace) -> int:
    """Run the job; 0 when every row was embedded or reported, 2 on a usage error or a file
    that cannot be read or written, 130 when interrupted (Ctrl-C), 143 when terminated."""
    # Python's default for SIGTERM ends the process without a word (QA): stop as for Ctrl-C,
    # the queued work dropped and a line saying the shards are kept.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    from bgeserve.bulk.columns import parse_outputs
    from bgeserve.bulk.job import BulkJob
    from bgeserve.bulk.model import resolve_settings
    from bgeserve.config import Settings, warn_unknown_variables
    from bgeserve.errors import BgeServeError
    from bgeserve.logs import setup_logging
    from bgeserve.tuning import memory

    try:
        logs = Settings.from_env(os.environ)  # logging first: resolving logs its choice
        setup_logging(logs.log_format, logs.log_level)
        warn_unknown_variables(os.environ)
        memory.limit_malloc_arenas(os.environ)  # before the threads that allocate start
        settings = resolve_settings(os.environ)
        if args.shard_rows is not None and args.shard_rows < 1:
            raise ValueError("--shard-rows must be at least 1")
        job = BulkJob(inputs=tuple(args.inputs), output=Path(args.output),
                      text_column=args.text_column, id_column=args.id_column,
                      outputs=parse_outputs(args.outputs), shard_rows=args.shard_rows)
        bar = {"auto": None, "bar": True, "log": False}[args.progress]
        if args.ray:
            from bgeserve.ray.pipeline import run as run_ray

            try:
                run_ray(job, settings, address=args.ray_address,
                        cpus_per_actor=args.cpus_per_actor, environ=os.environ)
            except SystemExit as exc:
                # ray.init puts its own SIGTERM handler over ours: sys.exit(15) (review).
                if exc.code == signal.SIGTERM:
                    raise Terminated from None
                raise
        else:
            from bgeserve.bulk.local import run as run_local

            run_local(job, settings, bar=bar)
    except (BgeServeError, ValueError) as exc:
        print(f"bgeserve bulk: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the output folder (or an input) on a disk that refuses
        logging.getLogger("bgeserve.bulk").debug("the error's traceback", exc_info=True)
        print(f"bgeserve bulk: {os_error_message(exc, args.output)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: expected, and resumable; no traceback
        print("bgeserve bulk: interrupted; finished shards are kept, run the same command "
              "again to go on", file=sys.stderr)
        return 130
    except Terminated:
        print("bgeserve bulk: terminated (SIGTERM); finished shards are kept, run the same "
              "command again to go on", file=sys.stderr)
        return 128 + signal.SIGTERM
    except ImportError as exc:
        if exc.name not in ("pyarrow", "tqdm", "ray"):
            raise
        print(f"bgeserve bulk: {exc}; install the extra: pip install 'bgeserve[bulk]' "
              "(with --ray: 'bgeserve[ray]')", file=sys.stderr)
        return 2
    return 0
