"""``python -m bgeserve serve`` as a real process on 127.0.0.1, with the tiny random bge-m3.

What only a real process shows: the official OpenAI client end to end, many concurrent clients
each getting exactly their own vectors, 429 backpressure that answers at once, SIGTERM draining
every accepted request and exiting 0, idle unload and transparent reload, JSON logs with
request ids, and a non-zero exit when the model cannot be loaded.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bgeserve import Engine
from tests.oracle import dense_rows
from tests.serverproc import ServerProc, free_port

pytestmark = pytest.mark.slow

ATOL = 1e-5
START_TIMEOUT = 60.0


def server_env(export: Path, cache: Path, **extra: str) -> dict[str, str]:
    # fp32 named: the vectors are compared with fp32's at 1e-5, and left to choose, the server
    # would serve this export's int8 (its manifest records dense cosine >= 0.999 vs fp32).
    env = {"BGE_M3_MODEL_PATH": str(export), "BGE_M3_CACHE_DIR": str(cache),
           "HF_HUB_OFFLINE": "1", "BGE_M3_LOG_FORMAT": "json", "BGE_M3_MODEL": "fp32",
           "BGE_M3_DISABLE_AUTO_BUDGET": "1", "BGE_M3_MAX_SEQ_LENGTH": "512"}
    env.update(extra)
    return env




def chunk_count(proc: ServerProc) -> float:
    """How many ``session.run`` calls the server has made (``bgeserve_chunk_texts_count``)."""
    text = httpx.get(f"{proc.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "bgeserve_chunk_texts_count":
                return sample.value
    raise AssertionError("bgeserve_chunk_texts_count is missing from /metrics")


@pytest.fixture(scope="module")
def engine(tiny_export: Path) -> Iterator[Engine]:
    with Engine(tiny_export, "fp32") as e:
        yield e


@pytest.fixture(scope="module")
def server(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One default server shared by the tests that do not need special settings."""
    with ServerProc(server_env(tiny_export, tmp_path_factory.mktemp("live-cache"))) as proc:
        proc.wait_health(timeout=START_TIMEOUT)
        yield proc


# -- the official client -------------------------------------------------------------------------
def test_openai_client_gets_engine_vectors(server: ServerProc, engine: Engine) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)
    texts = ["What is BGE M3?", "Definition of BM25", "hybrid search 混合检索"]
    want = engine.embed(texts).dense
    default = client.embeddings.create(model="bge-m3", input=texts)  # base64 on the wire
    as_float = client.embeddings.create(model="bge-m3", input=texts, encoding_format="float")
    for response in (default, as_float):
        assert response.model == "bge-m3"
        got = np.asarray([d.embedding for d in response.data], dtype=np.float32)
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
        assert response.usage.prompt_tokens == int(engine.tokenizer.encode(texts).lengths.sum())
    models = client.models.list()
    assert "bge-m3" in [m.id for m in models.data]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")


# -- concurrency ---------------------------------------------------------------------------------
def test_64_concurrent_clients_get_their_own_vectors(server: ServerProc, engine: Engine) -> None:
    texts = [f"client {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 7) for i in range(64)]
    want = {t: engine.embed(t).dense[0] for t in texts}  # each computed alone
    chunks_before = chunk_count(server)
    barrier = threading.Barrier(len(texts), timeout=30)
    limits = httpx.Limits(max_connections=len(texts), max_keepalive_connections=len(texts))

    def one(c: httpx.Client, text: str) -> tuple[str, int, np.ndarray | None]:
        barrier.wait()  # so that the requests really arrive together
        r = c.post("/v1/embeddings", json={"input": text})
        if r.status_code != 200:
            return text, r.status_code, None
        return text, r.status_code, dense_rows(r.json())[0]

    with httpx.Client(base_url=server.url, timeout=30, limits=limits) as c, \
            ThreadPoolExecutor(max_workers=len(texts)) as pool:
        results = list(pool.map(lambda t: one(c, t), texts))
    errors = [(t[:12], s) for t, s, _ in results if s != 200]
    assert not errors, errors
    for text, _, got in results:
        np.testing.assert_allclose(got, want[text], atol=ATOL, rtol=0, err_msg=text)
    # the batching crossed requests: fewer session runs than requests
    chunks = chunk_count(server) - chunks_before
    assert 1 <= chunks < len(texts), chunks


# -- logs and request ids --------------------------------------------------------------------
def test_json_logs_carry_request_ids(server: ServerProc) -> None:
    rid = "live-test-request-42"
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": "log me"},
                   headers={"X-Request-ID": rid, "X-Forwarded-For": "203.0.113.7"}, timeout=30)
    assert r.status_code == 200
    assert r.headers["x-request-id"] == rid
    generated = httpx.post(f"{server.url}/v1/embeddings", json={"input": []}, timeout=30)
    assert generated.status_code == 400
    other = generated.headers["x-request-id"]
    assert other and other != rid

    def find(request_id: str) -> dict[str, Any] | None:
        for record in server.json_logs():
            if record.get("request_id") == request_id and record.get("path") == "/v1/embeddings":
                return record
        return None

    deadline = time.monotonic() + 10
    while (find(rid) is None or find(other) is None) and time.monotonic() < deadline:
        time.sleep(0.05)
    ok, bad = find(rid), find(other)
    assert ok is not None, server.output()
    assert bad is not None, server.output()
    assert ok["status"] == 200 and bad["status"] == 400
    # The client: the one a proxy on loopback (trusted by default) named, else the peer.
    assert (ok["client"], bad["client"]) == ("203.0.113.7", "127.0.0.1")
    assert ok["level"] == "info" and ok["logger"] == "bgeserve.http"
    assert "POST /v1/embeddings 200" in ok["msg"]
    # every stdout line is JSON (BGE_M3_LOG_FORMAT=json)
    lines = [line for line in server.stdout_lines if line.strip()]
    assert lines and all(isinstance(json.loads(line), dict) for line in lines)


def metric(proc: ServerProc, name: str) -> float:
    text = httpx.get(f"{proc.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} is missing from /metrics")


def test_every_exported_metric_is_documented(server: ServerProc) -> None:
    """docs/metrics.md names every family a served /metrics exports (QA: 15 of them were in
    no doc), and names none the code does not define; promtool's naming rules hold (no
    abbreviated units such as ``_b_``, the unit last)."""
    import re

    import bgeserve.service.metrics as source

    doc = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(bgeserve_[a-z_]+)` \|", doc, re.MULTILINE))
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    exported = set(re.findall(r"^# TYPE (bgeserve_[a-z_]+) ", text, re.MULTILINE))
    assert exported and not exported - documented, sorted(exported - documented)
    defined = set(re.findall(r'"(bgeserve_[a-z_]+)"', Path(source.__file__).read_text()))
    assert {re.sub(r"_total$", "", name) for name in documented} <= defined, \
        sorted({re.sub(r"_total$", "", name) for name in documented} - defined)
    for name in exported:
        assert not re.search(r"_(a|b|kb|mb|s|ms)_", name + "_"), name
        assert not name.endswith("_per_worker"), name


def test_dimensions_must_be_the_models_own_width(server: ServerProc) -> None:
    """The tiny model is 32 wide: dimensions=32 is the no-op, 1024 (bge-m3's) is refused."""
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": "x"}, timeout=30)
    width = len(r.json()["data"][0]["embedding"])
    assert width != 1024
    ok = httpx.post(f"{server.url}/v1/embeddings", json={"input": "x", "dimensions": width},
                    timeout=30)
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == width
    bad = httpx.post(f"{server.url}/v1/embeddings", json={"input": "x", "dimensions": 1024},
                     timeout=30)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["code"] == "unsupported_dimensions"
    assert f"{width}-dimensional" in bad.json()["error"]["message"]


def test_responses_of_a_small_model_conform_to_openapi(server: ServerProc) -> None:
    """The contract holds for any model with bge-m3's layout, not only 1,024-wide ones."""
    import jsonschema_rs
    import yaml

    spec = yaml.safe_load((Path(__file__).resolve().parent.parent / "openapi.yaml").read_text())
    cases = [
        ("/v1/embeddings", {"input": ["a b c", "d"]}, "EmbeddingResponse"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "base64"}, "EmbeddingResponse"),
        ("/v1/sparse-embeddings", {"input": ["a b c"], "sparse_format": "tokens"},
         "SparseEmbeddingResponse"),
        ("/v1/embeddings:both", {"input": ["a b", "c"], "outputs": ["dense", "sparse", "colbert"]},
         "MultiEmbeddingResponse"),
        ("/v1/embeddings:both", {"input": "a b", "outputs": ["colbert"], "encoding_format":
                                 "base64", "colbert_dtype": "float16"}, "MultiEmbeddingResponse"),
    ]
    for path, body, schema in cases:
        r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
        assert r.status_code == 200, r.text
        validator = jsonschema_rs.Draft202012Validator(
            {"$ref": f"#/components/schemas/{schema}", "components": spec["components"]})
        errors = [e.message for e in validator.iter_errors(r.json())]
        assert not errors, (path, body, errors[:3])


# -- disconnects -----------------------------------------------------------------------------
def test_a_client_that_disconnects_has_its_texts_dropped(tiny_export: Path, tmp_path: Path) -> None:
    """Its texts leave the queue when it goes, not after they were computed for nobody.
    The canary, a chunk of its own, never waits out the window: /health/deep answers 200
    (its deadline is 5 s; it was 503 past it)."""
    # The 10 s batch window keeps the texts queued long enough to watch them go (fewer than
    # a chunk holds: a full chunk does not wait for the window).
    env = server_env(tiny_export, tmp_path, BGE_M3_BATCH_DELAY_MS="10000",
                     BGE_M3_MAX_CHUNK_TOKENS="8192")
    body = json.dumps({"input": [f"abandoned {i} " + "word " * 50 for i in range(4)]}).encode()
    with ServerProc(env) as proc:
        proc.wait_health(timeout=START_TIMEOUT)
        deep = httpx.get(f"{proc.url}/health/deep", timeout=30)
        assert deep.status_code == 200, deep.text
        runs = chunk_count(proc)
        with socket.create_connection(("127.0.0.1", proc.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.monotonic() + 10
            while proc.health().json()["queue"]["texts"] < 4:
                assert time.monotonic() < deadline, "the texts were never queued"
                time.sleep(0.01)
        gone = time.monotonic()
        while proc.health().json()["queue"]["texts"] > 0:
            assert time.monotonic() - gone < 3, "the abandoned texts are still queued"
            time.sleep(0.01)
        assert metric(proc, "bgeserve_cancelled_texts_total") == 4
        assert chunk_count(proc) == runs  # the texts never ran


# -- backpressure ----------------------------------------------------------------------------
def test_overload_answers_429_at_once(tiny_export: Path, tmp_path: Path) -> None:
    env = server_env(tiny_export, tmp_path, BGE_M3_MAX_QUEUE_TOKENS="400",
                     BGE_M3_MAX_CHUNK="1", BGE_M3_INTRA_THREADS="1")
    n = 32
    with ServerProc(env) as proc:
        proc.wait_health(timeout=START_TIMEOUT)
        barrier = threading.Barrier(n, timeout=30)
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)

        def one(c: httpx.Client, i: int) -> tuple[int, float, str | None]:
            barrier.wait()
            started = time.monotonic()
            r = c.post("/v1/embeddings", json={"input": [f"request {i} " + "word " * 60]})
            return r.status_code, time.monotonic() - started, r.headers.get("retry-after")

        with httpx.Client(base_url=proc.url, timeout=30, limits=limits) as c, \
                ThreadPoolExecutor(max_workers=n) as pool:
            results = list(pool.map(lambda i: one(c, i), range(n)))
        statuses = sorted(s for s, _, _ in results)
        assert set(statuses) <= {200, 429}, statuses
        rejected = [(t, ra) for s, t, ra in results if s == 429]
        assert rejected, "a queue of 400 tokens must overflow with 32 requests of ~130 tokens"
        assert any(s == 200 for s in statuses)
        assert all(ra is not None and int(ra) >= 1 for _, ra in rejected)
        slowest_429 = max(t for t, _ in rejected)
        assert slowest_429 < 1.0, f"a 429 took {slowest_429:.2f}s"
        health = proc.health()
        assert health.status_code == 200 and health.json()["status"] == "ok"
        # and the server still serves normally afterwards
        r = httpx.post(f"{proc.url}/v1/embeddings", json={"input": "after the storm"}, timeout=30)
        assert r.status_code == 200
        metrics = httpx.get(f"{proc.url}/metrics", timeout=10).text
        assert f"bgeserve_rejected_requests_total {float(len(rejected))}" in metrics


# -- shutdown --------------------------------------------------------------------------------
def test_sigterm_drains_accepted_requests_and_exits_0(tiny_export: Path, tmp_path: Path,
                                                      engine: Engine) -> None:
    per_request, n = 4, 8
    # Queued texts wait for the batch window (fewer than a chunk holds: a full chunk does not
    # wait for it): once /health counts all of them, every request has been accepted;
    # SIGTERM then arrives with all of them still in flight.
    env = server_env(tiny_export, tmp_path, BGE_M3_BATCH_DELAY_MS="1500",
                     BGE_M3_SHUTDOWN_TIMEOUT_SECS="15", BGE_M3_MAX_CHUNK_TOKENS="8192")
    texts = [[f"shutdown {i}.{j} " + "text " * (5 + 3 * j) for j in range(per_request)]
             for i in range(n)]
    with ServerProc(env) as proc:
        proc.wait_health(timeout=START_TIMEOUT)
        barrier = threading.Barrier(n + 1, timeout=30)

        def one(batch: list[str]) -> tuple[int, Any]:
            with httpx.Client(base_url=proc.url, timeout=30) as c:
                c.get("/health")
                barrier.wait()
                r = c.post("/v1/embeddings", json={"input": batch})
                return r.status_code, r.json()

        with ThreadPoolExecutor(max_workers=n) as pool:
            futures = [pool.submit(one, batch) for batch in texts]
            barrier.wait()
            deadline = time.monotonic() + 10
            queued = 0
            while queued < n * per_request and time.monotonic() < deadline:
                queued = proc.health().json()["queue"]["texts"]
                time.sleep(0.01)
            assert queued == n * per_request, f"only {queued} texts were queued"
            proc.signal(signal.SIGTERM)
            signalled = time.monotonic()
            results = [f.result(timeout=30) for f in futures]
        rc = proc.wait(timeout=20)
        took = time.monotonic() - signalled
    assert [s for s, _ in results] == [200] * n, results
    for batch, (_, body) in zip(texts, results, strict=True):
        np.testing.assert_allclose(dense_rows(body), engine.embed(batch).dense, atol=ATOL, rtol=0)
    assert rc == 0, proc.output()
    assert took < 15, f"shutdown took {took:.1f}s"


def stopped_mid_work(tiny_export: Path, tmp_path: Path, shutdown_secs: str,
                     signals: list[signal.Signals]) -> tuple[list[httpx.Response], float, int, str]:
    """Six requests of four 8,192-token texts each (~1 s a text here, one at a time) queued,
    then ``signals`` sent 0.5 s apart: the answers, the seconds from the last signal to the
    last answer, the exit code and the server's output."""
    env = server_env(tiny_export, tmp_path, BGE_M3_MAX_SEQ_LENGTH="8192",
                     BGE_M3_SHUTDOWN_TIMEOUT_SECS=shutdown_secs, BGE_M3_MAX_CHUNK="1",
                     BGE_M3_INTRA_THREADS="1")
    n = 6
    long_text = "lorem ipsum dolor " * 3000  # truncated to 8,192 tokens
    with ServerProc(env) as proc:
        proc.wait_health(timeout=START_TIMEOUT)

        def one(i: int) -> httpx.Response:
            return httpx.post(f"{proc.url}/v1/embeddings", timeout=60,
                              # four distinct texts: repeats would run once (the cache)
                              json={"input": [f"{i} {j} {long_text}" for j in range(4)]})

        with ThreadPoolExecutor(max_workers=n) as pool:
            futures = [pool.submit(one, i) for i in range(n)]
            deadline = time.monotonic() + 20
            while proc.health().json()["queue"]["texts"] < 4 * (n - 1):
                assert time.monotonic() < deadline, "the requests were never queued"
                time.sleep(0.01)
            for k, sig in enumerate(signals):
                if k:
                    time.sleep(0.5)  # the drain has begun
                proc.signal(sig)
            signalled = time.monotonic()
            responses = [f.result(timeout=30) for f in futures]
            answered = time.monotonic() - signalled
        rc = proc.wait(timeout=30)
        return responses, answered, rc, proc.output(tail=100_000)


def assert_answered_503(responses: list[httpx.Response], says: str) -> None:
    """Each answer is a 200 or a 503 ``not_ready`` in the envelope saying ``says``; some 503."""
    assert 503 in {r.status_code for r in responses}, [r.status_code for r in responses]
    for r in responses:
        assert r.status_code in (200, 503) and r.headers["content-type"] == "application/json"
        assert r.headers["x-request-id"]
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "not_ready"
            assert says in r.json()["error"]["message"]


def test_sigterm_answers_what_is_left_503_after_the_shutdown_timeout(tiny_export: Path,
                                                                     tmp_path: Path) -> None:
    """Work that cannot finish within BGE_M3_SHUTDOWN_TIMEOUT_SECS is answered 503 in the
    envelope (not cut off by the HTTP server's grace with a bare 500), and the exit is 0."""
    responses, answered, rc, output = stopped_mid_work(tiny_export, tmp_path, "1",
                                                       [signal.SIGTERM])
    assert_answered_503(responses, "BGE_M3_SHUTDOWN_TIMEOUT_SECS")
    assert answered < 10, f"the last answer came {answered:.1f}s after SIGTERM"
    assert rc == 0, output


def test_a_second_sigint_answers_what_is_left_503_at_once(tiny_export: Path,
                                                         tmp_path: Path) -> None:
    """Ctrl-C twice: the drain (~20 s of work) stops at once and every request still in
    progress is answered 503 in the envelope (uvicorn's forced exit cancelled them: a
    plain-text 500 and a traceback each), then exit 0."""
    responses, answered, rc, output = stopped_mid_work(tiny_export, tmp_path, "60",
                                                       [signal.SIGINT, signal.SIGINT])
    assert_answered_503(responses, "stopped at once")
    assert answered < 5, f"the last answer came {answered:.1f}s after the second SIGINT"
    assert rc == 0 and "Traceback" not in output, output


# -- idle unload ---------------------------------------------------------------------------------
def test_idle_unload_and_reload(tiny_export: Path, tmp_path: Path, engine: Engine) -> None:
    env = server_env(tiny_export, tmp_path, BGE_M3_IDLE_TIMEOUT_SECS="1")
    with ServerProc(env) as proc:
        proc.wait_health(timeout=START_TIMEOUT)
        idle = proc.wait_health(200, timeout=10, body_status="idle")
        assert idle["workers"]["loaded"] == 0 and idle["workers"]["live"] == 1
        r = httpx.post(f"{proc.url}/v1/embeddings", json={"input": "wake up"}, timeout=30)
        assert r.status_code == 200
        np.testing.assert_allclose(dense_rows(r.json())[0], engine.embed("wake up").dense[0],
                                   atol=ATOL, rtol=0)
        body = proc.health().json()
        assert body["status"] == "ok" and body["workers"]["loaded"] == 1
        messages = [rec.get("msg", "") for rec in proc.json_logs()]
        assert any("session unloaded" in m for m in messages), proc.output()


def test_under_nohup_a_hangup_leaves_the_server_serving(tiny_export: Path,
                                                       tmp_path: Path) -> None:
    """Started with SIGHUP ignored (nohup), a hangup (the terminal closing) is ignored still:
    the server drained and exited, with no supervisor to start it again."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # inherited by the child
    try:
        proc = ServerProc(server_env(tiny_export, tmp_path)).start()
    finally:
        signal.signal(signal.SIGHUP, previous)
    with proc:
        proc.wait_health(timeout=START_TIMEOUT)
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGHUP)
        time.sleep(1.5)
        assert proc.proc.poll() is None, proc.output()
        assert httpx.post(f"{proc.url}/v1/embeddings", json={"input": "still here"},
                          timeout=30).status_code == 200


def test_an_idle_connection_is_kept_past_uvicorns_5_seconds(server: ServerProc) -> None:
    """A kept-alive connection idle for 6 s still carries the next request (75 s by default,
    BGE_M3_KEEP_ALIVE_SECS): uvicorn's own 5 s closed it as nginx (60 s) or httpx's pool (5 s)
    sent on it: 502s and connection resets."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        assert first.status == 200 and first.read()
        sock = conn.sock
        time.sleep(6)
        conn.request("GET", "/health")  # on the same socket: http.client reopens only a closed one
        again = conn.getresponse()
        assert again.status == 200 and again.read()
        assert conn.sock is sock and sock is not None, "the server closed the idle connection"
    finally:
        conn.close()


def test_bound_to_any_ipv6_address_it_answers_ipv4_too(tiny_export: Path,
                                                      tmp_path: Path) -> None:
    """``[::]`` binds dual-stack, as Docker and Kubernetes mean it: asyncio's bind was IPv6
    only, IPv4 clients refused while the healthcheck (polling [::1]) said healthy."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 on this machine")
    port = free_port()
    with ServerProc(server_env(tiny_export, tmp_path, BGE_M3_BIND=f"[::]:{port}"),
                    port=port) as server:
        server.wait_health(timeout=START_TIMEOUT)  # polls 127.0.0.1
        assert httpx.get(f"http://[::1]:{server.port}/health", timeout=10).status_code == 200
        assert httpx.post(f"{server.url}/v1/embeddings", json={"input": "over IPv4"},
                          timeout=30).status_code == 200


# -- start-up failure ------------------------------------------------------------------------
def test_missing_model_exits_non_zero(tmp_path: Path) -> None:
    """A model path that is not there, or a file: exit 2 before the port is bound, one line
    on stderr naming it (it was found after the bind, exit 3, in the log only). One that is there but
    holds no model fails once loading: exit 3, the reason in the log and on stderr."""
    missing = tmp_path / "no-model-here"
    with ServerProc(server_env(missing, tmp_path / "cache")) as proc:
        rc = proc.wait(timeout=START_TIMEOUT)
        assert rc == 2, proc.output()
        assert proc.stderr_lines == [(f"bgeserve: model directory {missing} "
                                       "(BGE_M3_MODEL_PATH) does not exist")], proc.output()
        assert not any("Uvicorn running" in line for line in proc.stdout_lines)
    a_file = tmp_path / "model.onnx"  # a file is no model folder either (it was exit 3: QA)
    a_file.write_bytes(b"onnx")
    with ServerProc(server_env(a_file, tmp_path / "cache")) as proc:
        assert proc.wait(timeout=START_TIMEOUT) == 2, proc.output()
        assert proc.stderr_lines == [(f"bgeserve: model directory {a_file} (BGE_M3_MODEL_PATH) "
                                      "is a file, not a folder: name the folder of an export "
                                      "or a snapshot")], proc.output()
    empty = tmp_path / "empty"
    empty.mkdir()
    with ServerProc(server_env(empty, tmp_path / "cache")) as proc:
        rc = proc.wait(timeout=START_TIMEOUT)
        assert rc == 3, proc.output()
        errors = [rec for rec in proc.json_logs() if rec.get("level") == "error"]
        assert any("start-up failed" in rec["msg"] and str(empty) in rec["msg"]
                   for rec in errors), proc.output()
        assert any(line.startswith("bgeserve: start-up failed: ") and str(empty) in line
                   for line in proc.stderr_lines), proc.output()
