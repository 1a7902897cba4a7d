"""The default variant, measured: with neither BGE_M3_EP nor BGE_M3_MODEL set, every variant of
the export that meets the agreement bar is timed on this machine and the fastest one serves.

``decide(settings, cache_dir)`` runs before the serving model loads. Each candidate
(``runtime.select.cpu_candidates``: read from the manifest, so a new variant needs no change
here) is loaded alone, in a process of its own (``probe_child``'s ``time`` task), and timed on
a short fixed workload (``tuning.synthetic.time_workload``: short queries and a mixed batch);
its memory is all given back when the process ends, and a candidate that would not fit the
memory beside this process is not loaded at all. The fastest wins, unless the rule's pick
(``runtime.select.cpu_default``, the prior) ran within ``PRIOR_MARGIN`` of it. The choice is
cached (``tuning.cache.ChoiceCache``) under a key of what the timings depend on — every
candidate's files and runtime, threads, workers, CPU — which does not include the choice, so a
warm start finds the choice and then that variant's probe fit without timing anything.

The rule stays when measuring is off (``BGE_M3_DISABLE_AUTO_BUDGET=1``) or impossible (a hub
snapshot, fewer than two candidates, nothing could be timed).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bgeserve import runtime
from bgeserve.config import Settings
from bgeserve.errors import BgeServeError
from bgeserve.model.artifacts import ModelArtifacts, export_variants, resolve
from bgeserve.model.dims import fitting_max_seq, model_dims
from bgeserve.runtime.select import (
    PRIOR_MARGIN,
    THIS_MACHINE,
    Candidate,
    Machine,
    cpu_candidates,
    pick,
)
from bgeserve.tuning import memory
from bgeserve.tuning.budget import HEADROOM_BYTES
from bgeserve.tuning.cache import Choice, ChoiceCache, fingerprint
from bgeserve.tuning.child import ChildDied, ChildStopped, run_json
from bgeserve.tuning.costmodel import CostModel, conservative_coefficients
from bgeserve.tuning.lock import measuring
from bgeserve.tuning.synthetic import MIXED_LENGTHS, workload_chunks

log = logging.getLogger("bgeserve.backend")
CHOICE_SCHEMA = 1  # bump when the workload or the way it is timed changes
ROUNDS = 2
# A variant refused for memory is timed again once a start has this much more than the
# refusing one had (less would time it again at every start of the same container).
REFUSED_MARGIN_BYTES = 512 << 20
MAX_WARMUP_SECONDS = 60.0  # a candidate whose warm-up round takes longer is not timed further

Timer = Callable[[dict[str, Any]], dict[str, Any]]  # a time-task spec -> its answer


@dataclass(frozen=True)
class Decision:
    """The settings that serve (variant, provider and ``variant_choice`` decided), and what
    the choice saw: each timed candidate's tokens/s, and why others were not timed."""

    settings: Settings
    candidates: dict[str, float] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    cached: bool = False
    providers: dict[str, str] = field(default_factory=dict)  # each candidate's
    key: str = ""  # the choice cache's (``keep`` rewrites it there)
    parts: dict[str, Any] = field(default_factory=dict)
    # Bytes free that would let a candidate left out for memory in (kept with the choice: a
    # start with that much times them all again).
    needs: dict[str, int] = field(default_factory=dict)


def measurable(settings: Settings) -> bool:
    """Whether the default is the rule's on a CPU and may be measured instead."""
    s = settings
    return (s.variant_choice == "rule" and not s.is_explicit("BGE_M3_EP")
            and not s.is_explicit("BGE_M3_MODEL") and not s.disable_auto_budget
            and not runtime.on_gpu(s.execution_provider) and s.model_path is not None)


def decide(settings: Settings, cache_dir: Path, *, timer: Timer | None = None,
           machine: Machine = THIS_MACHINE, stop: threading.Event | None = None,
           remeasure: bool = False,
           on_step: Callable[[str], None] | None = None) -> Decision:
    """The variant that serves ``settings`` (resolved by ``plan.resolve``): measured, cached,
    or the rule's when measuring is off or impossible. ``timer`` times one candidate (default:
    in a child process); ``remeasure`` ignores a cached choice (``bgeserve probe``);
    ``on_step`` hears which candidate is being timed (``/health``'s step while loading)."""
    if not measurable(settings):
        return Decision(settings)
    found, left_out = cpu_candidates(export_variants(settings.model_path), machine)
    artifacts: dict[Candidate, ModelArtifacts] = {}
    for c in found:
        try:
            artifacts[c] = resolve(model_path=settings.model_path, variant=c.variant,
                                   cache_dir=cache_dir, offline=True, progress=False)
        except BgeServeError as exc:  # a damaged file of the export: said, not only kept
            left_out[c.variant] = f"cannot be opened: {exc}"
            log.warning("variant choice: %s left out, it cannot be opened: %s", c.variant, exc)
    if len(artifacts) < 2:
        log.info("variant choice: %s, nothing to measure (%s)", settings.variant,
                 "; ".join(f"{v}: {why}" for v, why in left_out.items()) or "one variant")
        return Decision(settings, left_out=left_out)
    parts = choice_parts(settings, artifacts)
    key = fingerprint(parts)
    providers = {c.variant: c.provider for c in artifacts}
    store = ChoiceCache.at(cache_dir)
    use_cache = not (remeasure or settings.disable_probe_cache)

    def from_cache() -> Decision | None:
        cached = store.load(key) if use_cache else None
        roomier = _now_fits(settings, cached.needs) if cached is not None else []
        if roomier:  # the memory grew since: what was left out for it may be the fastest
            log.info("variant choice: cached, but %s, left out for memory then, fits now: "
                     "measuring again", ", ".join(roomier))
        elif cached is not None and any(c.variant == cached.variant for c in artifacts):
            log.info("variant choice (cached): %s on %s; measured %s", cached.variant,
                     cached.provider, _rates(cached.rates))
            return Decision(_serving(settings, cached.variant, cached.provider), cached.rates,
                            cached.left_out, cached=True, providers=providers, key=key,
                            parts=parts, needs=cached.needs)
        return None

    decided = from_cache()
    if decided is not None:
        return decided
    step = on_step or (lambda step: None)

    def waiting() -> None:
        log.info("variant choice: another process is timing these candidates (the same "
                 "BGE_M3_CACHE_DIR); waiting for its choice")
        step("choosing the variant: waiting for another process timing the same candidates")

    # Servers started together on one cache directory (replicas on a shared volume) timed
    # their candidates at once, each slowed by the others, and the last one's skewed choice
    # was kept for all: one times, the others wait and take its choice.
    with measuring(cache_dir, key, stop, on_wait=waiting):
        if stop is not None and stop.is_set():  # stopped, waiting or not: nothing to time
            return Decision(settings, left_out=left_out)
        decided = from_cache()  # another process's, saved while this one looked or waited
        if decided is not None:
            return decided
        rates, timed_out, needs, interrupted = _time_all(settings, cache_dir, artifacts,
                                                         timer or _child_timer(stop), step,
                                                         stop)
        left_out.update(timed_out)
        interrupted = interrupted or (stop is not None and stop.is_set())
        if not rates:
            log.warning("variant choice: no candidate could be timed (%s); serving the rule's "
                        "%s", "; ".join(f"{v}: {why}" for v, why in left_out.items()),
                        settings.variant)
            return Decision(settings, left_out=left_out)
        chosen = pick(rates, settings.variant)
        provider = next(c.provider for c in artifacts if c.variant == chosen)
        log.info("variant choice: %s on %s, measured %s (the rule's pick: %s)", chosen,
                 provider, _rates(rates), settings.variant)
        # A timing stopped (the server stopping, a signal to its process group) left a
        # candidate out for no reason of its own: kept, the choice would leave it out at every
        # later start.
        if not settings.disable_probe_cache and not interrupted:
            store.save(key, Choice(chosen, provider, rates, left_out, needs), parts)
        return Decision(_serving(settings, chosen, provider), rates, left_out,
                        providers=providers, key=key, parts=parts, needs=needs)


def without(decision: Decision, variant: str, reason: str) -> Decision | None:
    """The measured ``decision`` with ``variant`` left out (``reason``: it does not fit the
    memory here), serving the fastest candidate left that loads in less memory (one that
    takes more cannot fit where it did not: the full-size bf16 after int8, say). None where
    no such measured candidate is left. ``keep`` it once it has served."""
    entries = export_variants(decision.settings.model_path)
    limit = loaded_bytes(entries, variant)
    # Only sizes known to be smaller (a manifest of an older version records none: no way to
    # tell, so no fallback rather than one that may be killed for memory).
    rates = {v: r for v, r in decision.candidates.items()
             if v != variant and v in decision.providers and limit is not None
             and (size := loaded_bytes(entries, v)) is not None and size < limit}
    if decision.settings.variant_choice not in ("measured", "fallback") or not rates:
        return None
    chosen = max(rates, key=lambda v: rates[v])
    provider = decision.providers[chosen]
    log.warning("variant choice: %s does not fit the memory here (%s); serving %s, the "
                "fastest measured of those that load in less (%s)", variant,
                reason.split(". ")[0], chosen, _rates(rates))
    # Timed again (it may be the fastest) once a start has clearly more memory than this one.
    available = memory.detect_available_memory(
        decision.settings.available_memory_bytes).available_bytes
    return dataclasses.replace(
        decision, candidates=rates, left_out={**decision.left_out, variant: reason},
        needs={**decision.needs, variant: available + REFUSED_MARGIN_BYTES},
        settings=dataclasses.replace(_serving(decision.settings, chosen, provider),
                                     variant_choice="fallback"))


def keep(decision: Decision, cache_dir: Path) -> None:
    """Keep a ``fallback`` that served in the choice cache, so that a restart serves it at
    once (a start refused for memory every time, the refused choice cached, was a crash
    loop); kept only once it has served, or a fallback that failed too would hide the first
    refusal's advice from every later start."""
    s = decision.settings
    if s.variant_choice == "fallback" and decision.key and not s.disable_probe_cache:
        ChoiceCache.at(cache_dir).save(decision.key, Choice(
            s.variant, s.execution_provider, decision.candidates, decision.left_out,
            decision.needs), decision.parts)


def smaller_variants(settings: Settings, served: str, mine: int) -> str:
    """The export's other variants that load in less memory than ``served`` (``mine``: its
    estimated resident bytes a copy), with their estimated resident size, smallest first
    ("int8 (~1630 MiB loaded, ...)"): the way out of a model too big for the memory. By what
    they hold once loaded, not their files: bf16's IR is smaller than int8's graph and takes
    more (OpenVINO keeps a bf16 copy), ov-int8's far smaller and takes more still."""
    def agreement(entry: dict[str, Any]) -> str:  # what it gives up, where it was measured
        found = entry.get("agreement")
        cos = found.get("dense_cos_min") if isinstance(found, dict) else None
        return f", dense cosine {cos:.4f} vs fp32" if isinstance(cos, float) else ""

    entries = export_variants(settings.model_path)
    smaller = sorted((size, variant) for variant in entries
                     if variant not in (served, "fp16")  # fp16: the GPU's
                     and (size := loaded_bytes(entries, variant)) is not None)
    return ", ".join(f"{variant} (~{size >> 20} MiB loaded{agreement(entries[variant])}, "
                     f"BGE_M3_MODEL={variant})" for size, variant in smaller if size < mine)


def loaded_bytes(entries: Mapping[str, Mapping[str, Any]], variant: str) -> int | None:
    """Bytes ``variant`` of an export (its manifest ``entries``) holds once loaded, by its
    files and its runtime's ``resident_factor``; None where its size is not recorded."""
    entry = entries.get(variant) or {}
    size = entry.get("total_bytes")
    if not isinstance(size, int) or isinstance(size, bool):
        return None
    kind = "openvino" if entry.get("runtime") == "openvino" else "cpu"
    return int(size * runtime.get(kind).resident_factor(variant))


def _now_fits(settings: Settings, needs: Mapping[str, int]) -> list[str]:
    """The candidates left out for memory (``needs``: bytes each asked for) that fit now."""
    if not needs:
        return []
    available = memory.detect_available_memory(settings.available_memory_bytes).available_bytes
    free = available - memory.rss_bytes()
    return sorted(v for v, need in needs.items() if need <= free)


def _serving(settings: Settings, variant: str, provider: str) -> Settings:
    return dataclasses.replace(settings, variant=variant, execution_provider=provider,
                               variant_choice="measured")


def _rates(rates: Mapping[str, float]) -> str:
    return ", ".join(f"{v} {r:.0f} tokens/s" for v, r in sorted(rates.items(),
                                                                key=lambda kv: -kv[1]))


def _dist(name: str) -> str:
    """A runtime's version without importing it (openvino would cost the server memory)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def choice_parts(settings: Settings,
                 artifacts: Mapping[Candidate, ModelArtifacts]) -> dict[str, Any]:
    """What the candidates' timings depend on: the choice cache's key parts (not the choice)."""
    from bgeserve.runtime.onnx import cpu_description

    return {
        "choice_schema": CHOICE_SCHEMA,
        "candidates": {f"{c.variant}@{c.provider}": a.identity()
                       for c, a in sorted(artifacts.items(), key=lambda kv: kv[0].variant)},
        "runtimes": {name: _dist(name) for name in ("onnxruntime", "openvino")},
        "threads": settings.threads_per_worker, "workers": settings.workers,
        "chunk_tokens": settings.max_chunk_tokens, "cpu": cpu_description(),
        "workload_max_seq": workload_max_seq(settings, artifacts),
    }


def workload_max_seq(settings: Settings, artifacts: Mapping[Candidate, ModelArtifacts]) -> int:
    """The longest text of the timing workload: cut to what the candidates' positions hold
    and to BGE_M3_MAX_SEQ_LENGTH, as the server cuts a text."""
    return min([max(MIXED_LENGTHS), *(fitting_max_seq(settings.max_seq_length, a)
                                      for a in artifacts.values())])


def chunk_tokens(settings: Settings, provider: str) -> int:
    """The padded tokens per run a candidate serves with (its runtime's best, unless set)."""
    return settings.max_chunk_tokens or runtime.get(provider).chunk_tokens


def memory_needed(settings: Settings, artifacts: ModelArtifacts, provider: str,
                  max_seq: int | None = None) -> int:
    """Bytes a candidate's timing process may need: its files' resident copy, the headroom,
    and the workload's largest chunk by the conservative cost model."""
    files = sum(p.stat().st_size for p in (artifacts.onnx_path, *artifacts.external_data))
    a, b = conservative_coefficients(**model_dims(artifacts))
    largest = max(CostModel(a, b, 0).cost(batch, seq)
                  for batch, seq in workload_chunks(chunk_tokens(settings, provider), max_seq))
    # Per runtime: one factor for all (OpenVINO's 1.7) left the full-size int8 untimed in a
    # 2.5 GiB container (2,538 MiB asked, its load takes ~1,574) and bf16, which needs more
    # there, chosen; the server then could not serve it.
    resident = runtime.get(runtime.kind_of(artifacts, provider)).resident_factor(
        artifacts.variant)
    return int(files * resident + HEADROOM_BYTES + largest)


def _time_all(settings: Settings, cache_dir: Path,
              artifacts: Mapping[Candidate, ModelArtifacts],
              timer: Timer, on_step: Callable[[str], None],
              stop: threading.Event | None = None,
              ) -> tuple[dict[str, float], dict[str, str], dict[str, int], bool]:
    """Tokens/s of each candidate that fits, one at a time (the rule's pick first), then each
    once more in the other order: the mean of its two passes, or where the two passes chose
    different variants by more than ``PRIOR_MARGIN`` (``_settled``), of the middle two of four;
    the candidates left out, why;
    the bytes those left out for memory asked for; whether a timing process was stopped
    (``ChildStopped``) rather than failed."""
    available = memory.detect_available_memory(settings.available_memory_bytes).available_bytes
    rates: dict[str, float] = {}  # the mean of a candidate's passes (``_middle``)
    passes: dict[str, list[float]] = {}
    left_out: dict[str, str] = {}
    order = sorted(artifacts, key=lambda c: c.variant != settings.variant)
    longest = workload_max_seq(settings, artifacts)
    stopped: list[str] = []
    needs: dict[str, int] = {}

    def once(c: Candidate) -> None:
        # A signal to the process group, or the server stopping (its timing child is killed,
        # and the next candidate's was started and killed in turn): time no more.
        if stopped or (stop is not None and stop.is_set()):
            return
        free = available - memory.rss_bytes()
        need = memory_needed(settings, artifacts[c], c.provider, longest)
        if need > free:
            needs[c.variant] = need
            left_out[c.variant] = (f"needs ~{need >> 20} MiB to be timed, {max(free, 0) >> 20} "
                                   "MiB are free")
            log.info("variant choice: %s not timed: %s", c.variant, left_out[c.variant])
            return
        spec = {"task": "time", "model_path": str(settings.model_path), "variant": c.variant,
                "provider": c.provider, "threads": settings.threads_per_worker,
                "cache_dir": str(cache_dir), "chunk_tokens": chunk_tokens(settings, c.provider),
                "max_seq": longest, "rounds": ROUNDS, "max_seconds": MAX_WARMUP_SECONDS}
        started = time.monotonic()
        # Seconds to minutes each: /health said the step before ("hashing the model files").
        on_step(f"choosing the variant: timing {c.variant}"
                + (f" (pass {len(passes.get(c.variant, [])) + 1} of {rounds})"
                   if len(order) > 1 else ""))
        try:
            answer = timer(spec)
        except ChildDied as exc:
            if isinstance(exc, ChildStopped):
                stopped.append(c.variant)
            left_out[c.variant] = f"its timing process ended {exc}"
            log.warning("variant choice: %s not timed: %s", c.variant, left_out[c.variant])
            return
        rate = float(answer["tokens_per_s"])
        passes.setdefault(c.variant, []).append(rate)
        rates[c.variant] = _middle(passes[c.variant])
        log.info("variant choice: %s on %s ran %.0f tokens/s (%d rounds; loaded %d MiB in "
                 "%.1f s; %.0f s in all)", c.variant, c.provider, rate, answer.get("rounds", 0),
                 int(answer.get("model_rss_bytes", 0)) >> 20,
                 float(answer.get("load_seconds", 0.0)), time.monotonic() - started)

    rounds = 2  # passes, as the steps say it (4 where two disagree)
    for c in order:
        once(c)
    # A B C, then C B A, each candidate's mean: a machine whose speed drifts steadily while
    # they are timed (another job starting or ending: 2-3x on a shared 2-core machine, where
    # one pass once picked fp32 over an int8 1.5x faster) then drifts alike for all of them.
    if len(rates) > 1:
        for c in reversed([c for c in order if c.variant in rates]):
            once(c)
    if not _settled(passes):
        # Each pass chose another variant, by more than the margin: noise (another job on a
        # shared machine) decided, and the choice is cached for every later start (QA: one
        # start's passes read fp32 43,924 then 94,617 tokens/s, int8 105,883 then 59,745).
        # Two passes more, mirrored again (a steady drift still cancels), and the middle two
        # of each candidate's four count: one disturbed pass no longer decides.
        rounds = 4
        log.info("variant choice: the two passes chose different variants (%s): timing each "
                 "twice more", "; ".join(f"{v} {', '.join(f'{r:.0f}' for r in p)}"
                                         for v, p in passes.items()))
        timed = [c for c in order if c.variant in rates]
        before = set(left_out)
        for c in [*timed, *reversed(timed)]:
            if c.variant not in set(left_out) - before:  # not one its third pass failed
                once(c)
        for variant in set(left_out) - before:  # failed or refused now: not chosen on a
            rates.pop(variant, None)            # mean of the passes it had before
            passes.pop(variant, None)
    return rates, left_out, needs, bool(stopped)


def _middle(passes: list[float]) -> float:
    """A candidate's rate from its passes: their mean (two: a steady drift cancels between
    the two orders), of all but the slowest and the fastest from four on."""
    kept = sorted(passes)[1:-1] if len(passes) >= 4 else passes
    return sum(kept) / len(kept)


def _settled(passes: Mapping[str, list[float]], margin: float = PRIOR_MARGIN) -> bool:
    """Whether the first two passes agree: each pass's fastest (of the candidates timed in
    both) is the same, or ran within ``margin`` of the other's in one of them (two losers
    trading places choose nothing: review)."""
    twice = {v: p for v, p in passes.items() if len(p) >= 2}
    if len(twice) < 2:
        return True
    first = max(twice, key=lambda v: twice[v][0])
    second = max(twice, key=lambda v: twice[v][1])
    return first == second or not (
        twice[first][0] > twice[second][0] * (1 + margin)
        and twice[second][1] > twice[first][1] * (1 + margin))


def _child_timer(stop: threading.Event | None) -> Timer:
    event = stop or threading.Event()
    return lambda spec: run_json(spec, event)
