"""Deadlines (BGE_M3_REQUEST_TIMEOUT_SECS) over HTTP: a 504 in the envelope, counted once in
``bgeserve_deadline_exceeded_requests`` whichever part of the server noticed it first."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.serverproc import ServerProc
from tests.test_server_live import START_TIMEOUT, metric, server_env

pytestmark = pytest.mark.slow


def test_a_request_past_its_deadline_is_a_504(tiny_export: Path, tmp_path: Path) -> None:
    """Sixteen texts of 8,192 tokens, one at a time on one thread (~0.2-1 s each), against a
    2 s deadline: 504 `timeout` with the request id, after about the deadline, saying how
    much had run and that the request is too large for the deadline; the metric counts it;
    the server drops the rest and serves the next request. (0.5 s was too short to tokenize
    the eight texts it had on a loaded 2-core Zen 3, 0.36-0.49 s: the 504 said it was still
    being tokenized.)"""
    env = server_env(tiny_export, tmp_path, BGE_M3_REQUEST_TIMEOUT_SECS="2",
                     BGE_M3_MAX_SEQ_LENGTH="8192", BGE_M3_MAX_CHUNK="1",
                     BGE_M3_INTRA_THREADS="1")
    long_text = "lorem ipsum dolor " * 3000  # truncated to 8,192 tokens
    with ServerProc(env) as proc:
        proc.wait_health(timeout=START_TIMEOUT)
        # Distinct: copies of one text run once (the others repeat it).
        texts = [f"{i} {long_text}" for i in range(16)]
        r = httpx.post(f"{proc.url}/v1/embeddings", json={"input": texts},
                       timeout=30, headers={"X-Request-ID": "deadline-1"})
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "timeout"
        message = r.json()["error"]["message"]
        assert "BGE_M3_REQUEST_TIMEOUT_SECS" in message
        # Where it was: too large for the deadline, not behind others (each text alone runs
        # past the deadline's share here).
        assert "of the 16 texts it had to run were done" in message, message
        assert "too much for one request under this deadline" in message, message
        assert r.headers["x-request-id"] == "deadline-1"
        assert r.headers["x-should-retry"] == "false"  # the openai client would run it 3 times
        assert r.elapsed.total_seconds() < 4.5
        assert metric(proc, "bgeserve_deadline_exceeded_requests_total") == 1
        assert proc.health().json()["queue"]["texts"] == 0  # the other seven were dropped
        deadline = time.monotonic() + 10
        while proc.health().json()["workers"]["busy"]:  # the text that was running ends
            assert time.monotonic() < deadline
            time.sleep(0.02)
        ok = httpx.post(f"{proc.url}/v1/embeddings", json={"input": ["in time"]}, timeout=30)
        assert ok.status_code == 200


def test_a_rerank_past_its_deadline_says_how_far_it_got(tiny_export: Path,
                                                          tmp_path: Path) -> None:
    """bge-m3's own rerank scores past the deadline: a 504 saying how many of the texts it had
    to run were done, as an embedding's does (a 2 s deadline: see the test above)."""
    env = server_env(tiny_export, tmp_path, BGE_M3_REQUEST_TIMEOUT_SECS="2",
                     BGE_M3_MAX_SEQ_LENGTH="8192", BGE_M3_MAX_CHUNK="1",
                     BGE_M3_INTRA_THREADS="1")
    long_text = "lorem ipsum dolor " * 3000
    with ServerProc(env) as proc:
        proc.wait_health(timeout=START_TIMEOUT)
        r = httpx.post(f"{proc.url}/v1/rerank", timeout=30, json={
            "model": "bge-m3", "query": "lorem",
            "documents": [f"{i} {long_text}" for i in range(16)]})
        assert r.status_code == 504, r.text
        message = r.json()["error"]["message"]
        assert "BGE_M3_REQUEST_TIMEOUT_SECS=2s: " in message, message
        assert "texts it had to run were done" in message, message


def test_every_504_is_counted_once(tiny_export: Path, tmp_path: Path) -> None:
    """Twelve requests at once on one worker, each of texts that wait behind one another in
    the queue, a deadline that some of them miss: the metric equals the number of 504 answers
    (the service's timer and the scheduler's expiry race; each 504 is counted by whichever
    answered it). Those the queue has no room for within the deadline's share are 429s
    (service/admission.py's QUEUE_DEADLINE_SHARE)."""
    env = server_env(tiny_export, tmp_path, BGE_M3_REQUEST_TIMEOUT_SECS="0.1",
                     BGE_M3_MAX_SEQ_LENGTH="8192", BGE_M3_MAX_CHUNK="1",
                     BGE_M3_INTRA_THREADS="1")
    long_text = "lorem ipsum dolor sit amet " * 900  # ~4,500 tokens: tens of ms each here
    n = 12
    with ServerProc(env) as proc:
        proc.wait_health(timeout=START_TIMEOUT)
        barrier = threading.Barrier(n, timeout=30)

        def one(i: int) -> int:
            barrier.wait()
            return httpx.post(f"{proc.url}/v1/embeddings", timeout=30,
                              json={"input": [f"{i} {j} {long_text}" for j in range(8)]}
                              ).status_code

        with ThreadPoolExecutor(max_workers=n) as pool:
            statuses = list(pool.map(one, range(n)))
        assert set(statuses) <= {200, 429, 504}, statuses
        assert 504 in statuses, statuses
        assert metric(proc, "bgeserve_deadline_exceeded_requests_total") == statuses.count(504)


@pytest.mark.parametrize("route", ["/v1/embeddings", "/embed", "/embed?left", "/tokenize",
                                   "/decode"])
def test_a_request_waiting_for_a_tokenizing_slot_gets_its_504_at_the_deadline(
        tiny_export: Path, tmp_path: Path, route: str) -> None:
    """Every tokenizing slot taken (behind big requests): the request's deadline runs while it
    waits, so its 504 comes at the deadline, not once a slot frees and it is tokenized
    (20 requests of 23 MiB against a 2 s deadline got theirs at 3.4-24 s)."""
    import asyncio

    from tests.test_service import base_env, serving, wait_health

    env = base_env(tiny_export, tmp_path, BGE_M3_REQUEST_TIMEOUT_SECS="0.5",
                   BGE_M3_MODEL="fp32")
    with serving(env) as (client, service):
        wait_health(client)
        assert service.admission is not None
        slots = service.admission._tokenizing = asyncio.Semaphore(0)  # every slot busy
        big = ["tokenized on a thread " * 40] * 2  # past INLINE_TOKENIZE_CHARS
        body: dict = {"input": big} if route == "/v1/embeddings" else {"inputs": big}
        if route == "/embed?left":  # cut from the left inside the deadline, not before it
            route, body["truncation_direction"] = "/embed", "left"
        if route == "/decode":
            body = {"ids": [[5, 6, 7]] * 4}
        answers: list[tuple[int, float]] = []

        def post() -> None:
            started = time.monotonic()
            r = client.post(route, json=body)
            answers.append((r.status_code, time.monotonic() - started))

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        thread.join(timeout=15)
        if not answers:  # free the slots (on the app's loop) so that the app can stop
            client.portal.call(slots.release)  # type: ignore[union-attr]
            thread.join(timeout=15)
        assert len(answers) == 1 and answers[0][1] < 15, (
            f"{answers}: the deadline did not run while the request waited for a slot")
        status, seconds = answers[0]
        assert status == 504 and 0.4 < seconds < 5, answers
    dropped = 2 if route in ("/v1/embeddings", "/embed") else 0  # /tokenize, /decode run none
    assert cancelled_texts(client) == dropped


def cancelled_texts(client) -> float:  # type: ignore[no-untyped-def]
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("bgeserve_cancelled_texts_total "):
            return float(line.split()[1])
    raise AssertionError("no bgeserve_cancelled_texts_total")


@pytest.mark.parametrize("route", ["embed", "rerank"])
def test_the_texts_of_a_client_gone_before_its_request_was_queued_are_counted(
        tiny_export: Path, tmp_path: Path, route: str) -> None:
    """A client that leaves while its request waits to be tokenized: its texts (a rerank's
    documents) never reach the scheduler, which counted only those it dropped (QA: 5 clients
    gone with 30 texts each while tokenized, 0 counted)."""
    import asyncio
    import contextlib

    from bgeserve.results import EmbedOptions, RerankOptions
    from tests.test_service import base_env, serving, wait_health

    env = base_env(tiny_export, tmp_path, BGE_M3_MODEL="fp32")
    with serving(env) as (client, service):
        wait_health(client)
        assert service.admission is not None
        slots = service.admission._tokenizing = asyncio.Semaphore(0)  # every slot busy

        async def leave() -> None:
            texts = ["tokenized on a thread " * 40] * 3  # past INLINE_TOKENIZE_CHARS
            task = asyncio.ensure_future(
                service.embed(texts, EmbedOptions()) if route == "embed"
                else service.rerank("a query", texts, RerankOptions()))
            await asyncio.sleep(0.2)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            slots.release()

        client.portal.call(leave)  # type: ignore[union-attr]
        assert cancelled_texts(client) == 3


@pytest.mark.parametrize("route", ["/embed", "/tokenize"])
def test_a_request_past_its_deadline_while_tokenized_stops_its_tokenizing(
        tiny_export: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str) -> None:
    """Its thread stops at the next group of texts (bgeserve.stopping), so the 504 comes about
    at the deadline, not once the whole request was tokenized for no one (29 MiB of texts
    under a 15 s deadline: a 504 after 67.7 s, a core busy all along)."""
    from bgeserve.engine import tokenizer as module
    from tests.test_service import base_env, serving, wait_health

    monkeypatch.setattr(module, "GROUP_CHARS", 2_000)
    env = base_env(tiny_export, tmp_path, BGE_M3_REQUEST_TIMEOUT_SECS="0.5",
                   BGE_M3_MODEL="fp32")
    with serving(env) as (client, service):
        wait_health(client)
        tok = service._engine().tokenizer
        groups: list[int] = []
        real = tok._tk

        class Slow:  # each group of 2,000 characters takes 0.2 s: 40 groups, 8 s in all
            def encode_batch(self, batch, **kw):  # type: ignore[no-untyped-def]
                groups.append(len(batch))
                time.sleep(0.2)
                return real.encode_batch(batch, **kw)

            def __getattr__(self, name):  # type: ignore[no-untyped-def]
                return getattr(real, name)  # the rest as the tokenizer's (id_to_token)

        monkeypatch.setattr(tok, "_tk", Slow())
        texts = [f"{i} " + "word " * 380 for i in range(80)]  # ~1,900 characters each
        started = time.monotonic()
        r = client.post(route, json={"inputs": texts})
        seconds = time.monotonic() - started
        assert r.status_code == 504, r.text
        assert seconds < 2.5, seconds  # the deadline and a group or two, not 16 s
        time.sleep(0.5)
        assert len(groups) < 12, groups  # it stopped: not all 80
