"""``python -m bgeserve.export.prepare``: a hub snapshot's ONNX graph → a local bgeserve export.

No torch, no transformers: the hub's fp32 graph is rewritten with ``onnx`` (heads inside, the
export's bounded attention and FFN row blocks) and the fast variants are made from it with ONNX
Runtime's quantizer (int8: SmoothQuant calibrated on the fp32 graph's own activations),
OpenVINO (bf16) and NNCF (ov-int8: OpenVINO's int8, as ``bgeserve export`` makes it). Every
variant, fp32 included, is validated against the hub graph itself and the figures go into the
manifest's ``agreement``, so the server's default choice (runtime/select.py) reads them as it
reads an export's. Each heavy step runs in a process of its own, one at a time, so the peak
memory is that of one step.

The server runs this module as a child (service/preparation.py decides and keeps the cache;
service/recipe.py runs the child and reads the progress this prints: one JSON object per line
on stdout, ``{"event": "step" | "line" | "done" | "failed", ...}``); serving code never
imports the build tools.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bgeserve import __version__
from bgeserve.export import corpus, prepare_steps
from bgeserve.export.main import GRAPH_PATHS, MANIFEST_SCHEMA, OUTPUTS, RUNTIMES, sha256
from bgeserve.export.steps import INT8_WEIGHTS
from bgeserve.model import prepared
from bgeserve.model.layout import Layout
from bgeserve.model.prepared import PrepareSource, graph_files

VARIANTS = ("fp32", "int8", "bf16", "ov-int8")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# The prepared fp32 graph must compute what the hub graph computes: fp32 tolerances of
# SPEC §2. Anything worse means the rewrite misread this graph, and it is not served.
FP32_MIN_DENSE_COS = 0.99999
FP32_MAX_SPARSE_ABS = 1e-4
WORK = ".work"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class PrepareFailed(Exception):
    """A step failed; ``step`` names it, the message says why (the child's last lines)."""

    def __init__(self, step: str, message: str):
        super().__init__(f"prepare step {step!r} failed: {message}")
        self.step = step


@dataclass
class Outcome:
    """What a preparation made: variants written, variants skipped (with why), seconds, and
    each step's seconds and peak RSS."""

    variants: list[str]
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    steps: dict[str, dict[str, float]] = field(default_factory=dict)  # seconds, peak RSS
    weights: str = "s7"  # int8's weight encoding (export.steps.INT8_WEIGHTS)
    # What each quantized variant's step did (int8: its weights; ov-int8: NNCF's report), for
    # the manifest as an export records it.
    quantization: dict[str, dict[str, Any]] = field(default_factory=dict)
    reused: list[str] = field(default_factory=list)  # variants linked from an earlier one
    # Variants of ``skipped`` left out because the caller said this machine had no room for
    # them (``skip``), not because their step failed: a later start with more room makes them.
    limited: list[str] = field(default_factory=list)


StepReport = Callable[[str, int, int], None]  # (step name, index, total)
LineReport = Callable[[str], None]


def prepare(source: PrepareSource, out: Path, variants: Sequence[str] = VARIANTS, *,
            skip: dict[str, str] | None = None, source_hashes: dict[str, str] | None = None,
            on_step: StepReport | None = None, on_line: LineReport | None = None,
            weights: str = "s7", reuse: Path | None = None) -> Outcome:
    """Write a ``bgeserve export`` of ``variants`` (fp32 always) made from ``source`` into
    ``out``; ``skip`` lists variants not to make, with the reason recorded in the manifest;
    ``weights`` is int8's weight encoding (``prepared.int8_weights()`` for this CPU).
    ``reuse`` is an earlier preparation of the same source and recipe (the same cache key):
    the variants it holds are linked from it with their recorded agreement, and only the
    others are made and validated (a start asking for bf16 after a default preparation does
    not quantize int8 again).
    Raises PrepareFailed when fp32 cannot be made or disagrees with the hub graph; an int8,
    bf16 or ov-int8 step that fails is skipped, with its reason."""
    started = time.monotonic()
    asked = [v for v in VARIANTS if v in variants or v == "fp32"]
    kept = _reusable(reuse, asked)  # before the skips: a variant held already costs nothing
    skipped = {v: why for v, why in (skip or {}).items() if v not in kept}
    wanted = [v for v in asked if v in kept or v not in skipped or v == "fp32"]
    fresh = [v for v in wanted if v not in kept]
    out.mkdir(parents=True, exist_ok=True)
    work = out / WORK
    work.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source.tokenizer.parent / name).is_file():
            shutil.copyfile(source.tokenizer.parent / name, out / name)
    if source.config is not None:
        shutil.copyfile(source.config, out / "config.json")
    tokenizer = out / "tokenizer.json"
    prepared.write_heads(source.heads, work / prepared.HEADS_FILE)
    steps = ["graphs", *(v for v in fresh if v != "fp32"), "FFN row blocks", "validation"]
    run = _Runner(steps, on_step, on_line)

    config = ["--config", str(source.config)] if source.config is not None else []
    run("graphs", [prepare_steps.__name__, "graphs", str(source.graph),
                   source.layout.hidden_output or "", str(work), *config])
    dims = json.loads((work / "dims.json").read_text())
    for entry in kept.values():
        assert reuse is not None
        # Hard links: ONNX Runtime and OpenVINO read them; nothing here loads them with onnx
        # (which refuses a file with several links), and once the earlier export is replaced
        # each has one link again.
        prepare_steps.link_data(reuse, out, {str(p.relative_to(reuse)) for p in
                                             graph_files(reuse / entry["path"])}, link=True)
    # int8 is quantized from the fp32 graph before its FFN is cut into row blocks; a kept fp32
    # graph is already cut (and linked), so it comes from this run's own copy.
    if "fp32" in kept:
        fp32_graph = work / GRAPH_PATHS["fp32"]
    else:
        os.replace(work / "fp32", out / "fp32")
        fp32_graph = out / GRAPH_PATHS["fp32"]
    limit = ["--max-tokens", str(corpus.capped(dims.get("max_positions")))]
    if "int8" in fresh:
        _optional(run, skipped, "int8", ["bgeserve.export.steps", "int8", str(fp32_graph),
                                         str(out / GRAPH_PATHS["int8"]),
                                         "--tokenizer", str(tokenizer), *limit,
                                         "--weights", weights])
    if "bf16" in fresh:
        _optional(run, skipped, "bf16", ["bgeserve.export.steps", "openvino",
                                         str(work / "plain" / "model.onnx"),
                                         str(out / GRAPH_PATHS["bf16"])])
    # int8's encoding is the key's (a kept int8 graph has it too); ov-int8's report is its own.
    quantization = {v: e["quantization"] for v, e in kept.items() if "quantization" in e}
    quantization["int8"] = {"weights": weights}
    if "ov-int8" in fresh:
        # From the plain graph (OpenVINO fuses its attention; NNCF leaves that in float), with
        # the weight encoding this CPU computes right (ovint8.weights_here).
        report = work / "ov-int8.json"
        _optional(run, skipped, "ov-int8", ["bgeserve.export.steps", "ov-int8",
                                            str(work / "plain" / "model.onnx"),
                                            str(out / GRAPH_PATHS["ov-int8"]),
                                            "--tokenizer", str(tokenizer), *limit,
                                            "--report", str(report)])
        if "ov-int8" not in skipped:
            quantization["ov-int8"] = json.loads(report.read_text())
    new = [v for v in fresh if v not in skipped]
    # Never a kept graph: its files are links to the earlier preparation's.
    blocked = [str(out / GRAPH_PATHS[v]) for v in ("fp32", "int8") if v in new]
    if dims.get("ffn_rows") and blocked:
        run("FFN row blocks", ["bgeserve.export.steps", "rowblock", *blocked,
                               "--rows", str(dims["ffn_rows"])])
    else:
        run.skip("FFN row blocks")
    agreement = {v: entry["agreement"] for v, entry in kept.items()}
    if new:
        result = work / "agreement.json"
        graphs = [f"{v}={out / GRAPH_PATHS[v]}:{RUNTIMES.get(v, 'onnxruntime')}" for v in new]
        run("validation", [prepare_steps.__name__, "check", str(work), str(result),
                           "--tokenizer", str(tokenizer), *limit,
                           *(x for g in graphs for x in ("--graph", g))])
        agreement.update(json.loads(result.read_text()))
    else:
        run.skip("validation")
    fp32 = agreement["fp32"]
    if (fp32["dense_cos_min"] < FP32_MIN_DENSE_COS
            or fp32["sparse_max_abs"] > FP32_MAX_SPARSE_ABS):
        raise PrepareFailed("validation", f"the rewritten fp32 graph disagrees with the hub "
                            f"graph ({fp32}): bgeserve misread this graph; serve it as it is "
                            "with BGE_M3_PREPARE=0 and report the graph's origin")
    made = [v for v in wanted if v in kept or v in new]
    outcome = Outcome(made, skipped, round(time.monotonic() - started, 1), run.measured,
                      weights, {v: q for v, q in quantization.items() if v in made},
                      list(kept), sorted(v for v in skip or {} if v in skipped))
    _write_manifest(out, source, dims, agreement, outcome, source_hashes or {})
    shutil.rmtree(work)
    return outcome


class _Runner:
    """Runs ``python -m MODULE ARGS`` steps in order, reporting each; keeps a failing child's
    last lines for the error."""

    def __init__(self, steps: list[str], on_step: StepReport | None,
                 on_line: LineReport | None):
        self.steps = steps
        self.on_step = on_step
        self.on_line = on_line
        self.measured: dict[str, dict[str, float]] = {}  # step -> seconds, peak_rss_mib

    def skip(self, name: str) -> None:
        self.steps.remove(name)

    def __call__(self, name: str, argv: list[str]) -> None:
        if self.on_step is not None:
            self.on_step(name, self.steps.index(name) + 1, len(self.steps))
        tail: deque[str] = deque(maxlen=12)
        started = time.monotonic()
        # The step dies with this process, even SIGKILLed. Between fork and exec only the
        # system call runs (libc's prctl is looked up here, before the fork): no lock a
        # thread of this process (numpy's BLAS, say) might hold is needed.
        with subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, errors="replace",
                              preexec_fn=parent_death_signal()) as child:  # noqa: PLW1509
            assert child.stderr is not None
            in_traceback = False
            try:
                for line in child.stderr:
                    line = line.rstrip()
                    if line:
                        tail.append(line)
                        # A child's traceback is kept for the failure, not logged line by
                        # line as progress (a disk filling up gave 95 INFO lines of it).
                        in_traceback = (line.startswith("Traceback (most recent call last)")
                                        or (in_traceback and _ERROR.match(line) is None))
                        if self.on_line is not None and not in_traceback \
                                and _ERROR.match(line) is None:
                            self.on_line(line)
            except BaseException:  # SIGTERM (the server stopping): the step ends with us
                child.kill()
                raise
            # Reaped here rather than by Popen, for this child's own peak RSS (wait4).
            _, status, usage = os.wait4(child.pid, 0)
            child.returncode = os.waitstatus_to_exitcode(status)
        self.measured[name] = {"seconds": round(time.monotonic() - started, 1),
                               "peak_rss_mib": usage.ru_maxrss >> 10}  # ru_maxrss: KiB
        if self.on_line is not None:
            self.on_line(f"{name}: {self.measured[name]['seconds']}s, peak RSS "
                         f"{self.measured[name]['peak_rss_mib']} MiB")
        if child.returncode != 0:
            raise PrepareFailed(name, _exit_reason(child.returncode) + _last_words(tail))


# The last line of a Python traceback: the exception and its message.
_ERROR = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")


def _last_words(tail: Sequence[str]) -> str:
    """What a failed step said last: its exception's line where it raised one (a traceback
    fragment before: "... writable.write(content) | OSError: [Errno 28] ..."), else its last
    lines."""
    errors = [line for line in tail if _ERROR.match(line)]
    if errors:
        return ": " + errors[-1]
    return ": " + " | ".join(list(tail)[-4:]) if tail else ""


def _exit_reason(code: int) -> str:
    if code in (-9, 137):
        return "killed (SIGKILL: most likely out of memory)"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit code {code}"


def _optional(run: _Runner, skipped: dict[str, str], variant: str, argv: list[str]) -> None:
    """Run a variant's step; a failure skips the variant (recorded) instead of the whole."""
    try:
        run(variant, argv)
    except PrepareFailed as exc:
        skipped[variant] = str(exc)
        if run.on_line is not None:
            run.on_line(f"{variant} skipped: {exc}")


def _reusable(reuse: Path | None, asked: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The manifest entries of the ``asked`` variants that ``reuse`` (a complete preparation
    of the same key) holds whole: the graph, its files' recorded size, its agreement. None
    without fp32 (every variant is validated against the same hub graph)."""
    if reuse is None:
        return {}
    try:
        variants = json.loads((reuse / "manifest.json").read_text())["variants"]
        kept = {v: variants[v] for v in asked if v in variants and _whole(reuse, variants[v])}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return kept if "fp32" in kept else {}


def _whole(root: Path, entry: dict[str, Any]) -> bool:
    """Whether an export's variant ``entry`` is all there (a cheap check: sizes, not hashes)."""
    return "agreement" in entry and prepared.damage(root, entry) is None


def _write_manifest(out: Path, source: PrepareSource, dims: dict[str, Any],
                    agreement: dict[str, Any], outcome: Outcome,
                    hashes: dict[str, str]) -> None:
    variants = {}
    for variant in outcome.variants:
        graph = out / GRAPH_PATHS[variant]
        entry: dict[str, Any] = {
            "path": GRAPH_PATHS[variant], "sha256": sha256(graph), "bytes": graph.stat().st_size,
            "total_bytes": sum(p.stat().st_size for p in graph_files(graph)),
            # vs the hub graph itself (heads in ONNX), on validate.py's texts
            "agreement": agreement[variant]}
        if variant in RUNTIMES:
            entry.update(runtime=RUNTIMES[variant], attention="plain (the runtime fuses it)")
        if variant in outcome.quantization:
            # As an export records it: a standalone copy (`bgeserve prepare --out`) may be
            # served on another CPU, where signed 8-bit weights could saturate (runtime.select).
            entry["quantization"] = outcome.quantization[variant]
        variants[variant] = entry
    model = {k: dims[k] for k in ("hidden", "heads", "intermediate", "layers", "max_positions",
                                  "attention_block", "ffn_rows") if k in dims}
    manifest = {
        "format": "bgeserve-export",
        "schema": MANIFEST_SCHEMA,
        "bgeserve_version": __version__,
        "opset": dims.get("opset"),
        "attention_block": dims.get("attention_block"),
        "hidden_size": dims["hidden"],
        "model": model,
        "outputs": list(OUTPUTS),
        "variants": variants,
        "tokenizer": "tokenizer.json",
        "source": {"model": source.description, "layout": source.layout.value,
                   "files": hashes},
        "prepared": {"schema": prepared.RECIPE["schema"], "seconds": outcome.seconds,
                     "skipped": outcome.skipped, "steps": outcome.steps,
                     "int8_weights": outcome.weights, "reused": outcome.reused,
                     "limited": outcome.limited},
    }
    path = out / "manifest.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, path)


def parent_death_signal() -> Callable[[], None]:
    """A function that has the kernel send the process calling it SIGTERM when the process
    that started it ends (Linux; a no-op elsewhere), libc's prctl looked up now, so that
    called after a fork (``preexec_fn``) it makes the system call and nothing else."""
    prctl = None
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            pass  # no prctl (another libc): the parent's stop() still ends the process

    def arm() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return arm


def die_with_parent() -> None:
    """Have the kernel send this process SIGTERM when the process that started it ends: a
    server killed outright must not leave a preparation running, holding gigabytes for
    minutes, with nobody to read its result. (A parent gone in the moment before this runs is
    not caught: this process would then see parent pid 1, which is also what it sees while the
    server runs as a container's process 1, so that cannot tell.)"""
    parent_death_signal()()


def _stop_on_sigterm() -> None:
    """SIGTERM (the server stopping, or dying: ``die_with_parent``) raises SystemExit in the
    main thread, so the step running now is killed on the way out (``_Runner``), not orphaned."""
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def _event(kind: str, **fields: object) -> None:
    """One progress event for the parent, on stdout."""
    print(json.dumps({"event": kind, **fields}), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Prepare as the arguments say, reporting on stdout; 0 on success, 1 on failure."""
    parser = argparse.ArgumentParser(prog="python -m bgeserve.export.prepare")
    parser.add_argument("--graph", type=Path, required=True, help="the hub's fp32 graph")
    parser.add_argument("--external-data", type=Path, action="append", default=[])
    parser.add_argument("--layout", choices=[Layout.BAAI.value, Layout.HIDDEN.value],
                        required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--heads", type=Path, required=True, help="prepared.write_heads' npz")
    parser.add_argument("--description", default="hub snapshot")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variant", action="append", choices=VARIANTS, default=[])
    parser.add_argument("--skip", action="append", default=[], metavar="VARIANT=REASON")
    parser.add_argument("--weights", choices=INT8_WEIGHTS, default="s7")
    parser.add_argument("--hashes", type=Path, default=None, help="JSON {file: sha256}")
    parser.add_argument("--reuse", type=Path, default=None,
                        help="an earlier preparation of the same source: link what it has")
    args = parser.parse_args(argv)
    _stop_on_sigterm()
    die_with_parent()
    source = PrepareSource(args.graph, Layout(args.layout), args.tokenizer,
                           prepared.read_heads(args.heads), args.description,
                           tuple(args.external_data), args.config)
    skip = dict(item.split("=", 1) for item in args.skip)
    hashes = json.loads(args.hashes.read_text()) if args.hashes else {}
    try:
        outcome = prepare(source, args.out, args.variant or VARIANTS, skip=skip,
                          source_hashes=hashes, weights=args.weights, reuse=args.reuse,
                          on_step=lambda name, i, n: _event("step", name=name, index=i, of=n),
                          on_line=lambda text: _event("line", text=text))
    except PrepareFailed as exc:
        _event("failed", step=exc.step, message=str(exc))
        return 1
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which serves the stock graph
        _event("failed", step="prepare", message=f"{type(exc).__name__}: {exc}")
        return 1
    _event("done", outcome=asdict(outcome))
    return 0


if __name__ == "__main__":
    sys.exit(main())
