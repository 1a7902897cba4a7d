#!/usr/bin/env python3
"""bgeserve benchmark: FlagEmbedding vs raw ONNX Runtime / OpenVINO vs bgeserve in-process vs HTTP.

Everything runs from one invocation, so the ratios hold on a noisy machine. Each measurement
runs in its own child process (``bench.py _child SPEC``), so its peak RSS (VmHWM) is its own.

    .venv/bin/python scripts/bench.py                      # full-size random bge-m3, mixed corpus
    .venv/bin/python scripts/bench.py --quick              # tiny model: checks the script works
    .venv/bin/python scripts/bench.py --corpus both --load --rss-vs-length

Variants: ``fp32`` and ``int8`` run on ONNX Runtime, ``bf16`` and ``ov-int8`` (OpenVINO IRs)
on OpenVINO.
Modes (each per variant, except ``flag`` and ``ort1``, which are fp32 baselines):

- ``flag``:   FlagEmbedding ``BGEM3FlagModel`` fp32 on CPU, batch_size 16, max_length 8192,
              dense + sparse, ``torch.set_num_threads(--threads)``.
- ``ort1``:   ``onnxruntime.InferenceSession`` with ORT's default options (threads aside) on a
              plain-attention fp32 graph (``--plain-graph``), batch 1: what a user running the
              stock ORT export gets. Skipped without ``--plain-graph``.
- ``raw``:    the variant's runtime called directly (``InferenceSession.run``, or OpenVINO's
              ``compile_model`` + ``infer`` for bf16), texts packed exactly as bgeserve packs
              them (``bgeserve.engine.binpack.plan`` + ``bgeserve.engine.forward.pad_chunk``).
- ``raw1``:   the same session, each text alone (batch 1): the "raw runtime at batch 1" baseline.
- ``engine``: ``bgeserve.Engine`` in-process, one ``embed(all texts, dense, sparse)`` call,
              then a per-text latency pass.
- ``http``:   ``python -m bgeserve serve`` in a subprocess; ``--http-clients`` concurrent aiohttp
              clients POST ``--http-batch`` texts per request to ``/v1/embeddings:both``.
- ``serve``:  the same clients against the server as a user starts it: only the model path,
              the bind address and a cache dir set (the embedding cache off), so it measures
              its own variant, memory budget and chunk size at start-up (waited for) and
              serves what it chose; the row's variant is that choice. The cache dir is the
              run's own (``runs/<id>/serve-cache``): round 1 measures, later rounds start from
              what it cached, as a restart would. Its threads are the server's default.
- ``--load``: N concurrent clients (``--clients 1,16,64``), one short text per request, with
              cross-request batching on and off (``BGE_M3_CROSS_REQUEST_BATCHING=0``).
- ``--rss-vs-length``: one child per variant (``--rss-variants``) and length (512 … 8192) loads
              the engine and measures the RSS growth while embedding one text of that length.
- ``--chunk-sweep N,…``: ``raw`` on the mixed corpus per variant with ``plan(max_tokens=N)``,
              one child per point: throughput against padded tokens per chunk.
- ``--rerank-export DIR``: ``/v1/rerank`` (the reranker beside bge-m3) vs FlagReranker, and
  their agreement (``scripts/rerank_bench.py``; ``--rerank-args`` for its options).
- ``--plots DIR``: SVG plots of the sweep and of RSS growth vs length (needs matplotlib).
- Roofline: the machine's GEMM ceilings per precision (``scripts/gemm_ceiling.py``, in a child)
  and each corpus row's useful GFLOP/s as a share of its precision's ceiling
  (``benchkit/roofline.py``), so figures from different CPUs compare; ``--no-ceilings`` skips.

The parts live in ``scripts/benchkit/`` (one module per mode, plus corpus, runner, report,
roofline); this file is the command line and the plan of a run.

Results: markdown tables and ratios on stdout, JSON (and the same markdown) in ``--work-dir``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _path in (REPO, HERE):  # run as a plain script from a checkout; benchkit sits beside it
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from benchkit import roofline
from benchkit.common import (
    LONG_LENGTHS,
    MAX_SEQ,
    MODES,
    RSS_LENGTHS,
    RSS_VARIANTS,
    VARIANT_MODES,
    log,
    machine_info,
)
from benchkit.corpus import corpus_file
from benchkit.http import _body, _drive  # noqa: F401 - the load driver, tested by name
from benchkit.raw import variant_runtime
from benchkit.report import (
    _mib,
    agreement,
    load_gains,
    load_table,
    median_row,
    ratios,
    rss_table,
    summarize,
    sweep_row,
    sweep_table,
    table,
)
from benchkit.runner import Runner, child_main


def server_default_variant(export_dir: Path) -> str | None:
    """The variant ``bgeserve serve`` picks with neither BGE_M3_MODEL nor BGE_M3_EP set (bf16
    on OpenVINO where this CPU has native bf16, else fp32). Asked in a child, so the parent
    never imports OpenVINO."""
    code = ("import sys; from bgeserve.service import plan; "
            "from bgeserve.config import Settings; "
            "s = Settings.from_env({'BGE_M3_MODEL_PATH': sys.argv[1]}); "
            "print(plan.resolve(s).variant)")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(export_dir)], cwd=str(REPO),
                             capture_output=True, text=True, timeout=120, check=True)
        return out.stdout.strip().splitlines()[-1]
    except (subprocess.SubprocessError, IndexError) as exc:
        log(f"server default variant unknown ({exc}): no 'http <default> / flag' ratio")
        return None


def served_line(row: dict[str, Any]) -> str:
    """What a ``serve`` row's server chose for itself, from its /health once ready."""
    s = row["served"]
    timed = ", ".join(f"{v} {r:,.0f}" for v, r in (s.get("candidates") or {}).items())
    return (f"- {row['name']}: the server chose **{s.get('variant')}** ({s.get('choice')}"
            + (f"; its candidates' tokens/s on its start-up workload: {timed}" if timed else "")
            + f"), chunk budget {s.get('chunk_tokens')} padded tokens "
            f"({s.get('chunk_tokens_source')}), "
            + (f"run cost {_run_cost(s['run_cost'])}, " if s.get("run_cost") else "")
            + f"{s.get('threads')} threads; by round (the "
            "first start measures, later ones read its cache), answering after "
            + " / ".join(f"{x or 0:.0f}" for x in row.get("rounds_serving_s")
                         or [s.get("serving_s")])
            + " s, its start-up measurements done after "
            + " / ".join(f"{x or 0:.0f}" for x in row.get("rounds_load_s") or [row.get("load_s")])
            + " s\n")


def _run_cost(info: dict[str, float]) -> str:
    """/health's ``tuning.run_cost`` in words (the packer pads only where it pays)."""
    return (f"{info['fixed_ms']:.1f} ms + {info['per_token_ms']:.3f} ms/token + "
            f"{info['per_token_position_us']:.3f} us/token/position"
            + (f", {info['new_shape_ms']:.1f} ms per new shape" if "new_shape_ms" in info else ""))


def server_max_seq(args: argparse.Namespace, corpus: dict[str, Any]) -> int | None:
    """BGE_M3_MAX_SEQ_LENGTH for the server: ``auto`` = the corpus's longest text, at least
    512 (nothing is truncated); ``server`` = leave the server's default (8192)."""
    if args.http_max_seq == "server":
        return None
    if args.http_max_seq == "auto":
        return min(MAX_SEQ, max(512, max(corpus["lengths"])))
    return int(args.http_max_seq)


# ------------------------------------------------------------------------------ set-up
def run_tool(cmd: list[str], what: str) -> None:
    log(f"{what}: {shlex.join(cmd)}")
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=str(REPO))
    log(f"{what}: done in {time.perf_counter() - started:.0f}s")


def prepare(args: argparse.Namespace, work: Path, need_model: bool) -> tuple[Path, Path | None]:
    """Resolve (building or exporting when missing) the export dir and the PyTorch model dir."""
    size = "tiny" if args.quick else "full"
    model_dir = Path(args.model_dir).resolve() if args.model_dir else None
    export_dir = Path(args.export_dir).resolve() if args.export_dir else None
    if export_dir is None:
        export_dir = work / (f"onnx-{model_dir.name}" if model_dir else f"onnx-{size}")
    manifest_path = export_dir / "manifest.json"
    if model_dir is None and manifest_path.exists():  # the export knows its source
        src = json.loads(manifest_path.read_text()).get("source", {}).get("model")
        if src and (Path(src) / "config.json").exists():
            model_dir = Path(src)
    needs_export = not manifest_path.exists()
    if model_dir is None and (need_model or needs_export):
        model_dir = work / f"model-{size}"
        if not (model_dir / "config.json").exists():
            run_tool([sys.executable, "-m", "bgeserve", "build-random-model", "--size", size,
                      "--out", str(model_dir)], f"building the {size} random model")
    if needs_export:
        if args.export_dir and export_dir.exists() and any(export_dir.iterdir()):
            raise SystemExit(f"{export_dir} has no manifest.json: not a complete export")
        cmd = [sys.executable, "-m", "bgeserve", "export", "--model", str(model_dir),
               "--out", str(export_dir)]
        # no --variants: the export's own default (fp32, int8; bf16 with openvino, ov-int8 with nncf)
        for v in sorted(set(args.variants) | {"fp32"}) if args.variants else []:
            cmd += ["--variant", v]
        run_tool(cmd, "exporting")
    have = json.loads(manifest_path.read_text()).get("variants", {})
    if args.variants is None:
        args.variants = ["fp32", "int8"] + [v for v in ("bf16", "ov-int8") if v in have]
    missing = [v for v in args.variants if v not in have]
    if args.rss_vs_length and args.rss_variants is None:  # the default: those the export has
        args.rss_variants = [v for v in RSS_VARIANTS if v in have]
        for v in sorted(set(RSS_VARIANTS) - set(args.rss_variants)):
            log(f"rss-vs-length: the export has no {v} variant: skipped")
    elif args.rss_vs_length:
        missing += [v for v in args.rss_variants if v not in have and v not in missing]
    if missing:
        raise SystemExit(f"{export_dir} has no {', '.join(missing)} variant (has "
                         f"{', '.join(have)}); re-export with --variant")
    return export_dir, model_dir


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", default=str(REPO / "bench-out"),
                   help="models, exports, corpora, logs and results (default ./bench-out)")
    p.add_argument("--model-dir", help="PyTorch bge-m3 directory (default: the export's source, "
                                       "else build a random one in the work dir)")
    p.add_argument("--export-dir", help="bgeserve export (default: export into the work dir)")
    p.add_argument("--variants", default=None,
                   help="comma list of export variants: fp32, int8 (ONNX Runtime), bf16 "
                        "(OpenVINO) (default fp32,int8, plus bf16 when the export has it)")
    p.add_argument("--ep", choices=["cpu", "cuda", "tensorrt"], default="cpu",
                   help="execution provider for the engine, http and load modes (BGE_M3_EP); "
                        "GPU providers take only those modes")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (ORT and torch)")
    p.add_argument("--workers", type=int, default=1,
                   help="engine/http workers, sharing --threads (BGE_M3_WORKERS; CPU workers "
                        "share one session)")
    p.add_argument("--texts", type=int, default=None,
                   help="texts in the mixed corpus (default 64; 16 with --quick)")
    p.add_argument("--corpus", choices=["mixed", "long", "both"], default="mixed")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma list of {', '.join(MODES)}, or 'none' (default: all; ort1 "
                        "only with --plain-graph)")
    p.add_argument("--plain-graph", metavar="MODEL.onnx",
                   help="ort1 mode: a plain-attention fp32 graph with the dense and "
                        "sparse_weights outputs (`bgeserve export --attention-block 0 --variant "
                        "fp32`); without it ort1 is skipped")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the corpus modes N times, interleaved (A B C, then C B A, "
                        "...), and report each mode's median round (default 1)")
    p.add_argument("--quick", action="store_true", help="tiny model, fewer texts")
    p.add_argument("--no-latency-pass", action="store_true",
                   help="skip the per-text latency passes of flag and engine")
    p.add_argument("--http-clients", type=int, default=4,
                   help="http mode: concurrent clients (default 4)")
    p.add_argument("--http-batch", type=int, default=1,
                   help="http mode: texts per request (default 1)")
    p.add_argument("--http-budget", choices=["disabled", "probe"], default="disabled",
                   help="server memory model: BGE_M3_DISABLE_AUTO_BUDGET=1 (default), or run the "
                        "probe (cached in the work dir) and wait for it before measuring")
    p.add_argument("--http-max-seq", default="auto", metavar="auto|server|N",
                   help="server BGE_M3_MAX_SEQ_LENGTH: auto = the corpus's longest text (at "
                        "least 512; the memory floor check is then for that length), server = "
                        "its default 8192, or a number")
    p.add_argument("--http-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra server environment (repeatable), e.g. BGE_M3_BATCH_DELAY_MS=2")
    p.add_argument("--load", action="store_true",
                   help="also run the load test (short texts, batching on and off)")
    p.add_argument("--clients", default="1,16,64", help="load test client counts")
    p.add_argument("--load-requests", type=int, default=None,
                   help="requests per client count in the load test (default 256; 48 quick)")
    p.add_argument("--rss-vs-length", action="store_true",
                   help="also measure RSS growth for one text of 512..8192 tokens")
    p.add_argument("--rss-lengths", default=",".join(map(str, RSS_LENGTHS)))
    p.add_argument("--rss-variants", default=None,
                   help="variants for --rss-vs-length (default fp32,bf16: those the export has)")
    p.add_argument("--chunk-sweep", default="", metavar="N,N,...",
                   help="also run raw on the mixed corpus per variant with each max padded "
                        "tokens per chunk, e.g. 256,512,1024,2048,4096 (one child per point)")
    p.add_argument("--plots", metavar="DIR",
                   help="write SVG plots (throughput vs chunk size, RSS growth vs length) into "
                        "DIR; needs matplotlib")
    p.add_argument("--no-ceilings", action="store_true",
                   help="skip the GEMM ceilings (scripts/gemm_ceiling.py) and the roofline "
                        "shares")
    p.add_argument("--rerank-export", metavar="DIR",
                   help="also measure /v1/rerank with this reranker export (beside the bge-m3 "
                        "export) against FlagReranker: scripts/rerank_bench.py, in this run")
    p.add_argument("--rerank-args", default="", metavar="'OPTIONS'",
                   help="rerank_bench.py options for --rerank-export, e.g. '--variants "
                        "fp32,int8 --pairs 16 --docs-per-request 1'")
    p.add_argument("--server-timeout", type=float, default=900.0,
                   help="seconds to wait for the server's /health")
    p.add_argument("--child-timeout", type=float, default=7200.0,
                   help="seconds before a measurement is killed")
    args = p.parse_args(argv)
    def comma(value: str | None) -> list[str] | None:
        return None if value is None else [v.strip() for v in value.split(",") if v.strip()]

    args.variants = comma(args.variants)
    args.rss_variants = comma(args.rss_variants)
    args.modes = [] if args.modes.strip() == "none" else [
        m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {MODES}")
    if args.ep != "cpu":
        cpu_only = [m for m in args.modes if m not in ("engine", "http", "serve")]
        if cpu_only or args.rss_vs_length or args.chunk_sweep:
            p.error(f"--ep {args.ep} measures the engine, http, serve and load modes only; drop "
                    f"{', '.join(cpu_only) or '--rss-vs-length / --chunk-sweep'}")
    if args.http_max_seq not in ("auto", "server") and not args.http_max_seq.isdigit():
        p.error("--http-max-seq must be auto, server or a number of tokens")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.clients = [int(x) for x in args.clients.split(",") if x.strip()]
    args.rss_lengths = [int(x) for x in args.rss_lengths.split(",") if x.strip()]
    args.chunk_sweep = [int(x) for x in args.chunk_sweep.split(",") if x.strip()]
    if args.plain_graph:
        args.plain_graph = str(Path(args.plain_graph).resolve())
        if not Path(args.plain_graph).is_file():
            p.error(f"--plain-graph {args.plain_graph}: no such file")
    if args.texts is None:
        args.texts = 16 if args.quick else 64
    if args.load_requests is None:
        args.load_requests = 48 if args.quick else 256
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == ["_child"]:
        return child_main(argv[1])
    args = parse_args(argv)
    command = "python scripts/bench.py " + shlex.join(argv)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    export_dir, model_dir = prepare(args, work, need_model="flag" in args.modes)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    runner = Runner(args, work, export_dir, model_dir, run_id)
    tokenizer_path = export_dir / "tokenizer.json"
    started = time.perf_counter()
    runtimes = {v: variant_runtime(export_dir, v)
                for v in args.variants + (args.rss_variants if args.rss_vs_length else [])}
    default_variant = None
    if "http" in args.modes:  # GPU providers default to fp16 (runtime/gpu.py)
        default_variant = "fp16" if args.ep != "cpu" else server_default_variant(export_dir)
    meta = {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": command, "machine": machine_info(), "ep": args.ep,
            "export_dir": str(export_dir),
            "model_dir": str(model_dir) if model_dir else None, "threads": args.threads,
            "variants": args.variants, "runtimes": runtimes, "quick": args.quick,
            "plain_graph": args.plain_graph, "server_default_variant": default_variant}
    log(f"export {export_dir}, model {model_dir}, {args.threads} threads, run {run_id}, variants "
        + ", ".join(f"{v} ({runtimes[v]})" for v in args.variants)
        + (f"; server default {default_variant}" if default_variant else ""))
    if "ort1" in args.modes and not args.plain_graph:
        log("ort1: skipped (no --plain-graph)")

    rows: list[dict[str, Any]] = []
    corpora = ["mixed", "long"] if args.corpus == "both" else [args.corpus]
    lengths: dict[str, list[int]] = {}  # the corpora's token lengths, for the roofline
    for kind in corpora if args.modes else []:
        n = args.texts if kind == "mixed" else len(LONG_LENGTHS)
        cpath = corpus_file(work, tokenizer_path, kind, n)
        corpus = json.loads(cpath.read_text())
        lengths[kind] = corpus["lengths"]
        log(f"corpus {kind}: {len(corpus['texts'])} texts, {sum(corpus['lengths'])} tokens, "
            f"lengths {min(corpus['lengths'])}..{max(corpus['lengths'])}")
        plan_ = [("flag", "fp32")] if "flag" in args.modes else []
        if "ort1" in args.modes and args.plain_graph:
            plan_.append(("ort1", "fp32"))
        plan_ += [(m, v) for v in args.variants for m in VARIANT_MODES if m in args.modes]
        if "serve" in args.modes:
            plan_.append(("serve", "default"))
        if "flag" in args.modes and model_dir is None:
            plan_.remove(("flag", "fp32"))
            rows.append({"name": f"{kind}-flag", "mode": "flag", "variant": "fp32",
                         "corpus": kind, "texts": len(corpus["texts"]),
                         "tokens": sum(corpus["lengths"]), "ok": False,
                         "error": "no PyTorch model directory (--model-dir)"})
        # Rounds interleaved, each the reverse of the one before (A B C, C B A, ...): the
        # machine's drift then falls on every mode alike, and each mode reports its median.
        rounds: dict[tuple[str, str], list[dict[str, Any]]] = {m: [] for m in plan_}
        for r in range(args.rounds):
            for mode, variant in plan_ if r % 2 == 0 else plan_[::-1]:
                name = f"{kind}-{mode}-{variant}" + (f"-r{r + 1}" if args.rounds > 1 else "")
                res = runner.child(name, {"mode": mode, "variant": variant,
                                          "corpus": str(cpath),
                                          "max_seq": server_max_seq(args, corpus),
                                          **({"serve_cache": str(runner.run_dir / "serve-cache")}
                                             if mode == "serve" else {})})
                row = summarize(name, mode, variant, kind, corpus, res)
                if row.get("ok"):
                    chose = (f" (served {row['variant']}, ready in {row['load_s']:.0f} s)"
                             if mode == "serve" else "")
                    log(f"{name}: {row['tokens_per_s']:.1f} tokens/s, peak RSS "
                        f"{_mib(row['peak_rss'])} MiB{chose}")
                rounds[(mode, variant)].append(row)
        for key in plan_:
            row = median_row(rounds[key])
            row["name"] = f"{kind}-{key[0]}-{key[1]}"
            rows.append(row)
        if plan_ and not any(r["corpus"] == kind and r.get("ok") and r["variant"] == "fp32"
                             for r in rows):
            # No fp32 vectors to compare with: an untimed fp32 engine pass as the reference.
            name = f"{kind}-ref-fp32"
            res = runner.child(name, {"mode": "engine", "variant": "fp32", "corpus": str(cpath),
                                      "latency_pass": False})
            rows.append(summarize(name, "ref", "fp32", kind, corpus, res))
    agreement(rows)
    # Measured after the corpus runs, so the GEMM loop does not warm or heat what they time.
    ceiling = roofline.ceilings(args.threads) if rows and not args.no_ceilings else {}
    shares = roofline.shares(rows, lengths, roofline.Dims.of_export(export_dir), ceiling)

    sweep_rows: list[dict[str, Any]] = []
    if args.chunk_sweep:
        cpath = corpus_file(work, tokenizer_path, "mixed", args.texts)
        sweep_corpus = json.loads(cpath.read_text())
        for variant in args.variants:
            for max_tokens in args.chunk_sweep:
                name = f"sweep-{variant}-{max_tokens}"
                res = runner.child(name, {"mode": "raw", "variant": variant, "corpus": str(cpath),
                                          "max_tokens": max_tokens})
                row = sweep_row(name, variant, runtimes[variant], max_tokens, sweep_corpus, res)
                if row["ok"]:
                    log(f"{name}: {row['tokens_per_s']:.1f} tokens/s, "
                        f"{row['padded_per_chunk']:.0f} padded tokens per chunk")
                sweep_rows.append(row)

    load_rows: list[dict[str, Any]] = []
    if args.load:
        cpath = corpus_file(work, tokenizer_path, "load", 64)
        load_corpus = json.loads(cpath.read_text())
        for variant in args.variants:
            for batching in (True, False):
                name = f"load-{variant}-{'on' if batching else 'off'}"
                res = runner.child(name, {"mode": "load", "variant": variant,
                                          "corpus": str(cpath), "batching": batching,
                                          "max_seq": server_max_seq(args, load_corpus),
                                          "clients": args.clients,
                                          "load_requests": args.load_requests})
                load_rows.append({"name": name, "variant": variant, "batching": batching, **res})

    rss_rows: list[dict[str, Any]] = []
    if args.rss_vs_length:
        for variant in args.rss_variants:
            for length in args.rss_lengths:
                cpath = corpus_file(work, tokenizer_path, f"single-{length}", 1)
                name = f"rss-{variant}-{length}"
                res = runner.child(name, {"mode": "rss", "variant": variant, "corpus": str(cpath)})
                rss_rows.append({"name": name, "target": length, "variant": variant, **res})

    rerank = None
    if args.rerank_export:  # scripts/rerank_bench.py, next to this file (sys.path)
        import rerank_bench

        rerank = rerank_bench.run(rerank_bench.parse_args(
            ["--reranker-export", args.rerank_export, "--m3-export", str(export_dir),
             "--threads", str(args.threads), "--work", str(runner.run_dir / "rerank"),
             *shlex.split(args.rerank_args)]))

    plots: list[str] = []
    if args.plots:
        from bench_plots import write_plots  # scripts/, next to this file (sys.path[0])

        plots = [str(x) for x in write_plots(Path(args.plots), sweep_rows, rss_rows, log)]

    per_round: dict[str, list[float]] = {}
    all_ratios = {**ratios(rows, default_variant, per_round), **load_gains(load_rows)}
    m = meta["machine"]
    out = [f"# bgeserve benchmark {run_id}", "",
           f"- date: {meta['date']}",
           f"- machine: {m['nproc']} CPUs ({m['cpu_model']}), {m['mem_total_gib']} GiB, "
           f"{m['machine']}, Linux {m['kernel']}" + (f"; GPUs: {m['gpus']}" if m.get("gpus") else ""),
           "- versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v),
           f"- model: {model_dir or '—'}; export: {export_dir}; threads: {args.threads}"
           + (f"; engine/http workers: {args.workers} (one shared session, "
              f"{max(1, args.threads // args.workers)} thread(s) each)" if args.workers > 1
              else ""),
           "- variants: " + ", ".join(f"{v} ({runtimes[v]})" for v in args.variants)
           + (f"; execution provider: {args.ep}" if args.ep != "cpu" else "")
           + (f"; server default: {default_variant}" if default_variant else "")
           + (f"; ort1 graph: {args.plain_graph}" if args.plain_graph else ""),
           f"- command: `{command}`", ""]
    if rows:
        out += ["## Corpus runs", "", table(rows), ""]
        if args.rounds > 1:
            out += [(f"Each row is its mode's median of {args.rounds} rounds, run "
                     "interleaved (A B C, then C B A, ...); tokens/s of every round:"), ""]
            out += [f"- {r['name']}: " + " / ".join(f"{x:.0f}" for x in
                                                   r.get("rounds_tokens_per_s", []))
                    + (f" ({r['rounds_failed']} failed)" if r.get("rounds_failed") else "")
                    for r in rows if r.get("rounds_tokens_per_s")]
            out += [""]
        out += [served_line(r) for r in rows if r.get("mode") == "serve" and r.get("served")]
    if shares:
        out += [("## Each path: tokens/s, × FlagEmbedding fp32, share of its precision's "
                 "roofline (useful GFLOP/s ÷ its GEMM ceiling)"), "",
                roofline.table(shares, ceiling), ""]
    if all_ratios:
        out += ["## Ratios (tokens/s unless noted)", ""]
        if per_round:
            out += [("Of rows measured in rounds: the median of the per-round ratios (each "
                     "round's in brackets)."), ""]
        out += [f"- {k}: **{v:.2f}×**" + (" (" + ", ".join(f"{x:.3f}" for x in per_round[k])
                                          + ")" if k in per_round else "")
                for k, v in all_ratios.items()] + [""]
    if load_rows:
        out += ["## Load (one short text per request)", "", load_table(load_rows), ""]
    if sweep_rows:
        out += ["## Chunk size sweep (raw, mixed corpus)", "", sweep_table(sweep_rows), ""]
    if rss_rows:
        out += ["## RSS vs text length (engine, one text)", "", rss_table(rss_rows), ""]
    if rerank:
        out += ["## Rerank (/v1/rerank vs FlagReranker, scripts/rerank_bench.py)", "",
                rerank["markdown"], ""]
    if plots:
        out += ["## Plots", ""] + [f"- `{x}`" for x in plots] + [""]
    out += [f"Total time: {time.perf_counter() - started:.0f} s."]
    report = "\n".join(out)
    print(report)
    results = {"meta": meta, "runs": rows, "ratios": all_ratios,
               "ratios_per_round": per_round, "load": load_rows,
               "gemm_ceilings": ceiling, "roofline": shares,
               "chunk_sweep": sweep_rows, "rss_vs_length": rss_rows, "plots": plots,
               "rerank": rerank}
    for path in (runner.run_dir / "results.json", work / "results-latest.json"):
        path.write_text(json.dumps(results, indent=2, default=str))
    (runner.run_dir / "results.md").write_text(report + "\n")
    log(f"results: {runner.run_dir / 'results.json'} (and {work / 'results-latest.json'})")
    failed = [r["name"] for r in rows + sweep_rows + load_rows + rss_rows if not r.get("ok")]
    if failed:
        log(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

