"""scripts/rerank_bench.py's pure parts: the /v1/rerank driver, the agreement figures, and how
it finds FlagReranker's checkpoint; scripts/bench.py's --rerank-export hook.

The driver is what the rerank throughput and agreement figures in docs/benchmarks.md rest on:
every score must land at its own document's index although the server answers each request
sorted by score, and a non-200 answer must fail the run, not leave a hole. Checked against a
small aiohttp server on loopback (no model).
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web

from tests.scriptload import load_script


@pytest.fixture(scope="module")
def rb():
    module = load_script("rerank_bench")
    yield module
    sys.modules.pop(module.__name__, None)


async def _serve(handler):
    app = web.Application()
    app.router.add_post("/v1/rerank", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def test_driver_puts_each_score_at_its_document(rb):
    """Each request's results come back sorted by score (not in request order), requests
    finish out of order; every document's score lands at its own index, none is missing, and
    the body asks for raw logits from the reranker."""
    seen = []

    async def handler(request):
        body = await request.json()
        seen.append(body)
        docs = body["documents"]
        await asyncio.sleep(0.001 * (10 - len(seen) % 10))
        results = [{"index": i, "relevance_score": float(d)} for i, d in enumerate(docs)]
        results.sort(key=lambda r: -r["relevance_score"])
        return web.json_response({"results": results})

    async def main():
        runner, url = await _serve(handler)
        try:
            return await rb.drive(url, "q", [str(i) for i in range(23)], 4, 3)
        finally:
            await runner.cleanup()

    wall, latencies, scores = asyncio.run(main())
    assert wall > 0 and len(latencies) == 6  # ceil(23 / 4) requests
    np.testing.assert_array_equal(scores, np.arange(23, dtype=float))
    assert all(b["model"] == rb.MODEL_ID and b["normalize"] is False and b["query"] == "q"
               for b in seen)


def test_driver_fails_on_an_error_answer(rb):
    """A 429 (or any non-200) stops the run with its status and body: no silent NaN."""

    async def handler(request):
        return web.json_response({"error": {"message": "busy"}}, status=429)

    async def main():
        runner, url = await _serve(handler)
        try:
            await rb.drive(url, "q", ["a", "b"], 1, 2)
        finally:
            await runner.cleanup()

    with pytest.raises(RuntimeError, match="HTTP 429"):
        asyncio.run(main())


def test_kendall_tau(rb):
    """1 for the same order, -1 for the reverse, and a score shift changes nothing."""
    a = np.array([0.1, 0.5, 0.3, 0.9])
    assert rb.kendall_tau(a, a + 7) == pytest.approx(1.0)
    assert rb.kendall_tau(a, -a) == pytest.approx(-1.0)
    assert rb.kendall_tau(a, np.array([0.1, 0.3, 0.5, 0.9])) == pytest.approx(4 / 6)


def test_summarize_ratios_and_agreement(rb):
    """Median walls give pairs/s and each HTTP mode's ratio to flag; agreement is taken
    against flag's first round: largest |Δ|, tau, whether the top document is the same."""
    flag = [0.0, 1.0, 2.0, 3.0]
    rows = {
        "flag": [{"wall_s": w, "scores": flag, "peak_rss": 5 << 20} for w in (4.0, 2.0, 3.0)],
        "http-int8": [{"wall_s": w, "scores": [0.0, 1.0, 3.5, 3.0], "latencies": [0.5, 0.25],
                       "peak_rss": 7 << 20} for w in (1.0, 1.5)],
    }
    out = rb.summarize(rows, pairs=4, pair_tokens=400)
    assert out["modes"]["flag"]["pairs_per_s"] == pytest.approx(4 / 3.0)
    http = out["modes"]["http-int8"]
    assert http["pairs_per_s"] == pytest.approx(4 / 1.25)
    assert http["max_abs_vs_flag"] == pytest.approx(1.5)
    assert http["kendall_vs_flag"] == pytest.approx(4 / 6)
    assert http["top1_vs_flag"] is False and http["peak_rss"] == 7 << 20
    assert out["ratios"] == {"http-int8 / flag": pytest.approx(3.0 / 1.25)}
    assert "| http-int8 | 3.20 | 320 |" in out["markdown"] and "2.40x" in out["markdown"]


def test_flag_checkpoint_from_the_manifest(rb, tmp_path):
    """Without --reranker-pt, FlagReranker loads the export's source model (its manifest);
    a source that is not here is a usage error naming the option."""
    export, model = tmp_path / "export", tmp_path / "model"
    export.mkdir()
    model.mkdir()
    (export / "manifest.json").write_text(json.dumps({"source": {"model": str(model)}}))
    args = rb.parse_args(["--reranker-export", str(export), "--m3-export", str(tmp_path)])
    assert args.reranker_pt == model
    model.rmdir()
    with pytest.raises(SystemExit):
        rb.parse_args(["--reranker-export", str(export), "--m3-export", str(tmp_path)])


def test_bench_takes_the_rerank_options(capsys):
    """scripts/bench.py --rerank-export DIR --rerank-args '...': parsed for the same run."""
    bench = load_script("bench")
    try:
        args = bench.parse_args(["--rerank-export", "/x", "--rerank-args", "--pairs 8"])
        assert (args.rerank_export, args.rerank_args) == ("/x", "--pairs 8")
        assert bench.parse_args([]).rerank_export is None
    finally:
        sys.modules.pop(bench.__name__, None)
