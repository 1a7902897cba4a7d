"""``GET /health/deep``: a fixed canary text through the real path, checked against start-up.

``/health`` reports what the service believes (workers live, sessions loaded); it cannot see a
session that hangs, a worker that returns garbage, or a queue that no longer drains. The deep
check embeds ``CANARY`` (dense, sparse and ColBERT) as a request does — tokenizer, queue, scheduler,
session, heads — within ``deadline_s``, and compares the result with the one recorded when the
server became ready: bitwise for fp32 when the canary ran in a chunk of its own, else within
the tolerance batch composition allows (fp32: dense |Δ| <= 1e-5, sparse ids equal and |Δw| <=
1e-4; other variants: dense cosine >= 0.999, SPEC §2). 200 with the timings, 503 with the
reason (a timeout, an error, a changed vector). A busy server is not a dead one: a canary
refused by a full queue that drains, or late behind chunks still within their expected time,
is 200 ``"busy"``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from bgeserve.errors import BgeServeError, Overloaded
from bgeserve.results import Embeddings, EmbedOptions

if TYPE_CHECKING:
    from bgeserve.engine import Engine
    from bgeserve.engine.workers import Running

CANARY = "bgeserve deep health check: dense and sparse through the real path. 混合检索 ✓"
# ColBERT too: the start-up run that records the canary is also the one priming every output.
CANARY_OPTIONS = EmbedOptions(dense=True, sparse=True, colbert=True, truncate=True)
DEADLINE_S = 5.0
MAX_DEADLINE_S = 60.0
# A canary that misses its deadline behind chunks still running is a busy server, not a dead
# one, while each of them has run less than STUCK_FACTOR x its expected time (and at least
# STUCK_FLOOR_S). Expected: its tokens at the measured drain rate, times (1 + tokens /
# ATTENTION_TOKENS), since a rate measured on short chunks understates a long text, whose
# attention grows with its length (full-size int8, 2 cores: one 4,773-token text at 52
# tokens/s, short chunks at ~300). The factor is wide on purpose: liveness restarting a busy
# pod loses all its work; a hung session.run is still found, minutes later.
STUCK_FACTOR = 10.0
STUCK_FLOOR_S = 60.0
ATTENTION_TOKENS = 2048

Embed = Callable[[], Awaitable[Embeddings]]


def canary_job(engine: Engine, request_id: str) -> Any:
    """The canary as a job of its own: a chunk to itself (so fp32 is bitwise reproducible),
    no request deadline (the caller bounds it), past the queue's admission (it is one short
    text, and a full queue is not a dead server)."""
    return engine.make_job([CANARY], CANARY_OPTIONS, request_id, solo=True, timed=False)


def prime(engine: Engine) -> Embeddings:
    """Run the canary once, blocking (at start-up, before the server is ready)."""
    return engine.submit(canary_job(engine, "canary-start")).result()


def difference(reference: Embeddings, got: Embeddings, *, fp32: bool,
               exact: bool) -> str | None:
    """Why ``got`` is not ``reference`` (None: it is): bitwise when ``exact``, else within
    fp32's or (``fp32`` false) a quantized variant's tolerance."""
    assert reference.dense is not None and got.dense is not None
    assert reference.sparse is not None and got.sparse is not None
    want, have = reference.dense[0], got.dense[0]
    (want_ids, want_w), (have_ids, have_w) = reference.sparse[0], got.sparse[0]
    if not np.all(np.isfinite(have)) or not np.all(np.isfinite(have_w)):
        return "the canary's output holds NaN or infinity"
    delta = float(np.abs(want - have).max())
    if exact:
        same = (np.array_equal(want, have) and np.array_equal(want_ids, have_ids)
                and np.array_equal(want_w, have_w))
        return None if same else (f"the canary's output changed (dense max |Δ| {delta:.3g}); "
                                  "fp32 in a chunk of its own is bitwise reproducible")
    if fp32:
        if delta > 1e-5:
            return f"the canary's dense vector moved: max |Δ| {delta:.3g} > 1e-5"
        if not (np.array_equal(want_ids, have_ids)
                and np.allclose(want_w, have_w, atol=1e-4, rtol=0)):
            return "the canary's sparse weights changed"
        return None
    cosine = float(want @ have) / float(np.linalg.norm(want) * np.linalg.norm(have) or 1.0)
    if cosine < 0.999:
        return f"the canary's dense vector moved: cosine {cosine:.6f} < 0.999"
    return None


def stuck_after(tokens: int, rate: float) -> float:
    """Seconds after which a chunk of ``tokens`` still running counts as stuck, at ``rate``
    tokens per second (0: not measured yet)."""
    if rate <= 0:
        return STUCK_FLOOR_S
    expected = tokens / rate * (1 + tokens / ATTENTION_TOKENS)
    return max(STUCK_FLOOR_S, STUCK_FACTOR * expected)


def progressing(running: list[Running], rate: float, deadline_s: float) -> bool:
    """Whether the chunks in progress explain a canary that waited past its deadline: at least
    one runs, and none for longer than ``stuck_after`` — at the share of ``rate`` (all
    workers' tokens per second) each chunk gets beside the others — or, for a solo chunk (an
    earlier canary, or this one just taken), than ``deadline_s``: a canary that hangs alone is
    a stuck session, not a busy one."""
    share = rate / max(1, len(running))
    return bool(running) and all(
        r.seconds < (deadline_s if r.solo else stuck_after(r.tokens, share)) for r in running)


class DeepHealth:
    """The canary and its reference; ``check`` runs one deep check (checks that overlap
    share one canary run).

    ``embed`` runs the canary through the real path; ``busy`` says whether the queue is
    draining (chunks finished lately), for a canary refused because the queue is full;
    ``progressing(deadline_s)`` whether chunks in progress explain a canary past its
    deadline (the function ``progressing``).
    """

    def __init__(self, embed: Embed, *, fp32: bool, busy: Callable[[], bool] = lambda: False,
                 progressing: Callable[[float], bool] = lambda deadline_s: False,
                 deadline_s: float = DEADLINE_S) -> None:
        self.embed = embed
        self.fp32 = fp32
        self.busy = busy
        self.progressing = progressing
        self.deadline_s = deadline_s
        self.reference: Embeddings | None = None
        self.recorded_at: float | None = None
        self._canary: asyncio.Future[Embeddings] | None = None  # the run checks share
        self._waiting = 0  # checks waiting for it

    def record(self, reference: Embeddings) -> None:
        """The canary's output when the server became ready."""
        self.reference = reference
        self.recorded_at = time.time()

    async def check(self, *, solo: bool = True,
                    deadline_s: float | None = None) -> tuple[int, dict[str, Any]]:
        """(200, timings) or (503, reason). ``solo``: the canary had a chunk to itself, so
        fp32 must match bitwise. ``deadline_s``: instead of the default (at most 60 s)."""
        deadline = min(MAX_DEADLINE_S, deadline_s or self.deadline_s)
        if self.reference is None:
            return 503, {"status": "fail", "reason": "no canary recorded yet (still loading)"}
        started = time.perf_counter()
        try:
            got = await self._shared(deadline)
        except TimeoutError:
            if self.progressing(deadline):  # behind long chunks still within their time
                return 200, {"status": "busy", "reason": f"the canary waited {deadline:g}s "
                             "behind chunks still running within their expected time"}
            return 503, {"status": "fail", "reason": f"the canary took longer than "
                         f"{deadline:g}s (queue, scheduler or session stuck)"}
        except Overloaded:
            if self.busy():  # a full queue that drains is a busy server, not a dead one
                return 200, {"status": "busy", "reason": "the queue is full (the canary was "
                             "not queued) and chunks are finishing"}
            return 503, {"status": "fail", "reason": "the queue is full and no chunk finished "
                         "lately: nothing takes work off it"}
        except BgeServeError as exc:
            return 503, {"status": "fail", "reason": f"{type(exc).__name__}: {exc.message}"}
        ms = round(1000 * (time.perf_counter() - started), 2)
        problem = difference(self.reference, got, fp32=self.fp32, exact=self.fp32 and solo)
        if problem:
            return 503, {"status": "fail", "reason": problem, "ms": ms}
        return 200, {"status": "ok", "ms": ms, "deadline_ms": round(1000 * deadline),
                     "compared": "bitwise" if self.fp32 and solo else "tolerance"}

    async def _shared(self, deadline: float) -> Embeddings:
        """The canary's output within ``deadline``, one run for all the checks waiting at once
        (single flight): the route needs no key, and each canary is a solo job that goes
        before batches, so a burst of checks (liveness, readiness and a monitor at once, or
        anyone flooding it) must put one canary in the queue, not one each. The run is
        cancelled (the engine drops its queued text) once no check waits for it."""
        task = self._canary
        if task is None or task.done():
            task = self._canary = asyncio.ensure_future(self.embed())
            # Its error is each waiter's; read here too, for a run cancelled with no waiter.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._waiting += 1
        try:
            return await asyncio.wait_for(asyncio.shield(task), deadline)
        finally:
            self._waiting -= 1
            if not self._waiting:
                task.cancel()  # no-op once done
