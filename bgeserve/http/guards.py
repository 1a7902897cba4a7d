"""Middleware that refuses a request before a handler runs: bearer keys, the body limit and
the allowance of bodies in progress.

All answer with the same body as every other error (built by ``errors.respond``, in the
route's style); they sit inside ``RequestContext``, so the response still carries the request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bgeserve.errors import BgeServeError, InvalidInput, NotReady, Overloaded, TooLarge
from bgeserve.holds import answering, release_all
from bgeserve.http.context import CHARGE_BODY, HOLD_UNTIL_TAKEN
from bgeserve.http.errors import BodyTimeout, Unauthorized, respond
from bgeserve.http.heap import HeapTrim

# nginx's client_body_timeout: a client may be slow, but not silent for longer than this.
BODY_IDLE_TIMEOUT_S = 60.0
# Apache's mod_reqtimeout (body=20,MinRate=500), stricter on the rate: past its first
# BODY_GRACE_S a body must keep arriving at BODY_MIN_RATE bytes a second, where the time a
# faster start gained counts for BODY_IDLE_TIMEOUT_S at most. A byte every few seconds never
# tripped the idle timeout, and two such uploads declaring 1 MiB held a 2 MiB allowance of
# bodies in progress (every other request 429) for as long as the client cared to; now they
# are cut off after ~20 s. The gain is capped: on average since the start, a client that sent
# 32 MiB less 10 bytes at once had banked 34 minutes, and with a byte a minute held the whole
# allowance of a small container for all of them (QA); now ~60 s. 16 KiB/s is far below any
# pipeline's link.
BODY_GRACE_S = 20.0
BODY_MIN_RATE = 16 << 10
# How long a body over half the allowance waits for room before its 429 (InflightLimit).
# Under BODY_GRACE_S: the rate's clock for its body runs while it waits.
ROOM_WAIT_S = 10.0


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope["headers"] if k == name), None)


class BearerAuth:
    """Require ``Authorization: Bearer <key>`` on every request but a GET (or HEAD) of one of
    ``open_paths`` (probes: ``POST /`` embeds, ``GET /`` is a health check).

    The key alone, with no scheme, is taken too: LlamaIndex's TEI reranker sends its
    ``auth_token`` as the whole header (0.6.0), and what is checked is still the key.
    Digests of the presented and configured keys are compared in constant time, every key
    every time, so timing reveals neither a key's length nor which key came close. Keys are
    never logged.
    """

    def __init__(self, app: ASGIApp, *, keys: tuple[str, ...], open_paths: frozenset[str]):
        self.app = app
        self.digests = tuple(_digest(k.encode("utf-8")) for k in keys)
        self.open_paths = open_paths

    def _check(self, scope: Scope) -> Unauthorized | None:
        raw = _header(scope, b"authorization")
        if raw is None:
            return Unauthorized("missing API key: send the header 'Authorization: Bearer <key>'")
        scheme, _, token = raw.strip().partition(b" ")
        bearer = _digest(token.strip()) if scheme.lower() == b"bearer" else None
        bare = _digest(raw.strip())
        matched = False
        for digest in self.digests:
            matched |= hmac.compare_digest(bare, digest)
            matched |= bearer is not None and hmac.compare_digest(bearer, digest)
        return None if matched else Unauthorized("invalid API key")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.digests and not (
                scope["path"] in self.open_paths and scope["method"] in ("GET", "HEAD")):
            refusal = self._check(scope)
            if refusal is not None:
                await respond(refusal, scope)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Uploads:
    """The request bodies being waited for, answered 503 at a stop's deadline.

    A request still receiving its body at SIGTERM is not in the service yet, so the service's
    503 at BGE_M3_SHUTDOWN_TIMEOUT_SECS never reached it, and uvicorn's own grace then
    cancelled it: a plain-text 500 without the request id. ``abort_after`` (called as the
    stop begins) ends each wait for body bytes at the deadline with ``NotReady``.
    """

    def __init__(self) -> None:
        self.aborted = False
        self._waits: set[asyncio.Timeout] = set()

    def abort_after(self, seconds: float) -> None:
        """At ``seconds`` from now (0: never: the stop waits for everything) abort every wait."""
        if seconds:
            asyncio.get_running_loop().call_later(seconds, self.abort)

    def abort(self) -> None:
        self.aborted = True
        now = asyncio.get_running_loop().time()
        for wait in list(self._waits):
            # One whose own deadline fired this loop pass cannot be rescheduled (RuntimeError,
            # which would leave the rest waiting): it ends now anyway, and is refused below.
            if not wait.expired():
                wait.reschedule(now)

    def refusal(self) -> NotReady:
        # Its body may have arrived whole and waited behind another request on its
        # connection (pipelined): it was not read, whichever.
        return NotReady("the server is shutting down and this request's body was not read "
                        "before it stopped reading them (BGE_M3_SHUTDOWN_TIMEOUT_SECS, or "
                        "Ctrl-C twice); retry (another instance will answer)")

    @contextlib.asynccontextmanager
    async def waiting(self, seconds: float) -> AsyncIterator[None]:
        """``asyncio.timeout(seconds)`` that an abort ends early (raising ``NotReady``)."""
        if self.aborted:
            raise self.refusal()
        try:
            async with asyncio.timeout(seconds) as wait:
                self._waits.add(wait)
                try:
                    yield
                finally:
                    self._waits.discard(wait)
        except TimeoutError:
            if self.aborted:
                raise self.refusal() from None
            raise


class BodyLimit:
    """Refuse bodies over ``max_bytes``: at once from ``Content-Length``, else while reading.

    A chunked or lying client is cut off as soon as the running total passes the limit: the
    wrapped ``receive`` raises ``TooLarge``, which the handler's body read propagates to the
    error table, so the rest of the stream is never read. A client that stops sending its body
    (a Content-Length larger than what it sends, a slowloris) gets 408 after ``idle_timeout``
    seconds without a byte, instead of holding its connection forever; one that trickles it
    gets 408 once it falls behind ``grace`` seconds plus a second for every ``min_rate``
    bytes, where what a faster start gained counts for ``idle_timeout`` seconds at most (a
    token bucket of time: each byte buys 1/min_rate s, the bank capped).
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int,
                 idle_timeout: float = BODY_IDLE_TIMEOUT_S, grace: float = BODY_GRACE_S,
                 min_rate: float = BODY_MIN_RATE, uploads: Uploads | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.idle_timeout = idle_timeout
        self.grace = grace
        self.min_rate = min_rate
        self.uploads = uploads or Uploads()

    def _too_large(self, declared: int | None = None) -> TooLarge:
        size = "" if declared is None else f" of {declared} bytes"
        return TooLarge(
            f"request body{size} exceeds the limit of {self.max_bytes} bytes "
            "(BGE_M3_MAX_BODY_BYTES); send fewer or shorter texts per request",
            code="payload_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        refusal: BgeServeError | None = None
        if declared is not None and not declared.strip().isdigit():
            refusal = InvalidInput("malformed Content-Length header", code="bad_request")
        elif declared is not None and int(declared) > self.max_bytes:
            refusal = self._too_large(int(declared))
        if refusal is not None:
            await respond(refusal, scope)(scope, receive, send)
            return
        total = 0
        complete = False
        started = time.monotonic()
        until = started + self.grace  # the rate's deadline for more of the body

        async def limited_receive() -> Message:
            nonlocal total, complete, until
            if complete:  # after the body only http.disconnect comes, whenever it does
                return await receive()
            behind = until - time.monotonic()
            try:
                # asyncio.timeout, not wait_for: no task per message (a query's whole body is
                # one message), and receive() runs in the handler's own task.
                async with self.uploads.waiting(max(0.0, min(self.idle_timeout, behind))):
                    message = await receive()
            except TimeoutError:
                if behind < self.idle_timeout:
                    raise BodyTimeout(
                        f"the request body arrived slower than {self.min_rate:g} bytes a "
                        f"second after its first {self.grace:g}s ({total} bytes in "
                        f"{time.monotonic() - started:.0f}s, what a faster start gained "
                        f"counting for {self.idle_timeout:g}s at most); send the whole body "
                        "at once") from None
                raise BodyTimeout(f"no byte of the request body arrived for "
                                  f"{self.idle_timeout:g}s; send the whole body at once") from None
            if message["type"] == "http.request":
                size = len(message.get("body", b""))
                total += size
                if total > self.max_bytes:
                    raise self._too_large()
                complete = not message.get("more_body", False)
                until = min(until + size / self.min_rate, time.monotonic() + self.idle_timeout)
            return message

        await self.app(scope, limited_receive, send)


@dataclass(eq=False)
class Waiter:
    """A large body waiting for room: its size, and the future set when it is let in."""

    size: int
    admitted: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class BodyAllowance:
    """The request bodies in progress against their shared allowance: the bytes they hold,
    the requests refused for it (``/metrics`` reads both) and the large ones waiting for room.

    A body over half the allowance gets in only while the others hold less than the rest,
    and a stream of small requests may never all be done at once: retrying at each 429's
    Retry-After, a 30 MiB upload under the 32 MiB floor of a small container never got in
    within 300 s while small requests came one after another (QA). So such a body waits, up
    to ``wait_s``, first come first served (one that would fit waits behind one that came
    first: three clients looping on 28 MiB bodies starved a 20 MiB one, review), and is let
    in the moment the others' bytes given back leave room for it, before any request that
    comes later. Nothing is kept for it: small requests that fit still go in meanwhile
    (keeping the room refused every POST while one slow upload held part of it, and a large
    retrier waited for the rest: review of stop 58's attempt), and what waits holds no memory
    (its body is not read).
    """

    def __init__(self, max_bytes: int, wait_s: float = ROOM_WAIT_S) -> None:
        self.max_bytes = max_bytes
        self.wait_s = wait_s
        self.held = 0  # bytes of bodies in progress (one event loop: no lock needed)
        self.refused = 0  # requests answered 429 for want of room
        # The bodies still arriving, oldest first (a dict keeps its insertion order).
        self.arriving: dict[int, None] = {}
        self.tickets = itertools.count()
        self.waiting: deque[Waiter] = deque()  # large bodies, oldest first
        # The large body let in last, while its bytes are still arriving: the next one waits
        # for it (its bytes not yet counted, both would seem to fit; two at the 32 MiB floor
        # were both let in and one cut off part way, review), and it counts as the oldest
        # body arriving, which always finishes (small bodies let in since did not count its
        # bytes: cut off, it lost its turn near its end, 429s after part of 30 MiB, QA).
        self.entering: Waiter | None = None

    def fits(self, size: int) -> bool:
        """Whether a body of ``size`` bytes may go in beside those in progress (alone,
        always: the body limit bounds it)."""
        return not self.held or self.held + size <= self.max_bytes

    def large(self, size: int) -> bool:
        """Whether a body of ``size`` bytes waits for room rather than being refused."""
        return self.wait_s > 0 and 2 * size > self.max_bytes

    def waiting_count(self) -> int:
        """Large bodies waiting for room now (``/metrics``)."""
        return sum(not w.admitted.done() for w in self.waiting)

    def in_line(self) -> bool:
        """Whether a large body is waiting for room, or one let in is arriving."""
        return self.entering is not None or self.waiting_count() > 0

    def give_back(self, n: int) -> None:
        """``n`` bytes held are free again: the oldest large body waiting may fit now."""
        self.held -= n
        if self.waiting:
            # Once this step of the event loop is done: an answer's bytes are counted again
            # right after its body's are given back, and the room between is not room. (No
            # flag for "one is scheduled": one left set by a loop that closed first would
            # never wake the line again, review.)
            asyncio.get_running_loop().call_soon(self.wake)

    def wake(self) -> None:
        """Let the oldest waiting body in if it fits and the one before it has arrived."""
        while self.waiting and self.waiting[0].admitted.done():  # gone: timed out, or ended
            self.waiting.popleft()
        if self.waiting and self.entering is None and self.fits(self.waiting[0].size):
            self.entering = self.waiting.popleft()
            self.entering.admitted.set_result(None)

    def arrived(self, waiter: Waiter | None) -> None:
        """The body of the large one let in last arrived whole, or its request ended."""
        if waiter is not None and waiter is self.entering:
            self.entering = None
            self.wake()

    async def wait_for_room(
            self, size: int,
            timer: Callable[[float], AbstractAsyncContextManager[object]] = asyncio.timeout,
    ) -> Waiter | None:
        """Wait in turn, up to ``wait_s`` (timed by ``timer``: ``Uploads.waiting`` ends it at
        a stop's deadline), until a body of ``size`` bytes fits: its place (``arrived`` takes
        it back once its body did), None if it was not let in."""
        waiter = Waiter(size)
        self.waiting.append(waiter)
        self.wake()
        try:
            async with timer(self.wait_s):
                await asyncio.shield(waiter.admitted)
        except TimeoutError:
            pass
        except BaseException:  # its task cancelled: out of the line, let in or not
            self._leave(waiter)
            raise
        if waiter.admitted.done():  # let in, perhaps as its time ran out
            return waiter
        self._leave(waiter)
        return None

    def _leave(self, waiter: Waiter) -> None:
        if waiter.admitted.done():
            self.arrived(waiter)
        else:
            waiter.admitted.cancel()
            self.wake()


class InflightLimit:
    """Refuse a request while the bodies of those in progress hold ``max_bytes`` already.

    A request's body, its parsed texts and its token ids live until it is answered, outside
    the workspace budget the probe sets for the sessions; 16 concurrent 32 MiB requests were
    enough to get a server under a 600 MiB memory cap OOM-killed. So bodies count against a
    shared allowance by their bytes as they arrive, until the response is sent. A request
    whose ``Content-Length`` would pass what the others hold is answered 429 with
    ``Retry-After`` at once, before its body is read, unless it is over half the allowance:
    that one waits for room in turn (``BodyAllowance``), and is a 429 only if none came
    within ``wait_s``. One let in whose bytes then pass it (it came with others at once) is
    answered 429 when they do, unless it is the oldest body still arriving (a large one let in
    counts as the oldest): that one always finishes (small requests coming one after another
    must not cut a large upload off near its end; held is then at most the allowance plus one
    largest body). A request alone is always let in, whatever its size (the body limit
    bounds it), as the queue takes any job when empty. A refused body's bytes are given back
    at once, not after the lingering close that reads the rest of it (linger.py: 5 s, in
    which the upload it competed with was refused too). Its scope (``answering``) is also
    where the room of the request's ColBERT output is given back.

    Not by the declared ``Content-Length``: what has not arrived holds no memory, and 16
    connections that declared 32 MiB, sent a byte and reconnected at each 408 held the whole
    512 MiB, every other POST a 429 (QA: 118 of 118; one connection where the allowance is
    the 32 MiB floor).
    """

    def __init__(self, app: ASGIApp, *, allowance: BodyAllowance,
                 uploads: Uploads | None = None, heap: HeapTrim | None = None):
        self.app = app
        self.allowance = allowance
        # What a large body's texts and ids freed goes back to the OS when it ends (heap.py).
        self.heap = heap or HeapTrim()
        # A stop's deadline ends the waits for room as it ends those for body bytes (503).
        self.uploads = uploads or Uploads()

    def _refusal(self, size: int, what: str = "this one ({} MiB)") -> Overloaded:
        bodies = self.allowance
        bodies.refused += 1
        return Overloaded(
            f"{bodies.held / 2**20:.1f} MiB of request bodies and answers not yet taken are in "
            f"progress and {what.format(f'{size / 2**20:.1f}')} would pass the "
            f"{bodies.max_bytes / 2**20:.1f} MiB allowed at once (BGE_M3_MAX_INFLIGHT_MB); "
            "retry shortly", retry_after=1.0)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)  # no body: /health always answers
            return
        bodies = self.allowance
        declared = _header(scope, b"content-length")
        size = int(declared) if declared is not None and declared.strip().isdigit() else 0
        waiter = None  # its place in the line of large bodies
        # A large body takes its turn: at once if none waits, none let in is arriving and it
        # fits.
        if bodies.large(size):
            try:
                waiter = await bodies.wait_for_room(size, self.uploads.waiting)
            except NotReady as exc:
                await respond(exc, scope)(scope, receive, send)
                return
            if waiter is None:
                refusal = self._refusal(size, "this one ({} MiB, which waited "
                                        f"{bodies.wait_s:g}s for room)")
                await respond(refusal, scope)(scope, receive, send)
                return
        elif not bodies.fits(size):
            await respond(self._refusal(size), scope)(scope, receive, send)
            return
        mine = 0  # the bytes of this body that arrived
        ticket = next(bodies.tickets)
        if waiter is None:
            bodies.arriving[ticket] = None
        else:  # the oldest, whatever came before it
            bodies.arriving = {ticket: None, **bodies.arriving}

        async def counted_receive() -> Message:
            nonlocal mine
            message = await receive()
            if message["type"] == "http.request" and ticket in bodies.arriving:
                more = len(message.get("body", b""))
                if (bodies.held - mine and bodies.held + more > bodies.max_bytes
                        and next(iter(bodies.arriving)) != ticket):
                    refusal = self._refusal(max(size, mine + more))
                    bodies.arriving.pop(ticket, None)
                    bodies.give_back(mine)
                    mine = 0
                    bodies.arrived(waiter)
                    raise refusal
                mine += more
                bodies.held += more
                if not message.get("more_body", False):
                    bodies.arriving.pop(ticket, None)
                    bodies.arrived(waiter)
            return message

        def charge(extra: int) -> None:  # CHARGE_BODY: what decoding the body adds
            nonlocal mine
            if extra <= 0:
                return
            if mine + extra > bodies.max_bytes:  # a 413, not one of the 429s ``refused`` counts
                raise TooLarge(
                    f"decoding this request's JSON would take ~{extra / 2**20:.0f} MiB beyond "
                    f"its {mine / 2**20:.1f} MiB (a Python object for each of its many small "
                    "values: arrays, objects, strings or numbers), more than the "
                    f"{bodies.max_bytes / 2**20:.0f} MiB allowed for request bodies in "
                    "progress (BGE_M3_MAX_INFLIGHT_MB); send fewer values per request",
                    code="payload_too_large")
            # Not a large body that took its turn: refused now, after its whole upload, for
            # ~0.4 % of it (a 30 MiB body of texts: its strings' list and pointers) while
            # small requests held the rest, it would lose its turn (review). Over half the
            # allowance itself, what it adds is under the other half.
            if bodies.held + extra > bodies.max_bytes and waiter is None:
                raise self._refusal(extra, "decoding this one's JSON ({} MiB more)")
            mine += extra
            bodies.held += extra

        scope.setdefault("state", {})[CHARGE_BODY] = charge
        answer = 0  # bytes of the answer handed to the server

        async def counted_send(message: Message) -> None:
            nonlocal answer
            if message["type"] == "http.response.body":
                answer += len(message.get("body", b""))
            await send(message)

        kept: list[Callable[[], None]] = []
        try:
            # The request's scope: what it holds besides its body (the room of its ColBERT
            # output, service/outputs.py) is given back too, once its answer is taken.
            with answering(kept):
                await self.app(scope, counted_receive, counted_send)
        finally:
            bodies.arriving.pop(ticket, None)
            bodies.arrived(waiter)
            bodies.give_back(mine)
            self._hold_until_taken(scope, answer, kept)
            self.heap.after(mine)

    def _hold_until_taken(self, scope: Scope, answer: int,
                          releases: list[Callable[[], None]]) -> None:
        """Count ``answer`` bytes in the allowance until the client has taken them, and keep
        what the request holds (``releases``: the room of its ColBERT output) until then. An
        answer handed over whole stays in the transport's buffer while its client reads
        slowly or not at all: ~12 MiB each for a ColBERT answer under 4 MiB of vectors, 18
        for one to an HTTP/1.0 client, outside every allowance and as many as clients stall
        (QA: 24 of them took the server from 104 to 367 MiB until the stall bound reset
        them). Held in the allowance of bodies, they refuse later requests (429); a burst
        admitted together is bounded by the ColBERT room they keep (QA: 40 non-readers let
        in at once held 145 MiB of a 16 MiB allowance)."""
        hold = scope.get("state", {}).get(HOLD_UNTIL_TAKEN)
        if hold is None or not answer:
            release_all(releases)
            return
        bodies = self.allowance
        left = 0

        def give_back(n: int) -> None:  # as the client takes the answer, in the event loop
            nonlocal left
            bodies.give_back(n)
            left -= n
            if left <= 0:
                release_all(releases)
                releases.clear()

        # Not ``bodies.held += hold(...)``: the call gives older holds of the connection back
        # (``bodies.give_back(n)``), which the read before it would undo (QA: the allowance
        # stuck full with no connection open).
        left = hold(answer, give_back)
        bodies.held += left
        if not left:
            release_all(releases)
