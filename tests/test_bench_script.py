"""scripts/bench.py's pure parts: the GPU option's checks, the HTTP load driver, the roofline.

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

from tests.scriptload import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    module = load_script("bench")
    yield module
    sys.modules.pop(module.__name__, None)


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


def test_work_per_token_follows_the_model_dims(bench):
    """bge-m3's encoder costs 0.63 GFLOP per token at 256 tokens (its GEMMs plus attention),
    counted from the dims, linear in the text's length plus a quadratic attention term."""
    dims = bench.roofline.Dims()
    assert dims.flops(256) / 256 / 1e9 == pytest.approx(0.6291, abs=1e-4)
    assert dims.flops(1) / 1e9 == pytest.approx(0.604, abs=1e-3)
    tiny = bench.roofline.Dims(hidden=32, intermediate=37, layers=2)
    assert tiny.flops(10) == 2 * 10 * (8 * 32 * 32 + 4 * 32 * 37 + 4 * 10 * 32)
    assert bench.roofline.corpus_gflop([256, 256], dims) == pytest.approx(2 * dims.flops(256) / 1e9)


def test_each_row_is_measured_against_its_own_precisions_ceiling(bench):
    """fp32 baselines (flag, ort1) against fp32; int8 against ONNX Runtime's int8, bf16 and
    ov-int8 against OpenVINO's; a precision with no ceiling measured gets no share."""
    dims = bench.roofline.Dims()
    rows = [{"ok": True, "corpus": "mixed", "mode": mode, "variant": variant, "wall_s": 2.0}
            for mode, variant in (("flag", "fp32"), ("engine", "int8"), ("http", "bf16"),
                                  ("raw", "ov-int8"))]
    rows.append({"ok": False, "corpus": "mixed", "mode": "raw", "variant": "fp32"})
    ceiling = {"fp32": 100.0, "int8-ort": 200.0, "bf16-openvino": 400.0}
    got = bench.roofline.shares(rows, {"mixed": [256] * 4}, dims, ceiling)
    work = 4 * dims.flops(256) / 1e9 / 2.0
    assert [(r["precision"], r["share"]) for r in got] == [
        ("fp32", pytest.approx(work / 100)), ("int8-ort", pytest.approx(work / 200)),
        ("bf16-openvino", pytest.approx(work / 400)), ("int8-openvino", None)]
    assert "| int8-openvino | " in bench.roofline.table(got, ceiling)


def test_summary_gives_each_path_its_ratio_to_flagembedding(bench):
    """Each path's tokens/s over the same corpus's FlagEmbedding fp32 row, its dense cosine
    and its share in one table; without a flag row (or without ceilings) those cells are
    dashes, not invented."""
    dims = bench.roofline.Dims()
    rows = [{"ok": True, "corpus": c, "mode": m, "variant": v, "wall_s": 2.0,
             "tokens_per_s": rate, "cos_min": cos}
            for c, m, v, rate, cos in (("mixed", "flag", "fp32", 100.0, 1.0),
                                       ("mixed", "http", "int8", 450.0, 0.9993),
                                       ("long", "engine", "fp32", 80.0, None))]
    got = bench.roofline.shares(rows, {"mixed": [256] * 4, "long": [2048]}, dims,
                                {"fp32": 100.0})
    assert [r["x_flag"] for r in got] == [pytest.approx(1.0), pytest.approx(4.5), None]
    text = bench.roofline.table(got, {"fp32": 100.0, "rows": 512, "threads": 2})
    assert "| mixed | http | int8 | 450.0 | 4.50× | 0.999300 | int8-ort |" in text
    assert "| long | engine | fp32 | 80.0 | — | — | fp32 |" in text
    assert "not measured" in bench.roofline.table(bench.roofline.shares(rows, {"mixed": [256]},
                                                                         dims, {}), {})


def test_rss_of_another_process_is_read_with_the_projects_parser(bench):
    """The server's RSS (another pid) and this process's own agree on the keys, in bytes."""
    import os

    from benchkit.common import proc_status, rss_now  # on sys.path once bench.py is loaded

    by_pid = proc_status(os.getpid())
    assert {"VmRSS", "VmHWM", "RssAnon", "RssFile"} <= set(by_pid)
    assert abs(by_pid["VmRSS"] - rss_now()) < 64 << 20
    assert proc_status(2**22 + 12345) == {}  # no such process: nothing, not an error


def test_gemm_ceiling_is_the_fastest_call_not_the_mean():
    """A ceiling is what the machine can do: one call slowed by a neighbour (here 50× the
    others) must not lower it, so corpus rows never read more than 100 % of a disturbed
    ceiling."""
    spec = importlib.util.spec_from_file_location(
        "gemm_ceiling_under_test", SCRIPT.with_name("gemm_ceiling.py"))
    gemm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gemm)
    import time

    calls = []

    def run():
        calls.append(1)
        time.sleep(0.1 if len(calls) == 5 else 0.002)

    assert gemm._time(run, seconds=0.0) < 0.01
    assert len(calls) == 3 + 5


def test_a_repeated_mode_reports_its_median_round(bench):
    """--rounds: the row kept is a real round (its latencies and vectors belong to it), the
    median by throughput; failed rounds are counted and left out."""
    from benchkit.report import median_row

    rounds = [{"ok": True, "tokens_per_s": t, "vectors": f"v{t}"} for t in (300.0, 100.0, 200.0)]
    rounds.append({"ok": False, "error": "boom"})
    row = median_row(rounds)
    assert (row["tokens_per_s"], row["vectors"]) == (200.0, "v200.0")
    assert row["rounds_tokens_per_s"] == [300.0, 100.0, 200.0] and row["rounds_failed"] == 1
    assert median_row(rounds[:2])["tokens_per_s"] == 100.0  # even: the lower middle
    assert median_row([{"ok": False, "error": "x"}])["error"] == "x"


def test_serve_starts_the_server_as_a_user_does(bench, tmp_path, monkeypatch):
    """``serve`` (issue 17's default-variant figure): only the model path, the bind address and
    the cache dir set, with the embedding cache off; no variant, threads or budget pinned, so
    the server measures and chooses for itself. ``http`` pins them."""
    from benchkit import http

    started: list[dict[str, str]] = []

    class Popen:
        def __init__(self, argv, env, **kwargs):
            started.append(env)

    monkeypatch.setattr(http.subprocess, "Popen", Popen)
    monkeypatch.setenv("BGE_M3_MODEL", "fp32")  # the caller's own settings never leak in
    spec = {"work_dir": str(tmp_path), "export_dir": "/models/m3", "mode": "serve",
            "serve_cache": str(tmp_path / "serve-cache"), "variant": "default", "threads": 2,
            "http_budget": "disabled"}
    http.Server(spec, {}, "serve")
    http.Server({**spec, "mode": "http", "variant": "int8"}, {}, "http-int8")
    serve, pinned = ({k: v for k, v in env.items() if k.startswith("BGE_M3_")}
                     for env in started)
    assert set(serve) == {"BGE_M3_MODEL_PATH", "BGE_M3_BIND", "BGE_M3_CACHE_DIR",
                          "BGE_M3_CACHE_MB", "BGE_M3_LOG_FORMAT"}
    assert (serve["BGE_M3_MODEL_PATH"], serve["BGE_M3_CACHE_DIR"], serve["BGE_M3_CACHE_MB"]) \
        == ("/models/m3", str(tmp_path / "serve-cache"), "0")
    assert (pinned["BGE_M3_MODEL"], pinned["BGE_M3_DISABLE_AUTO_BUDGET"]) == ("int8", "1")


def test_a_serve_row_is_the_variant_the_server_chose(bench):
    """The row and its ratios carry the server's own choice (its /health), and the server's
    peak RSS, not the client's."""
    from benchkit.report import ratios, summarize

    corpus = {"texts": ["a"] * 4, "lengths": [100] * 4}
    res = {"ok": True, "wall_s": 2.0, "latencies": [0.1] * 4, "peak_rss_server": 7 << 20,
           "peak_rss": 1 << 20, "served": {"variant": "int8", "choice": "measured"}}
    row = summarize("mixed-serve-default", "serve", "default", "mixed", corpus, res)
    assert (row["variant"], row["peak_rss"], row["served"]["choice"]) == \
        ("int8", 7 << 20, "measured")
    flag = {"ok": True, "corpus": "mixed", "mode": "flag", "variant": "fp32",
            "tokens_per_s": 50.0}
    http = {"ok": True, "corpus": "mixed", "mode": "http", "variant": "int8",
            "tokens_per_s": 190.0}
    got = ratios([flag, http, row])
    assert got["mixed: serve (the server's own choice, int8) / flag fp32"] == pytest.approx(4.0)
    assert got["mixed: serve (int8) / http int8 (pinned, fixed budget)"] == \
        pytest.approx(200 / 190)
    line = bench.served_line({**row, "rounds_load_s": [120.0, 6.0],
                              "rounds_serving_s": [70.0, 5.0]})
    assert "the server chose **int8** (measured" in line
    assert "answering after 70 / 5 s, its start-up measurements done after 120 / 6 s" in line


@pytest.mark.parametrize("runtime, budget", [("onnxruntime", 256), ("openvino", 1024)])
def test_raw_packs_at_the_budget_the_engine_gives_its_runtime(bench, tmp_path, runtime, budget):
    """raw is the engine's work without the server: the same packing budget per runtime."""
    from benchkit.raw import engine_chunk_tokens

    entry = {"path": "v/model"} | ({"runtime": "openvino"} if runtime == "openvino" else {})
    (tmp_path / "manifest.json").write_text(json.dumps({"variants": {"v": entry}}))
    assert engine_chunk_tokens(tmp_path, "v") == budget


def test_ratios_of_rows_run_in_rounds_are_medians_of_per_round_ratios(bench):
    """Round i of one row ran beside round i of the other: each ratio is the median of the
    per-round ratios, not the ratio of the two rows' medians (which may come from different
    rounds); a row with a failed round falls back to the medians' ratio."""
    from benchkit.report import ratios

    def row(mode, rates, failed=0):
        return {"ok": True, "corpus": "mixed", "mode": mode, "variant": "int8",
                "tokens_per_s": sorted(rates)[(len(rates) - 1) // 2],
                "rounds_tokens_per_s": rates, "rounds_failed": failed}

    raw, engine = row("raw", [100.0, 200.0, 150.0]), row("engine", [110.0, 180.0, 150.0])
    per_round: dict[str, list[float]] = {}
    got = ratios([raw, engine], per_round=per_round)
    label = "mixed: engine int8 / raw int8 (same packing)"
    assert per_round[label] == pytest.approx([1.1, 0.9, 1.0])
    assert got[label] == pytest.approx(1.0)  # the medians' ratio would be 150 / 150 too
    engine = row("engine", [120.0, 400.0, 140.0])  # per round 1.2, 2.0, 0.933
    assert ratios([raw, engine])[label] == pytest.approx(1.2)  # not the medians' 140 / 150
    failed = ratios([raw, row("engine", [300.0, 100.0], failed=1)], per_round=(pr := {}))
    assert failed[label] == pytest.approx(100 / 150) and label not in pr
