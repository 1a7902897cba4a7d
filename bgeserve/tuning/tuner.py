"""Memory-aware auto-tuning: budget, cost model, the startup probe in the background, its cache.

Order of decisions (SPEC §4):
1. available memory (override → cgroup v2 → v1 → MemAvailable), or the VRAM budget on a GPU;
2. model cost per worker, measured as RSS growth while sessions load plus one priming run;
3. per-worker budget ``(available − workers·model − headroom) · safety / workers``;
4. coefficients: an override (A/B, token budget, disabled auto-budget, GPU) → ``disabled``;
   a cache entry with a matching fingerprint → ``cache_hit`` (or, for a probe that already
   failed ``MAX_ATTEMPTS`` times, ``failed`` with its reason, not probed again); else the
   probe → ``running`` → ``complete`` (fitted model swapped in) or ``failed`` (the
   conservative model stays);
5. where the probe runs (``probe_mode``): in a child process beside the server
   (``child``: the server is ready at once, serving with the conservative model) when a second
   copy of the model fits beside it, else on the serving session itself before the server is
   ready (``in_process``: the caller runs ``measure_first``);
6. refuse to start, naming the knob, when one ``max_seq`` text cannot fit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bgeserve.errors import ConfigError
from bgeserve.tuning import cache, memory, probe
from bgeserve.tuning.budget import HEADROOM_BYTES, budget
from bgeserve.tuning.costmodel import CostModel, Fit, conservative_coefficients
from bgeserve.tuning.probe import ProbeRequest, ProbeResult
from bgeserve.tuning.runcost import RunCost
from bgeserve.tuning.sources import Source, as_source

log = logging.getLogger("bgeserve.tuning")
LEGACY_BATCH_SEQ = 512  # what BGE_M3_ONNX_BATCH_SIZE texts were assumed to be long
GPU_DEFAULT_VRAM = 10 << 30
# Starts that probe a fingerprint whose probe failed: one retry (a busy machine can spoil one
# probe's readings), then the failure is served from the cache until the model, runtime or
# settings change (or BGE_M3_DISABLE_PROBE_CACHE=1).
MAX_ATTEMPTS = 2
# A cached fit whose probe skipped shapes for memory is measured again once a probe would have
# this much more budget (a little more is noise: the memory read moves between starts).
SHORT_BUDGET_GROWTH = 1.25


@dataclass(frozen=True)
class TuningConfig:
    """The knobs of auto-tuning (derived from Settings by the service)."""

    workers: int = 1
    max_seq: int = 8192
    safety_factor: float = 0.7
    available_override: int | None = None
    token_budget: int | None = None
    cost_a: float | None = None
    cost_b: float | None = None
    disable_auto_budget: bool = False
    disable_probe_cache: bool = False
    legacy_batch_size: int | None = None
    gpu: bool = False
    gpu_vram_budget: int | None = None
    cache_dir: Path | None = None
    dims: dict[str, int] = field(default_factory=dict)  # hidden, heads, intermediate
    # The engine's padded tokens per run; the probe times alternatives unless it is pinned
    # (BGE_M3_MAX_CHUNK_TOKENS) or unknown.
    chunk_tokens: int | None = None
    chunk_pinned: bool = False
    # The runtime keeps its workspace at the high-water mark between runs (OpenVINO): the
    # probe's readings are cumulative (``probe.PeakMeter``).
    retains_workspace: bool = False
    # The variables a refusal names (the reranker's engine has its own).
    length_variable: str = "BGE_M3_MAX_SEQ_LENGTH"
    workers_variable: str = "BGE_M3_WORKERS"
    # Host memory held outside the workspace budget (the embedding cache's limit).
    reserved_bytes: int = 0


@dataclass
class TuningState:
    """The tuning facts ``/health`` shows."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    max_workspace_bytes: int = 0
    probe_status: str = "running"
    probe_mode: str | None = None  # child | in_process: where the probe runs (ran)
    memory_source: str = ""
    available_bytes: int = 0
    model_rss_bytes_per_worker: int = 0
    probe_error: str | None = None
    probe_seconds: float | None = None
    max_seq_that_fits: int = 0
    chunk_tokens: int | None = None
    chunk_tokens_source: str = "default"  # default | setting | probe
    chunk_rates: dict[int, float] = field(default_factory=dict)  # padded tokens → tokens/s
    run_cost: RunCost | None = None  # what a run costs: the packer pads only where it pays

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["a_bytes_per_token"] = out.pop("a")
        out["b_bytes_per_token_sq"] = out.pop("b")
        out["c_bytes_per_run"] = out.pop("c")
        out["chunk_rates"] = {str(k): round(v, 1) for k, v in self.chunk_rates.items()}
        out["run_cost"] = self.run_cost.as_info() if self.run_cost else None
        return out


MIN_USEFUL_SEQ = 64  # a budget fitting no text this long is no budget to serve with
# The refusal's "longest that fits" is what a restart is set to, and the budget it is read off
# moves a little between starts (the model's memory as measured: 4,102-4,110 tokens for the
# same settings, tiny fp32 under a 340 MB cap): at the figure itself a restart fitted 4,094
# of 4,104 and served with the texts past that refused. So it is said this much under, and
# long ones rounded down to a multiple of ADVICE_STEP.
ADVICE_MARGIN = 0.98
ADVICE_STEP = 64


def advised(longest: int) -> int:
    """The max_seq to advise where ``longest`` tokens fit (``ADVICE_MARGIN``; rounded down to
    ``ADVICE_STEP`` only where that costs under a tenth, and never below MIN_USEFUL_SEQ where
    that fits: review)."""
    n = int(longest * ADVICE_MARGIN)
    if n >= 10 * ADVICE_STEP:
        n -= n % ADVICE_STEP
    return max(n, min(longest, MIN_USEFUL_SEQ))


# A measured fit whose longest text is at least this share of max_seq serves rather than
# refuses the start (the texts past it get 413), as a start whose probe finishes after it is
# serving does.
NEAR_FIT = 0.9


class DoesNotFit(ConfigError):
    """The model, or one ``max_seq`` text beside it, does not fit the memory: a fact about
    this variant here (another, smaller, may fit; ``Service`` tries the next one measured)."""


class UnmeasuredFloor(DoesNotFit):
    """One ``max_seq`` text does not fit by the conservative estimate, and nothing measured
    says otherwise yet: the caller may measure first (``Tuner.measure_first``)."""


class Tuner:
    """Chooses and maintains the engine's cost model."""

    def __init__(self, config: TuningConfig, apply: Callable[[CostModel], None],
                 apply_chunk_tokens: Callable[[int], None] | None = None,
                 apply_run_cost: Callable[[RunCost | None], None] | None = None):
        self.config = config
        self._apply = apply
        self._apply_chunk_tokens = apply_chunk_tokens or (lambda tokens: None)
        self._apply_run_cost = apply_run_cost or (lambda cost: None)
        self.state = TuningState(chunk_tokens=config.chunk_tokens,
                                 chunk_tokens_source="setting" if config.chunk_pinned
                                 else "default")
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # measure_first's fit, chunk rates and run cost
        self._measured: tuple[Fit, dict[int, float], RunCost | None] | None = None
        self._gave_up: str | None = None  # why no more probing this start (a failed attempt)
        self._in_process = False  # the last cached failure was the probe process dying
        self._translated = False  # token_budget came from BGE_M3_ONNX_BATCH_SIZE

    # -- measurement -----------------------------------------------------------------------
    def budget(self, model_cost: int, extra_sessions: int = 0) -> int:
        """Per-worker workspace bytes, counting ``extra_sessions`` (the probe's) as workers."""
        c = self.config
        if c.token_budget is not None:
            return c.token_budget
        workers = c.workers + extra_sessions
        if c.gpu:  # one worker per device: the VRAM budget is each worker's own
            return c.gpu_vram_budget or GPU_DEFAULT_VRAM
        return budget(self.state.available_bytes - c.reserved_bytes, workers, model_cost,
                      safety_factor=c.safety_factor)

    def conservative(self) -> tuple[float, float]:
        return conservative_coefficients(**self.config.dims)

    # -- start-up --------------------------------------------------------------------------
    def detect_memory(self) -> None:
        """Read available memory; call it BEFORE the sessions load.

        MemAvailable read after loading would already exclude the model, which the budget
        subtracts once more (a cgroup limit is the same before and after).
        """
        info = memory.detect_available_memory(self.config.available_override)
        self.state.memory_source, self.state.available_bytes = info.source, info.available_bytes

    def check_room(self, resident: int, files: int,
                   other_variants: Callable[[], str] = lambda: "") -> None:
        """Refuse, before loading, a model that takes more than the memory once loaded
        (``resident``: its ``files``, every copy the workers keep, times its runtime's
        resident factor) with the headroom: loading it was killed for memory (a 1.5 GiB
        container and the full-size int8: exit 137 while loading, nothing said). The floor
        after loading refuses such a start anyway (no workspace is left); here it does so
        before the kill. ``other_variants``: what the model directory also holds that loads
        in less (the message's way out). Not on a GPU, whose weights are in its own memory."""
        c = self.config
        # BGE_M3_AVAILABLE_MEMORY_BYTES is a budget, not a limit anything enforces: the floor
        # after loading says what it leaves.
        source = self.state.memory_source
        if c.gpu or source == "override" or (
                resident + HEADROOM_BYTES <= self.state.available_bytes):
            return
        need = (resident + HEADROOM_BYTES) >> 20
        others = other_variants()
        raise DoesNotFit(
            f"the model takes ~{resident >> 20} MiB once loaded (its files: {files >> 20} MiB; "
            f"{c.workers} worker(s)), and with {HEADROOM_BYTES >> 20} MiB headroom more than "
            f"the {self.state.available_bytes >> 20} MiB of memory available ({source}): "
            f"loading it would be killed for memory. Raise the memory limit well above {need} "
            "MiB (a text's workspace comes on top)"
            + (f", or serve a variant that loads in less: {others}" if others else ""),
            param="BGE_M3_MODEL")

    def share(self, available: int, source: str) -> None:
        """Tune with ``available`` bytes (described as ``source``) instead of what
        ``detect_memory`` found: another model in this process holds the rest
        (``budget.split_available``)."""
        self.state.available_bytes, self.state.memory_source = available, source

    def initial(self, model_cost: int, fingerprint: str | None,
                parts: Mapping[str, object] | None = None) -> CostModel:
        """The cost model to serve with from the start; sets ``probe_status`` and, when it is
        ``running``, ``probe_mode``: ``child`` (``start_probe`` it once the server is ready) or
        ``in_process`` (``measure_first`` it, on the serving session, before). With the
        ``parts`` of ``fingerprint``, a cached fit made for a longer max_seq serves where this
        one has none (``ProbeCache.covering``); what is measured is saved under
        ``fingerprint`` still.

        Raises:
            UnmeasuredFloor: by the conservative estimate one ``max_seq`` text cannot fit and
                nothing measured says otherwise yet (``measure_first``, then call again).
            ConfigError: one ``max_seq`` text cannot fit by what was measured.
        """
        c, s = self.config, self.state
        if not s.memory_source:
            self.detect_memory()
        s.model_rss_bytes_per_worker = model_cost
        a, b = self.conservative()
        c_fixed = 0.0
        token_budget = c.token_budget
        if c.legacy_batch_size is not None and token_budget is None:
            token_budget = int(CostModel(a, b, 0).cost(c.legacy_batch_size, LEGACY_BATCH_SEQ))
            log.warning("BGE_M3_ONNX_BATCH_SIZE=%d is deprecated; translated to "
                        "BGE_M3_TOKEN_BUDGET=%d (workspace bytes of that many %d-token texts)",
                        c.legacy_batch_size, token_budget, LEGACY_BATCH_SEQ)
            self.config = c = TuningConfig(**{**asdict(c), "token_budget": token_budget})
            self._translated = True  # the budget is BGE_M3_ONNX_BATCH_SIZE's (floor message)
        if c.cost_a is not None and c.cost_b is not None:
            a, b, s.probe_status = c.cost_a, c.cost_b, "disabled"
        elif c.disable_auto_budget or c.token_budget is not None or c.gpu:
            s.probe_status = "disabled"
        elif self._measured is not None:  # measured before serving (measure_first)
            fit, rates, run_cost = self._measured
            a, b, c_fixed, s.probe_status = fit.a, fit.b, fit.c, "complete"
            self._choose_chunks(rates)
            self._use_run_cost(run_cost)
        elif self._gave_up is not None:  # measured before serving, and it failed
            s.probe_status, s.probe_error = "failed", self._gave_up
        else:
            key = self._covering(fingerprint, parts)
            cached = self._cached(key)
            if isinstance(cached, Fit) and self._measured_short(key, model_cost):
                # Measured again: as this start's own record has it (its failures counted,
                # a probe process that died; review), not as the longer one's.
                cached = None if key == fingerprint else self._cached(fingerprint)
                key = fingerprint
            if isinstance(cached, Fit):
                a, b, c_fixed, s.probe_status = cached.a, cached.b, cached.c, "cache_hit"
                store = cache.ProbeCache(self.cache_path)
                self._choose_chunks(store.chunk_rates(key or ""))
                self._use_run_cost(store.run_cost(key or ""))
            elif isinstance(cached, cache.Failure) and cached.attempts >= MAX_ATTEMPTS:
                s.probe_status, s.probe_error = "failed", (
                    f"{cached.error} (cached: the probe failed {cached.attempts} times for "
                    "this model, runtime and settings, so this start did not probe again; "
                    "set BGE_M3_DISABLE_PROBE_CACHE=1 to retry)")
                log.warning("probe not run: %s", s.probe_error)
            else:
                s.probe_status = "running"
                self._in_process = isinstance(cached, cache.Failure) and cached.process_died
        cost = CostModel(a, b, self.budget(model_cost), c_fixed)
        self._check_floor(cost, model_cost)
        if s.probe_status == "running":
            # In a child the probe loads another copy of the model: while it runs the workers
            # share what is left. If that cannot hold one max_seq text (or the last child was
            # killed), the probe measures on the serving session itself, before serving.
            sharing = cost.with_budget(self.budget(model_cost, extra_sessions=1))
            if sharing.fits(1, c.max_seq) and not self._in_process:
                s.probe_mode, cost = "child", sharing
            else:
                s.probe_mode = "in_process"
                log.info("probe: measuring on the serving session before serving (%s)",
                         "the last probe process died" if self._in_process else
                         "a second copy of the model does not fit beside the server")
        self._publish(cost)
        return cost

    def _measured_short(self, fingerprint: str | None, model_cost: int) -> bool:
        """Whether the cached fit's probe skipped shapes for a budget well below a probe's
        now: its fit is extrapolated past them (from 4x256 in 300 MB: b 17.8 bytes/token²
        against 0.15 measured whole), which kept a start with the memory raised refusing for
        good. Such a start probes again."""
        short = cache.ProbeCache(self.cache_path).short_budget(fingerprint or "")
        if short is None:
            return False
        then, extra = short
        now = self.budget(model_cost, extra_sessions=extra)  # counted as that probe was
        if now <= then * SHORT_BUDGET_GROWTH:
            return False
        log.info("probe cache: its probe skipped shapes for a budget of %d MiB per worker; "
                 "a probe would have %d MiB now: probing again", then >> 20, now >> 20)
        return True

    def _covering(self, fingerprint: str | None,
                  parts: Mapping[str, object] | None) -> str | None:
        """The key the cached fit for ``fingerprint`` is read under (``ProbeCache.covering``):
        its own without ``parts`` or a cache."""
        c = self.config
        if not fingerprint or parts is None or c.cache_dir is None or c.disable_probe_cache:
            return fingerprint
        return cache.ProbeCache(self.cache_path).covering(fingerprint, parts)

    def _cached(self, fingerprint: str | None) -> Fit | cache.Failure | None:
        c = self.config
        if not fingerprint or c.cache_dir is None or c.disable_probe_cache:
            return None
        return cache.ProbeCache(self.cache_path).outcome(fingerprint)

    @property
    def cache_path(self) -> Path:
        assert self.config.cache_dir is not None
        return cache.ProbeCache.at(self.config.cache_dir).path

    def _check_floor(self, cost: CostModel, model_cost: int) -> None:
        c = self.config
        if cost.fits(1, c.max_seq):
            return
        if (self.state.probe_status in ("cache_hit", "complete")
                and cost.max_seq() >= c.max_seq * NEAR_FIT):
            # What the start that measured it did, once its probe came back (QA: a cold start
            # under a 400 MiB cap served, its fit 56 MiB for a text against 53, and every
            # restart then refused on that fit, exit 3: a crash loop). A miss this small is
            # within the fit's own error; a larger one still refuses.
            log.warning("the measured cost model fits texts of at most %d tokens, below %s=%d "
                        "(within %.0f%%): serving, texts past it get 413 naming it",
                        cost.max_seq(), c.length_variable, c.max_seq, 100 * (1 - NEAR_FIT))
            return
        unmeasured = self.state.probe_status == "running"
        # The whole sum, so that the one term to change can be seen (each worker gets
        # (available - cache - models - headroom) x safety / workers).
        host = c.token_budget is None and not c.gpu
        held = [f"{c.workers} x {model_cost / 2**30:.2f} GiB model",
                f"{HEADROOM_BYTES >> 20} MiB headroom"]
        if c.reserved_bytes:
            held.insert(0, f"{c.reserved_bytes >> 20} MiB embedding cache (BGE_M3_CACHE_MB)")
        if c.token_budget is not None:
            why = ("BGE_M3_TOKEN_BUDGET, in bytes" if not self._translated else
                   f"BGE_M3_ONNX_BATCH_SIZE={c.legacy_batch_size}: the workspace of that many "
                   "512-token texts, pinned as BGE_M3_TOKEN_BUDGET")
        elif c.gpu:
            why = "the GPU's budget, BGE_M3_GPU_VRAM_BUDGET_BYTES"
        else:
            source = self.state.memory_source
            source = "BGE_M3_AVAILABLE_MEMORY_BYTES" if source == "override" else source
            why = (f"{self.state.available_bytes / 2**30:.2f} GiB available from {source}, less {', '.join(held)}, x safety factor "
                   f"{c.safety_factor:g} (BGE_M3_MEMORY_SAFETY_FACTOR), / {c.workers} worker(s)")
        # A pinned budget (BGE_M3_TOKEN_BUDGET) or the GPU's is the same for every variant:
        # no reason to serve another (DoesNotFit), only to change the setting.
        refusal = (UnmeasuredFloor if unmeasured else DoesNotFit if host else ConfigError)
        raise refusal(
            f"one {c.max_seq}-token text needs ~{cost.cost(1, c.max_seq) / 2**20:.0f} MiB of "
            f"workspace but each of the {c.workers} worker(s) gets "
            f"{cost.max_workspace_bytes / 2**20:.0f} MiB ({why}). "
            # "longest that fits: 0": no length to lower to (the runtime's fixed term alone,
            # OpenVINO's ~390 MiB pool, was more than the budget).
            + (f"Lower {c.length_variable} (longest that fits: {advised(cost.max_seq())})"
               if cost.max_seq() >= MIN_USEFUL_SEQ or not host else
               f"Not even a {MIN_USEFUL_SEQ}-token text fits: lowering {c.length_variable} "
               "does not help; serve a variant that needs less memory (BGE_M3_MODEL)")
            # A pinned budget is each worker's whatever the memory, workers or cache.
            + (f", or raise BGE_M3_TOKEN_BUDGET (workspace bytes per worker: one "
               f"{c.max_seq}-token text needs {int(cost.cost(1, c.max_seq))})"
               if c.token_budget is not None else
               f", reduce {c.workers_variable}"
               + (", set BGE_M3_CACHE_MB=0" if c.reserved_bytes and host else "")
               + ", or raise the memory limit / BGE_M3_MEMORY_SAFETY_FACTOR")
            + ("" if self.state.probe_status not in ("running", "failed") else
               ". This is the conservative estimate (no probe measurement is cached yet); the "
               "measured cost is usually far lower: run `bgeserve probe` once with the same "
               "model, variant and BGE_M3_CACHE_DIR where memory allows, and its cached fit "
               "is used here")
            + ("" if self.state.probe_status != "cache_hit" else
               f". The cost is the probe's fit cached in {self.cache_path}; "
               "BGE_M3_DISABLE_PROBE_CACHE=1 (or removing it) measures it again"),
            param=c.length_variable)

    def _publish(self, cost: CostModel) -> None:
        s = self.state
        s.a, s.b, s.c, s.max_workspace_bytes = cost.a, cost.b, cost.c, cost.max_workspace_bytes
        s.max_seq_that_fits = cost.max_seq()
        self._apply(cost)

    # -- the probe -------------------------------------------------------------------------
    def start_probe(self, source: Source, model_cost: int, fingerprint: str | None,
                    parts: dict[str, Any], on_done: Callable[[], None] | None = None) -> None:
        """Run the probe on a background thread (only when ``probe_status`` is running).

        ``source`` is where it runs (``ProbeSource``): the server's is a ``ChildProbe``, which
        measures in a process of its own (see ``bgeserve.service.probe_child`` for why); a
        bare ``run(batch, seq)`` or a child spec dict are taken too.
        """
        if self.state.probe_status != "running":
            return

        def work() -> None:
            try:
                self._probe(source, model_cost, fingerprint, parts)
            except Exception as exc:  # the probe must never take the server down
                log.exception("probe failed")
                self.state.probe_status, self.state.probe_error = "failed", repr(exc)
                a, b = self.conservative()
                self._publish(CostModel(a, b, self.budget(model_cost)))
            finally:
                if on_done is not None:
                    on_done()

        self._thread = threading.Thread(target=work, name="bgeserve-probe", daemon=True)
        self._thread.start()

    def reprobe(self, source: Source, model_cost: int, fingerprint: str | None,
                parts: dict[str, Any]) -> bool:
        """Probe again in the background (a served chunk broke the fit: ``tuning.audit``); the
        cost model in use stays until the new fit replaces it and the cache. Only where a
        probe ran before (not over an override) and none runs now; True when it started."""
        s = self.state
        if s.probe_status not in ("complete", "cache_hit", "failed") or not self.wait(0):
            return False
        # As at start: while the probe's own copy of the model is loaded, the workers share
        # what is left, or the probe waits for another day.
        sharing = CostModel(s.a, s.b, self.budget(model_cost, extra_sessions=1), s.c)
        if not sharing.fits(1, self.config.max_seq):
            log.warning("re-probe skipped: not enough memory to probe beside the server")
            return False
        self._publish(sharing)
        s.probe_status, s.probe_error = "running", None
        self._measured = None
        self.start_probe(source, model_cost, fingerprint, parts)
        return True

    def _measure(self, source: Source, guard: CostModel) -> ProbeResult:
        c = self.config
        timed = c.chunk_tokens is not None and not c.chunk_pinned
        request = ProbeRequest(shapes=probe.default_shapes(c.max_seq),
                               held_out=probe.default_held_out(c.max_seq), guard=guard,
                               chunk_candidates=probe.CHUNK_CANDIDATES if timed else (),
                               cumulative=c.retains_workspace)
        return as_source(source).measure(request, self._stop)

    def measure_first(self, source: Source, model_cost: int, fingerprint: str | None,
                      parts: dict[str, Any]) -> bool:
        """Run the probe now, in the foreground, on the serving session (``probe_mode``
        ``in_process``: nothing is served meanwhile, so its workspace is the workers' own);
        ``initial`` then uses its outcome, cached or not. For when a second copy of the model
        does not fit beside the server, or the conservative estimate alone would refuse to
        start. True when a fit came out."""
        self.state.probe_mode = "in_process"
        try:
            self._probe(source, model_cost, fingerprint, parts, extra_sessions=0)
        except Exception as exc:  # serving with the conservative model beats not starting
            log.exception("probe failed")
            self.state.probe_status, self.state.probe_error = "failed", repr(exc)
        if self._measured is None:
            self._gave_up = self.state.probe_error or "the probe gave no fit"
        return self._measured is not None

    def _probe(self, source: Source, model_cost: int, fingerprint: str | None,
               parts: dict[str, Any], extra_sessions: int = 1) -> None:
        c = self.config
        a, b = self.conservative()
        guard = CostModel(a, b, self.budget(model_cost, extra_sessions=extra_sessions))
        result = self._measure(source, guard)
        self.state.probe_seconds = round(result.seconds, 2)
        caching = bool(fingerprint) and c.cache_dir is not None and not c.disable_probe_cache
        if result.fit is None:
            error = result.error or "the probe gave no fit"
            # A probe stopped by shutdown (or its process by a signal to the server's process
            # group: it may end before the server hears of it) proves nothing, nor one whose
            # budget let too few shapes run: remembered, it kept later starts with more memory
            # from probing (two starts capped at 300 MB made an uncapped start serve the
            # conservative model, and a 430 MB start refuse, for good on that cache).
            stopping = self._stop.is_set() or result.stopped
            if caching and not stopping and not result.starved:
                failure = cache.ProbeCache(self.cache_path).save_failure(
                    fingerprint or "", error, parts, result.samples, held_out=result.held_out,
                    process_died=result.process_died)
                error += (f" (attempt {failure.attempts} of {MAX_ATTEMPTS} for this model, "
                          "runtime and settings)")
            elif result.starved:
                error += (" (the memory budget let too few shapes run: not remembered, the "
                          "next start probes again)")
            self.state.probe_status, self.state.probe_error = "failed", error
            self._publish(CostModel(a, b, self.budget(model_cost)))
            if stopping:  # the server or a bulk job ending: no fault to warn of
                log.info("probe stopped before it finished (%s)", error)
            else:
                log.warning("probe gave no usable fit (%s); keeping the conservative model",
                            error)
            return
        fitted = CostModel(result.fit.a, result.fit.b, self.budget(model_cost), result.fit.c)
        if not fitted.fits(1, c.max_seq):
            # The measured model is costlier than the conservative one said: keep serving, but
            # say so; texts that no longer fit get 413 naming BGE_M3_MAX_SEQ_LENGTH.
            log.warning("the fitted cost model fits texts of at most %d tokens, below "
                        "BGE_M3_MAX_SEQ_LENGTH=%d", fitted.max_seq(), c.max_seq)
        self.state.probe_status, self.state.probe_error = "complete", None
        self._measured = (result.fit, result.chunk_rates, result.run_cost)
        self._publish(fitted)
        self._choose_chunks(result.chunk_rates)
        self._use_run_cost(result.run_cost)
        log.info("probe complete in %.1fs (%s): %s; budget %d MiB per worker, longest text "
                 "that fits %d tokens", result.seconds, self.state.probe_mode,
                 probe.describe(result.fit), fitted.max_workspace_bytes >> 20, fitted.max_seq())
        if caching:
            guarded = sum(reason.startswith(probe.GUARD_SKIP)
                          for _, _, reason in result.skipped)
            cache.ProbeCache(self.cache_path).save(fingerprint or "", result.fit, parts,
                                                   result.samples, result.chunk_rates,
                                                   held_out=result.held_out,
                                                   run_cost=result.run_cost,
                                                   probe_budget=guard.max_workspace_bytes,
                                                   skipped_for_memory=guarded,
                                                   probe_extra_sessions=extra_sessions)

    def _choose_chunks(self, rates: dict[int, float]) -> None:
        """Move the engine's chunk budget to a timed one that clearly beat the default."""
        c, s = self.config, self.state
        if c.chunk_tokens is None or c.chunk_pinned or not rates:
            return
        s.chunk_rates = dict(sorted(rates.items()))
        chosen = probe.choose_chunk_tokens(c.chunk_tokens, rates)
        if chosen != c.chunk_tokens:
            log.info("chunks: %d padded tokens per run ran %.0f tokens/s against %.0f at the "
                     "default %d: using %d", chosen, rates[chosen], rates[c.chunk_tokens],
                     c.chunk_tokens, chosen)
            s.chunk_tokens, s.chunk_tokens_source = chosen, "probe"
            self._apply_chunk_tokens(chosen)

    def _use_run_cost(self, cost: RunCost | None) -> None:
        """Pack by what a run costs (``binpack.plan``'s ``run_cost``) from the next chunk on;
        None (not measured, or a probe that could not fit one): by ``min_fill`` alone."""
        if cost == self.state.run_cost:
            return  # measure_first's result is handed over twice: say it once
        self.state.run_cost = cost
        if cost is None:
            log.info("packing: no run cost measured; chunks are padded up to min_fill")
        else:
            log.info("packing: a run costs %.1f ms plus %.3f ms per padded token (%.3f us per "
                     "token per position), %.1f ms more the first time its shape runs: a text "
                     "joins a chunk only where padding the chunk to it costs less than its own "
                     "run and the new shapes it saves, and a chunk pads to a shape already run "
                     "where that costs less than a new one; a text's attention costs as much as "
                     "the rest of its run at %s tokens", cost.fixed * 1e3,
                     cost.per_token * 1e3, cost.per_pair * 1e6,
                     cost.new_shape * 1e3,
                     "unmeasured" if cost.attention_tokens is None
                     else f"{cost.attention_tokens:.0f}")
        self._apply_run_cost(cost)

    def stop(self) -> None:
        """Ask a running probe to give up (its child process is killed)."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a running probe; True when none is running any more."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True
