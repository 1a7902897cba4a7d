"""``bgeserve``: serve | probe | prepare | bulk | export | build-random-model."""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bgeserve.config import Settings


def inflight_mb(settings: Settings) -> int:
    """The default allowance of request bodies in progress: an eighth of the memory the
    server may use (a body, its parsed texts and its ids take ~3-4x its size), at most 512
    MiB, at least one largest body."""
    from bgeserve.service.plan import memory_share

    return max(settings.max_body_bytes >> 20, memory_share(settings, 8, 512) >> 20, 1)


def _dual_stack(port: int) -> socket.socket:
    """A TCP socket bound to [::]:``port`` that takes IPv4 clients too (where the kernel
    allows: IPV6_V6ONLY off)."""
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", port))
    except OSError:
        sock.close()
        raise
    return sock


def _serve(args: argparse.Namespace) -> int:
    import dataclasses
    import logging
    import os
    import signal

    import uvicorn

    from bgeserve.cgroup import usable_cpus
    from bgeserve.config import (
        Settings,
        parse_bind,
        refuse_misspelt_guards,
        warn_unknown_variables,
    )
    from bgeserve.errors import BgeServeError
    from bgeserve.fdlimit import raise_open_files_limit
    from bgeserve.http import tls
    from bgeserve.http.app import create_app
    from bgeserve.http.drain import ANSWER_SECS, DrainingServer
    from bgeserve.http.stalls import StallBoundHttpTools
    from bgeserve.logs import setup_logging
    from bgeserve.service import Service, choice, plan
    from bgeserve.tuning import memory

    try:
        environ = dict(os.environ)
        if args.bind:  # checked as BGE_M3_BIND is (it was taken as given: a traceback), and
            # in its place: a bad BGE_M3_BIND it overrides is no reason to refuse to start
            environ["BGE_M3_BIND"] = parse_bind("--bind", args.bind)
        settings = Settings.from_env(environ)
        refuse_misspelt_guards(environ)
    except BgeServeError as exc:
        print(f"bgeserve: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_format, settings.log_level, background=True)
    log = logging.getLogger("bgeserve")
    warn_unknown_variables(os.environ)
    memory.limit_malloc_arenas(os.environ)  # before the threads that allocate start
    raise_open_files_limit()  # every connection is a file descriptor
    try:  # before any port is bound: a missing GPU EP fails fast, naming BGE_M3_EP
        settings = plan.resolve(settings)
    except BgeServeError as exc:
        print(f"bgeserve: {exc}", file=sys.stderr)
        return 2
    if settings.model_path is not None and not settings.model_path.is_dir():
        # Found by the loader only after the port was bound (exit 3, the reason in the log):
        # a path that is not there, or a file (QA: exit 3 after the port opened), cannot
        # become a model folder while the server waits.
        what = ("is a file, not a folder: name the folder of an export or a snapshot"
                if settings.model_path.exists() else "does not exist")
        print(f"bgeserve: model directory {settings.model_path} (BGE_M3_MODEL_PATH) {what}",
              file=sys.stderr)
        return 2
    if settings.max_inflight_mb is None:
        settings = dataclasses.replace(settings, max_inflight_mb=inflight_mb(settings))
    try:
        ssl_options = tls.uvicorn_options(settings)  # HTTPS when BGE_M3_TLS_CERT_FILE is set
    except BgeServeError as exc:
        print(f"bgeserve: {exc}", file=sys.stderr)
        return 2
    fields = settings.redacted()
    if choice.measurable(settings):  # measured while loading: "variant choice" says which
        fields["rule_variant"] = fields.pop("variant")
    log.info("bgeserve starting", extra={"settings": fields})
    log.info("%s: intra-op threads per worker %d", usable_cpus(), settings.threads_per_worker)
    if (crowded := plan.oversubscribed(settings, usable_cpus().count)) is not None:
        log.warning(crowded)
    if settings.warmup_only:
        from bgeserve.service.warmup import run as warmup

        return warmup(settings)
    # Before the model loads: uvicorn binds only after the lifespan started the loader, and
    # its exit on a taken port then met ONNX Runtime's threads mid-load (an abort, exit 134).
    taken = port_taken(settings.bind, "--bind" if args.bind else "BGE_M3_BIND")
    if taken:
        print(f"bgeserve: {taken}", file=sys.stderr)
        return 2
    host, _, port = settings.bind.rpartition(":")
    sockets = None
    if host.strip("[]") == "::":
        # asyncio binds [::] IPv6-only (IPV6_V6ONLY): IPv4 clients were refused while the
        # healthcheck, polling [::1], said healthy. Bound here dual-stack, as [::] means in
        # Docker and Kubernetes.
        try:
            sockets = [_dual_stack(int(port))]
        except OSError as exc:
            print(f"bgeserve: cannot bind {settings.bind} "
                  f"({'--bind' if args.bind else 'BGE_M3_BIND'}): {exc.strerror}",
                  file=sys.stderr)
            return 2
    holder: dict[str, uvicorn.Server] = {}

    def on_fatal(exc: BaseException) -> None:
        if "server" in holder:
            holder["server"].should_exit = True

    service = Service(settings, on_fatal=on_fatal)
    app = create_app(settings, service_factory=lambda _: service)
    # uvicorn cancels the requests still running when its grace ends, answering a bare 500;
    # the service answers them 503 at BGE_M3_SHUTDOWN_TIMEOUT_SECS, so uvicorn's grace is a
    # little longer: the time to render and send those answers, and to read the rest of a
    # body a 503 cut short (linger.py; cancelled, it was a traceback and the stop overran).
    grace = (settings.shutdown_timeout_secs + ANSWER_SECS
             if settings.shutdown_timeout_secs else None)  # 0: no bound
    config = uvicorn.Config(app, host=host.strip("[]"), port=int(port), log_config=None,
                            # uvicorn types it int | None; it waits a float as well.
                            timeout_graceful_shutdown=grace,  # type: ignore[arg-type]
                            lifespan="on", http=StallBoundHttpTools,
                            # uvicorn types it int; its timer takes a float.
                            timeout_keep_alive=settings.keep_alive_secs,  # type: ignore[arg-type]
                            # No WebSocket route: an Upgrade: websocket request is served as
                            # plain HTTP (upgrades.py), not refused in plain text.
                            ws="none", **ssl_options)

    def begin_shutdown() -> None:
        service.begin_shutdown()
        # Requests still sending their body are not in the service: theirs is the same 503.
        app.state.uploads.abort_after(settings.shutdown_timeout_secs)

    def stop_now() -> None:  # a second Ctrl-C
        service.stop_now()
        app.state.uploads.abort()

    server = holder["server"] = DrainingServer(config, on_shutdown=begin_shutdown,
                                               on_force=stop_now)

    def on_signal(sig: int, frame: object) -> None:
        # uvicorn handles SIGTERM/SIGINT while it runs (graceful drain), then restores these
        # handlers and re-raises the signal it caught; with the default handler the process
        # would die of it (exit -15) after a clean drain. Here it only asks for the exit.
        server.should_exit = True

    def on_hangup(sig: int, frame: object) -> None:
        # Settings are read once, so there is nothing to reload in place; SIGHUP's default
        # action would kill the process mid-request. It drains and exits 0 like SIGTERM, for
        # a supervisor to start bgeserve again with the new environment.
        log.warning("SIGHUP: settings are read once at start; draining and exiting (exit 0) "
                    "so that the supervisor starts bgeserve again with the new ones")
        server.should_exit = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        # Started under nohup (hangups ignored), closing the terminal must not stop it: there
        # is no supervisor to start it again.
        signal.signal(signal.SIGHUP, on_hangup)
    try:
        server.run(sockets=sockets)
    except SystemExit as exc:  # uvicorn's own exit when it cannot listen (a port taken since)
        code = exc.code if isinstance(exc.code, int) and exc.code else 1
        print(f"bgeserve: could not listen on {settings.bind} (--bind / BGE_M3_BIND); "
              "see the error above", file=sys.stderr)
    else:
        code = 3 if service.fatal_error is not None else 0
        if service.fatal_error is not None:  # the log has it too; stderr is where people look
            print(f"bgeserve: start-up failed: {service.fatal_error}", file=sys.stderr)
    # A preparation still running (stopped mid-start) lives in processes of its own, which the
    # exit below would leave running: they end with the server (Service.stop does it too, when
    # the lifespan got as far as stopping the service).
    service.preparation.stop()
    _leave_if_runs_remain(code)
    return code


def port_taken(bind: str, source: str) -> str | None:
    """Why ``bind`` (HOST:PORT, from ``source``) cannot be listened on, or None: bound and
    released at once, the way uvicorn binds it (IPv6 when the host has a colon)."""
    import errno
    import socket

    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, int(port)))
    except OSError as exc:
        why = exc.strerror or str(exc)
        advice = {errno.EADDRINUSE: "stop what holds it or choose another HOST:PORT",
                  errno.EACCES: "ports under 1024 need root or CAP_NET_BIND_SERVICE: choose "
                                "a port from 1024 up",
                  errno.EADDRNOTAVAIL: "this host has no such address: choose one it has, "
                                       "0.0.0.0 or [::]"}.get(exc.errno or 0,
                                                             "choose another HOST:PORT")
        return f"cannot listen on {bind} ({source}): {why}; {advice}"
    return None


def _leave_if_runs_remain(code: int) -> None:
    """Exit at once when threads outlive the drain: a worker still inside ``session.run``
    past BGE_M3_SHUTDOWN_TIMEOUT_SECS (its requests were already answered 503) must not meet
    the interpreter's finalization, where ONNX Runtime's thread pools abort the process
    ("terminate called without an active exception", exit -6 instead of 0)."""
    import logging
    import os
    import threading

    if any(t.is_alive() for t in threading.enumerate() if t is not threading.main_thread()):
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):  # None where it was closed (``>&-``)
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        os._exit(code)


def _probe(args: argparse.Namespace) -> int:
    """Run the startup probe in the foreground and print what it measured."""
    import os

    from bgeserve.config import Settings, warn_unknown_variables
    from bgeserve.errors import BgeServeError
    from bgeserve.logs import setup_logging
    from bgeserve.service import foreground_probe, plan

    try:
        settings = Settings.from_env(os.environ)
        setup_logging("text", settings.log_level)
        warn_unknown_variables(os.environ)
        settings = plan.resolve(settings)
        shapes = foreground_probe.parse_shapes(args.shapes) if args.shapes else None
    except BgeServeError as exc:  # a bad variable: its message, not a traceback
        print(f"bgeserve: {exc}", file=sys.stderr)
        return 2
    try:
        return foreground_probe.run(settings, shapes)
    except BgeServeError as exc:  # an unusable cache or model directory: one line, as serve
        print(f"bgeserve probe: {exc}", file=sys.stderr)
        return 3


def _prepare(args: argparse.Namespace) -> int:
    """Make (or find) the prepared export of the configured snapshot; print its directory."""
    import os
    import signal

    from bgeserve.config import Settings, warn_unknown_variables
    from bgeserve.errors import BgeServeError
    from bgeserve.logs import setup_logging
    from bgeserve.model.artifacts import validate_cache_dir
    from bgeserve.progress import Progress, on_terminal
    from bgeserve.service.preparation import PrepareFailed, prepare_command

    try:
        settings = Settings.from_env(os.environ)
    except BgeServeError as exc:
        print(f"bgeserve: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_format, settings.log_level, stderr=True)  # stdout: the path
    warn_unknown_variables(os.environ)

    def stop(signum: int, frame: object) -> None:
        # SIGTERM unwinds like Ctrl-C (exit 143): the prepare child and its step are ended and
        # the staging directory removed on the way out (the default action left it behind).
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        path = prepare_command(settings, validate_cache_dir(settings.cache_dir), args.variant,
                               force=args.force, out=args.out,
                               progress=Progress(bars=on_terminal()))
    except (BgeServeError, PrepareFailed) as exc:
        print(f"bgeserve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: expected; nothing half-made is kept, no traceback
        print("bgeserve prepare: interrupted; nothing half-made was kept, run it again to "
              "prepare", file=sys.stderr)
        return 130
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``bgeserve`` command. Ctrl-C before a command handles it itself (``serve`` does
    once uvicorn runs; ``prepare`` and ``bulk`` do) is one line and exit 130: seconds of
    imports and planning come first, and a traceback there reads as a crash."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("bgeserve: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    from bgeserve.config import Settings

    parser = argparse.ArgumentParser(prog="bgeserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="run the HTTP server", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the HTTP server. Configuration comes from the environment:",
        epilog=Settings.help_text())
    serve.add_argument("--bind", help="HOST:PORT (overrides BGE_M3_BIND)")
    probe_cmd = sub.add_parser("probe", help="run the memory probe now and print its table "
                               "(same environment variables as serve)")
    probe_cmd.add_argument("--shapes", help="BxS,BxS to measure instead of the default shapes")
    prep = sub.add_parser(
        "prepare", help="hub ONNX snapshot → bgeserve's fast graphs, cached (no torch; serve "
        "does this on its first start)", description="Prepare bgeserve's own graphs (heads "
        "inside, bounded attention, int8, bf16, ov-int8) from the snapshot serve would use "
        "(BGE_M3_MODEL_PATH, else the hub download) into BGE_M3_CACHE_DIR/prepared, and print "
        "the directory: a `bgeserve export` that serve picks up by itself.")
    prep.add_argument("--variant", action="append", choices=["fp32", "int8", "bf16", "ov-int8"],
                      help="repeatable (default: fp32, int8, bf16 where this CPU has it, and "
                      "ov-int8 where it has VNNI or AMX-INT8)")
    prep.add_argument("--force", action="store_true", help="prepare again even if cached")
    prep.add_argument("--out", type=Path, default=None,
                      help="also write the export to this directory (for BGE_M3_MODEL_PATH)")
    from bgeserve.bulk.main import add_arguments as bulk_arguments

    bulk_arguments(sub.add_parser("bulk", help="embed JSONL / Parquet / CSV files into "
                                  "Parquet shards (resumable; --ray for a cluster)"))
    export = sub.add_parser("export", help="PyTorch bge-m3 → ONNX with in-graph heads")
    from bgeserve.export.main import add_arguments

    add_arguments(export)
    rand = sub.add_parser("build-random-model",
                          help="build a random-weight bge-m3 or reranker (tests, benchmarks)")
    rand.add_argument("--kind", choices=["embedding", "reranker"], default="embedding",
                      help="bge-m3 (default) or bge-reranker-v2-m3's layout")
    rand.add_argument("--size", choices=["tiny", "full"], default="tiny",
                      help="tiny: 2 layers, hidden 32, seconds to build (default); full: "
                      "the real model's 24 layers x 1024, 250,002 pieces, ~2.3 GB")
    rand.add_argument("--seed", type=int, default=0,
                      help="weights and tokenizer; the same size, seed and vocabulary give the "
                      "same files (default 0)")
    rand.add_argument("--vocab-size", type=int, default=None,
                      help="tokenizer pieces (default 3,000 for tiny, 250,002 for full; at "
                      "least ~970, the generated alphabet and the specials)")
    rand.add_argument("--out", required=True, help="directory to write (made atomically)")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "probe":
        return _probe(args)
    if args.command == "prepare":
        return _prepare(args)
    if args.command == "bulk":
        from bgeserve.bulk.main import run as bulk

        return bulk(args)
    missing = _missing_export_extra() if args.command in ("export", "build-random-model") else []
    if missing:  # a serving install: one line, not an import traceback from a child step
        print(f"bgeserve {args.command}: needs {' and '.join(missing)}, which a serving install "
              "leaves out: pip install 'bgeserve[export]' (from a checkout: pip install -e "
              "'.[export]'; torch's CPU build: add --extra-index-url "
              "https://download.pytorch.org/whl/cpu)", file=sys.stderr)
        return 2
    if args.command == "export":
        from bgeserve.errors import BgeServeError
        from bgeserve.export.main import run

        try:
            return run(args)
        except BgeServeError as exc:  # a checkpoint it cannot export: why, not a traceback
            print(f"bgeserve export: {exc}", file=sys.stderr)
            return 1
    from bgeserve.testing.randmodel import main as build

    rest = ["--kind", args.kind, "--size", args.size, "--seed", str(args.seed), "--out", args.out]
    if args.vocab_size:
        rest += ["--vocab-size", str(args.vocab_size)]
    return build(rest)


def _missing_export_extra() -> list[str]:
    """The PyTorch stack ``export`` and ``build-random-model`` load, where it is not installed
    (found without importing it: torch alone takes seconds)."""
    import importlib.util

    return [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]


if __name__ == "__main__":
    sys.exit(main())
