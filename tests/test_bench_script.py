"""scripts/bench.py's pure parts: the GPU option's checks and the HTTP load driver.

The driver is what every load and HTTP figure in docs/benchmarks.md rests on: it must return
each response under its own request's index, count non-200 answers as errors, and keep
``clients`` requests in flight. Checked against a small aiohttp server on loopback (no model).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("argv, problem", [
    (["--ep", "cuda", "--modes", "raw"], "drop raw"),
    (["--ep", "cuda", "--modes", "flag,engine"], "drop flag"),
    (["--ep", "tensorrt", "--modes", "none", "--rss-vs-length"], "--rss-vs-length"),
    (["--ep", "cuda", "--modes", "none", "--chunk-sweep", "256"], "--chunk-sweep"),
])
def test_gpu_providers_take_only_engine_http_and_load(bench, capsys, argv, problem):
    """Raw runtime calls, FlagEmbedding, RSS and the sweep are CPU measurements: refused."""
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert problem in capsys.readouterr().err


def test_gpu_provider_with_engine_http_and_load_parses(bench):
    args = bench.parse_args(["--ep", "cuda", "--modes", "engine,http", "--load"])
    assert (args.ep, args.modes, args.load) == ("cuda", ["engine", "http"], True)
    assert bench.parse_args([]).ep == "cpu"


async def _serve(handler):
    """An aiohttp app on a free loopback port, in the running loop: (runner, base URL)."""
    app = web.Application()
    app.router.add_post("/v1/embeddings:both", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def test_load_driver_keeps_each_answer_with_its_request(bench):
    """Answers arrive out of order (later requests answer sooner); each lands at its index,
    tokens add up, a 429 is an error, and all clients were in flight at once."""
    in_flight = {"now": 0, "max": 0}

    async def handler(request):
        body = await request.json()
        n = int(body["input"][0])
        in_flight["now"] += 1
        in_flight["max"] = max(in_flight["max"], in_flight["now"])
        await asyncio.sleep(0.002 * (20 - n % 20))
        in_flight["now"] -= 1
        if n == 7:
            return web.json_response({"error": {"message": "busy"}}, status=429)
        return web.json_response({"data": [{"index": 0, "echo": n}],
                                  "usage": {"prompt_tokens": n}})

    async def main():
        runner, url = await _serve(handler)
        try:
            bodies = [bench._body([str(i)]) for i in range(40)]
            return await bench._drive(url, bodies, 8, 30.0)
        finally:
            await runner.cleanup()

    wall, latencies, results, errors, tokens = asyncio.run(main())
    assert len(latencies) == 40 and wall > 0
    assert len(errors) == 1 and errors[0].startswith("429")
    assert results[7] is None
    assert [r["data"][0]["echo"] for i, r in enumerate(results) if i != 7] == \
        [i for i in range(40) if i != 7]
    assert tokens == sum(range(40)) - 7
    assert in_flight["max"] == 8


def test_load_driver_counts_a_dead_server_as_errors(bench):
    """Nothing listening: every request is one counted error, none is lost or raised."""
    from tests.serverproc import free_port

    bodies = [bench._body(["x"]) for _ in range(5)]
    _, latencies, results, errors, tokens = asyncio.run(
        bench._drive(f"http://127.0.0.1:{free_port()}", bodies, 2, 5.0))
    assert len(errors) == 5 and len(latencies) == 5
    assert results == [None] * 5 and tokens == 0
    assert json.loads(bodies[0])["input"] == ["x"]
