"""``bgeserve probe``: the startup probe run now, in the foreground, with its table printed.

Same model, variant, runtime and settings as ``bgeserve serve`` would use; its fit is cached
under the same fingerprint, so the next server start is a ``cache_hit``.
"""

from __future__ import annotations

import json

from bgeserve.config import Settings
from bgeserve.engine.forward import forward_factory
from bgeserve.engine.tokenizer import Tokenizer
from bgeserve.errors import ConfigError
from bgeserve.model import dims
from bgeserve.model.artifacts import resolve, validate_cache_dir
from bgeserve.service import choice, plan
from bgeserve.service.preparation import Preparation
from bgeserve.service.probe_child import PIN_THRESHOLD
from bgeserve.tuning import cache, memory, probe
from bgeserve.tuning.budget import budget
from bgeserve.tuning.costmodel import CostModel, conservative_coefficients
from bgeserve.tuning.synthetic import chunk_timing_run, synthetic_run


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``BxS,BxS`` → [(B, S), ...] (``ConfigError`` for anything else)."""
    shapes = []
    for part in text.split(","):
        batch, sep, seq = part.strip().lower().partition("x")
        if not sep or not batch.isdigit() or not seq.isdigit() or not int(batch) or not int(seq):
            raise ConfigError(f"--shapes {text!r}: expected BxS,BxS with positive integers, "
                              "e.g. 1x512,4x256", param="--shapes")
        shapes.append((int(batch), int(seq)))
    return shapes


def choice_table(decision: choice.Decision) -> str:
    """The variant choice as ``bgeserve probe`` prints it: each candidate's tokens/s."""
    s = decision.settings
    how = {"measured": "measured" + (" (cached)" if decision.cached else ""),
           "rule": "the rule (runtime/select.py)", "pinned": "pinned by BGE_M3_MODEL"}
    chosen_by = how.get(s.variant_choice, s.variant_choice)
    lines = [f"variant: {s.variant} on {s.execution_provider}, chosen by {chosen_by}"]
    if decision.candidates or decision.left_out:
        lines += ["| variant | tokens/s (choice workload) |", "|---|---:|"]
        for v, rate in sorted(decision.candidates.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {v}{' (chosen)' if v == s.variant else ''} | {rate:.0f} |")
        for v, why in sorted(decision.left_out.items()):
            lines.append(f"| {v} | not timed: {why} |")
    return "\n".join(lines)


def run(settings: Settings, shapes: list[tuple[int, int]] | None = None) -> int:
    """Probe the model ``settings`` (resolved) name; 0 when a fit came out. With neither
    BGE_M3_EP nor BGE_M3_MODEL set, the variants are timed first and the fastest is probed
    (both cached, as the server would)."""
    cache_dir = validate_cache_dir(settings.cache_dir)
    # What serve would serve: a hub snapshot's prepared export (made now if it is not cached),
    # and the variant serve would choose.
    settings = Preparation().apply(settings, cache_dir)
    decision = choice.decide(settings, cache_dir, remeasure=True)
    settings = decision.settings
    print(choice_table(decision))
    memory.pin_mmap_threshold(PIN_THRESHOLD)  # measure each shape alone (see probe_child)
    artifacts = resolve(model_path=settings.model_path, variant=settings.variant,
                        cache_dir=cache_dir, offline=settings.offline)
    serving = plan.for_model(settings, artifacts, cache_dir)
    settings, config = serving.settings, serving.engine
    vocab = Tokenizer.load(artifacts.tokenizer_path, settings.max_seq_length).vocab_size
    before = memory.rss_bytes()
    run_shape, close = synthetic_run(forward_factory(artifacts, config.session), vocab)
    run_shape(1, 8)
    model_cost = memory.rss_bytes() - before
    available = memory.detect_available_memory(settings.available_memory_bytes)
    limit = budget(available.available_bytes, 1, model_cost,
                   safety_factor=settings.memory_safety_factor)
    guard = CostModel(*conservative_coefficients(**dims.model_dims(artifacts)), limit)
    print(f"model {artifacts.source}, {model_cost / 2**30:.2f} GiB loaded, "
          f"{available.available_bytes / 2**30:.1f} GiB available ({available.source}), "
          f"probe budget {limit / 2**30:.1f} GiB, threads {settings.threads_per_worker}")
    # Chunk budgets are timed as the server's probe times them (unless the budget is pinned).
    default = config.scheduler.max_chunk_tokens
    timed = settings.max_chunk_tokens is None and default is not None
    result = probe.run_probe(run_shape, shapes=shapes or probe.default_shapes(settings.max_seq_length),
                             held_out=probe.default_held_out(settings.max_seq_length),
                             guard=guard, log=print,
                             chunk_candidates=probe.CHUNK_CANDIDATES if timed else (),
                             chunk_run=chunk_timing_run(run_shape),
                             meter=probe.PeakMeter(serving.tuning.retains_workspace))
    close()
    print(probe.probe_table(result))
    held = result.held_out
    print("samples (batch, seq, bytes): " + json.dumps({
        "samples": [[x.batch, x.seq, x.workspace_bytes] for x in result.samples],
        "held_out": [held.batch, held.seq, held.workspace_bytes] if held else None}))
    if result.fit is not None:
        print(f"fit: {probe.describe(result.fit)}")
    else:
        print(f"no fit: {result.error}")
    if result.chunk_rates and default is not None:
        chosen = probe.choose_chunk_tokens(default, result.chunk_rates)
        print("chunk budgets (padded tokens: tokens/s): "
              + ", ".join(f"{k}: {v:.0f}" for k, v in sorted(result.chunk_rates.items()))
              + f"; the server will use {chosen} (default {default})")
    if result.run_cost is not None:
        print(f"run cost: {result.run_cost.as_info()} (a text joins a chunk only where padding "
              "the chunk to it costs less than its own run)")
    if result.fit is not None and not settings.disable_probe_cache:
        parts = plan.probe_parts(settings, artifacts)
        store = cache.ProbeCache.at(cache_dir)
        store.save(cache.fingerprint(parts), result.fit, parts, result.samples,
                   result.chunk_rates, held_out=result.held_out, run_cost=result.run_cost)
        print(f"cached in {store.path}")
    return 0 if result.fit is not None else 1
