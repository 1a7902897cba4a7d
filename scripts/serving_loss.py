#!/usr/bin/env python3
"""Where bgeserve loses against its runtime: raw vs engine vs HTTP, in interleaved rounds.

Each measurement runs in its own process; a round runs every measurement once, in an order that
rotates from round to round, and the report gives per-round ratios and their medians (ratios
taken within a round, so a machine that drifts between rounds does not bias them).

Measurements (per variant):

- ``raw``: the runtime called directly, as ``scripts/bench.py``'s ``raw`` mode calls it: the
  tokenizer, ``binpack.plan`` with the scheduler's rules at the runtime's chunk tokens (as the
  engine packs), ``pad_chunk`` and one ``session.run`` (ONNX Runtime, bgeserve's session
  options) or ``infer`` (OpenVINO, bgeserve's compile options) per chunk; timed from
  tokenizing to the last run.
- ``engine``: ``bgeserve.Engine`` configured as bench.py's ``engine`` mode (the runtime's chunk
  tokens), one ``embed(texts, dense, sparse)``.
- ``httpN``: ``python -m bgeserve serve`` (as bench.py starts it) and N aiohttp clients, one
  text per request to ``/v1/embeddings:both`` (base64); first request to last answer.
- ``--query``: one 16-token query at a time, ``--query-n`` distinct ones: ``qraw`` tokenizes
  and runs each on the raw runtime, ``qhttp`` POSTs each to ``/v1/embeddings`` (one client);
  p50 / p99 latency.
- ``--probe``: servers run as users start them, the probe on (the packer then pads by the run
  cost it measures, ``tuning.runcost``); before the rounds one server per checkout and variant
  probes into a cache dir kept for the rounds (each later server starts on that cache, and
  every server is loaded only once its probe is done), and ``raw`` and ``engine`` pack with
  the run cost that probe measured (a checkout without it packs as it always did).
- ``--warm-pass``: each measurement runs the corpus once, untimed, before the timed pass (what
  a long-running server has: a runtime that compiles kernels per shape has seen these).
- ``--repeat F``: the corpus gets ``F`` of its rows as repeats of earlier rows (shuffled in),
  and ``engine`` / ``httpN`` run with the embedding cache off and on (``-cache`` rows); dense
  vectors of the two are compared.

Each row reports tokens/s (real tokens, the corpus's own count), and for engine / HTTP the
share of the wall time spent inside the runtime's runs. ``--profile DIR`` records each engine /
server process with py-spy (``--threads``, raw collapsed stacks) for the loss analysis.

    python scripts/serving_loss.py --export-dir EXPORT --variants int8,bf16,fp32 --rounds 3
    python scripts/serving_loss.py --export-dir EXPORT --variants fp32 --repeat 0.3 --modes \\
        engine,http16 --rounds 3
    python scripts/serving_loss.py --export-dir EXPORT --variants int8 --query --modes none
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
MAX_SEQ = 8192
QUERY_TOKENS = 16


# ------------------------------------------------------------------------------ corpus
def corpus(export_dir: Path, work: Path, texts: int, repeat: float) -> dict[str, Any]:
    """bench.py's mixed corpus of ``texts`` rows, plus ``repeat`` of them again as repeats of
    earlier rows, shuffled in (a repeat always comes after its first occurrence)."""
    sys.path.insert(0, str(HERE))
    try:  # bench.py's exact-length corpus, cached in the work dir
        from benchkit.corpus import corpus_file
    except ImportError:  # a checkout from before bench.py was split into benchkit/
        from bench import corpus_file

    base = json.loads(corpus_file(work, export_dir / "tokenizer.json", "mixed", texts)
                      .read_text())
    rows = list(zip(base["texts"], base["lengths"], strict=True))
    rng = random.Random(17)
    out = list(rows)
    for _ in range(round(repeat * len(rows) / max(1e-9, 1 - repeat)) if repeat else 0):
        at = rng.randrange(1, len(out) + 1)
        out.insert(at, rng.choice(out[:at]))
    return {"texts": [t for t, _ in out], "lengths": [n for _, n in out],
            "unique": len({t for t, _ in out})}


def query_texts(export_dir: Path, n: int) -> list[str]:
    """``n`` distinct texts of exactly QUERY_TOKENS tokens (special tokens included)."""
    import tokenizers

    from bgeserve.export.texts import random_texts

    tk = tokenizers.Tokenizer.from_file(str(export_dir / "tokenizer.json"))
    tk.no_truncation()
    tk.no_padding()
    out: list[str] = []
    seed = 0
    while len(out) < n:
        seed += 1
        text = " ".join(random_texts(50_000 + seed, 1, 10, 30))
        enc = tk.encode(text, add_special_tokens=False)
        if len(enc.ids) < QUERY_TOKENS:
            continue
        cut = text[: enc.offsets[QUERY_TOKENS - 3][1]].rstrip()
        if len(tk.encode(cut).ids) == QUERY_TOKENS and cut not in out:
            out.append(cut)
    return out


# ------------------------------------------------------------------------------ children
def _open_raw(export_dir: Path, variant: str, threads: int):
    """``run(ids, mask) -> [dense, sparse_weights]`` on the runtime, configured as bgeserve
    configures it: bench.py's raw mode's own opener (``benchkit.raw``)."""
    from benchkit.raw import (
        _export_graph,
        _open_openvino,
        _open_ort,
        _session_options,
        variant_runtime,
    )

    graph = _export_graph(export_dir, variant)
    if variant_runtime(export_dir, variant) == "openvino":
        return _open_openvino(graph, variant, threads)
    return _open_ort(graph, *_session_options(threads))


def child_raw(spec: dict[str, Any]) -> dict[str, Any]:
    from benchkit.raw import engine_chunk_tokens

    from bgeserve.engine.binpack import plan
    from bgeserve.engine.forward import pad_chunk
    from bgeserve.engine.scheduler import SchedulerConfig
    from bgeserve.engine.tokenizer import Tokenizer

    export_dir = Path(spec["export_dir"])
    run = _open_raw(export_dir, spec["variant"], spec["threads"])
    tokenizer = Tokenizer.load(export_dir / "tokenizer.json", MAX_SEQ)
    if spec.get("queries"):
        return _raw_queries(run, tokenizer, spec["queries"])
    texts = spec["texts"]
    ids0 = tokenizer.encode(["warm up"]).ids
    run(*pad_chunk(ids0, len(ids0[0])))
    cfg = SchedulerConfig()
    # Packed as a session that has run every count would be (no ``known``): the engine and the
    # server price new counts too, so on a fresh process their chunks may differ from these.
    kwargs = {"run_cost": _run_cost(spec)} if spec.get("run_cost") else {}

    def corpus_pass():
        started = time.perf_counter()
        ids = tokenizer.encode(texts).ids
        dense = np.zeros((len(texts), 0), np.float32)
        inside, chunks = 0.0, 0
        for chunk in plan([len(x) for x in ids], fits=lambda b, s: True,
                          max_chunk=cfg.max_chunk,
                          max_tokens=engine_chunk_tokens(export_dir, spec["variant"]),
                          min_fill=cfg.min_fill, **kwargs):
            feeds = pad_chunk([ids[i] for i in chunk.indices], chunk.pad_to)
            t = time.perf_counter()
            d, _ = run(*feeds)
            inside += time.perf_counter() - t
            chunks += 1
            if dense.shape[1] == 0:
                dense = np.zeros((len(texts), d.shape[1]), np.float32)
            dense[list(chunk.indices)] = d
        return time.perf_counter() - started, inside, chunks, dense

    if spec.get("warm_pass"):
        corpus_pass()
    wall, inside, chunks, dense = corpus_pass()
    return {"wall_s": wall, "inside_s": inside, "chunks": chunks, "dense": dense}


def _run_cost(spec: dict[str, Any]):
    from bgeserve.tuning.runcost import RunCost

    return RunCost.from_json(spec["run_cost"])


def _raw_queries(run, tokenizer, queries: list[str]) -> dict[str, Any]:
    from bgeserve.engine.forward import pad_chunk

    for q in queries[:3]:  # warm-up: the shape's first runs
        ids = tokenizer.encode([q]).ids
        run(*pad_chunk(ids, len(ids[0])))
    latencies = []
    for q in queries:
        t = time.perf_counter()
        ids = tokenizer.encode([q]).ids
        run(*pad_chunk(ids, len(ids[0])))
        latencies.append(time.perf_counter() - t)
    return {"latencies": latencies}


def _engine(spec: dict[str, Any], on_chunk):
    from bgeserve import Engine, runtime
    from bgeserve.engine import EngineConfig
    from bgeserve.engine.scheduler import SchedulerConfig
    from bgeserve.model.artifacts import resolve
    from bgeserve.runtime import SessionConfig

    session = SessionConfig(threads=spec["threads"], streams=1)
    artifacts = resolve(model_path=Path(spec["export_dir"]), variant=spec["variant"],
                        cache_dir=Path(spec["work_dir"]) / "cache", offline=True)
    scheduler = SchedulerConfig(workers=1, max_chunk_tokens=runtime.get(
        runtime.kind_of(artifacts, session.provider)).chunk_tokens)
    kwargs: dict[str, Any] = {}
    if "cache_bytes" in EngineConfig.__dataclass_fields__:  # a checkout without the cache
        kwargs["cache_bytes"] = (spec["cache_mb"] or 0) << 20
    return Engine(artifacts=artifacts, on_chunk=on_chunk, config=EngineConfig(
        max_seq=MAX_SEQ, session=session, scheduler=scheduler, **kwargs))


def child_engine(spec: dict[str, Any]) -> dict[str, Any]:
    inside, chunks, padding = [0.0], [0], [0]

    def on_chunk(stats) -> None:
        inside[0] += stats.seconds
        chunks[0] += 1
        padding[0] += stats.batch * stats.pad_to - stats.real_tokens

    engine = _engine(spec, on_chunk)
    if spec.get("run_cost") and hasattr(engine, "set_run_cost"):
        engine.set_run_cost(_run_cost(spec))
    try:
        engine.embed(spec["texts"] if spec.get("warm_pass") else ["warm up"], dense=True,
                     sparse=True)
        inside[0], chunks[0], padding[0] = 0.0, 0, 0
        started = time.perf_counter()
        out = engine.embed(spec["texts"], dense=True, sparse=True)
        wall = time.perf_counter() - started
    finally:
        engine.close()
    return {"wall_s": wall, "inside_s": inside[0], "chunks": chunks[0], "padding": padding[0],
            "dense": out.dense}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_server(spec: dict[str, Any]) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BGE_M3_")}
    env.update({
        "BGE_M3_MODEL_PATH": spec["export_dir"], "BGE_M3_MODEL": spec["variant"],
        "BGE_M3_INTRA_THREADS": str(spec["threads"]), "BGE_M3_WORKERS": "1",
        "BGE_M3_CACHE_DIR": spec.get("cache_dir") or str(Path(spec["work_dir"]) / "cache"),
        "BGE_M3_BIND": f"127.0.0.1:{port}", "BGE_M3_IDLE_TIMEOUT_SECS": "0",
        "BGE_M3_HEARTBEAT_SECS": "0", "BGE_M3_LOG_FORMAT": "json", "HF_HUB_OFFLINE": "1",
        "BGE_M3_DISABLE_AUTO_BUDGET": "1", "BGE_M3_MAX_SEQ_LENGTH": "512",
        "BGE_M3_CACHE_MB": str(spec["cache_mb"] or 0),
        "OMP_NUM_THREADS": str(spec["threads"]), "PYTHONPATH": spec["repo"],
    })
    if spec.get("probe"):
        del env["BGE_M3_DISABLE_AUTO_BUDGET"]
    env.update(spec.get("env") or {})
    log = open(Path(spec["out"]).with_suffix(".server.log"), "wb")  # noqa: SIM115 - the child's
    proc = subprocess.Popen([sys.executable, "-m", "bgeserve", "serve"], env=env,
                            cwd=spec["repo"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            r = httpx.get(base + "/health", timeout=5)
            # With the probe on, load only once it is done (it would share the CPU otherwise).
            if r.status_code == 200 and (not spec.get("probe")
                                         or r.json()["tuning"]["probe_status"] != "running"):
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("server not ready")
        time.sleep(0.25)


def _inference_runs(base: str) -> tuple[float, int, int]:
    """Seconds inside the runtime's runs, how many runs (chunks) and padding tokens, from the
    server's /metrics."""
    import httpx

    seconds, runs, padding = 0.0, 0, 0
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("bgeserve_inference_duration_seconds_sum"):
            seconds = float(line.split()[-1])
        elif line.startswith("bgeserve_inference_duration_seconds_count"):
            runs = int(float(line.split()[-1]))
        elif line.startswith("bgeserve_padding_tokens_total"):
            padding = int(float(line.split()[-1]))
    return seconds, runs, padding


async def _post_all(base: str, route: str, bodies: list[bytes], clients: int):
    import aiohttp

    results: list[Any] = [None] * len(bodies)
    latencies: list[float] = []
    cursor = iter(range(len(bodies)))
    connector = aiohttp.TCPConnector(limit=clients + 2)
    async with aiohttp.ClientSession(base, connector=connector,
                                     headers={"content-type": "application/json"}) as client:

        async def worker() -> None:
            for i in cursor:
                t = time.perf_counter()
                async with client.post(route, data=bodies[i]) as r:
                    body = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{r.status}: {body[:300]!r}")
                latencies.append(time.perf_counter() - t)
                results[i] = json.loads(body)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - started
    return wall, latencies, results


def _body(texts: list[str], fmt: str = "base64") -> bytes:
    return json.dumps({"model": "bge-m3", "input": texts, "encoding_format": fmt},
                      ensure_ascii=False).encode()


def child_http(spec: dict[str, Any]) -> dict[str, Any]:
    proc, base = _start_server(spec)
    spy = _spy(spec, proc.pid)
    try:
        if spec.get("queries"):
            qs = spec["queries"]
            asyncio.run(_post_all(base, "/v1/embeddings", [_body([q]) for q in qs[:3]], 1))
            _, latencies, _ = asyncio.run(_post_all(
                base, "/v1/embeddings", [_body([q]) for q in qs], 1))
            return {"latencies": latencies}
        asyncio.run(_post_all(base, "/v1/embeddings:both", [_body(["warm up"])], 1))
        if spec.get("warm_pass"):  # the corpus once, as timed: a server that has seen it
            asyncio.run(_post_all(base, "/v1/embeddings:both",
                                  [_body([t]) for t in spec["texts"]], spec["clients"]))
        before = _inference_runs(base)
        wall, _, results = asyncio.run(_post_all(
            base, "/v1/embeddings:both", [_body([t]) for t in spec["texts"]], spec["clients"]))
        after = _inference_runs(base)
        inside, chunks, padding = (a - b for a, b in zip(after, before))
    finally:
        _stop_spy(spy)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    dense = np.stack([np.frombuffer(base64.b64decode(r["data"][0]["embedding"]), "<f4")
                      for r in results])
    return {"wall_s": wall, "inside_s": inside, "chunks": chunks, "padding": padding,
            "dense": dense}


def _spy(spec: dict[str, Any], pid: int) -> subprocess.Popen | None:
    if not spec.get("profile"):
        return None
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--threads", "--format", "raw",
                             "--rate", "200", "--output", spec["profile"], "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_spy(spy: subprocess.Popen | None) -> None:
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        try:
            spy.wait(60)
        except subprocess.TimeoutExpired:
            spy.kill()


def child_prime(spec: dict[str, Any]) -> dict[str, Any]:
    """One server with the probe on, until its probe is done: the cache later servers start
    on, and the run cost it measured (None: a checkout that does not measure one)."""
    import httpx

    started = time.perf_counter()
    proc, base = _start_server(spec)
    try:
        health = httpx.get(base + "/health", timeout=10).json()["tuning"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    cached = Path(spec["cache_dir"]) / "probe-coefficients.json"  # none: the probe was off
    record = json.loads(cached.read_text()) if cached.exists() else {}
    return {"probe_status": health.get("probe_status"), "seconds": time.perf_counter() - started,
            "run_cost": record.get("run_cost"), "chunk_tokens": health.get("chunk_tokens")}


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    mode = spec["mode"]
    if mode == "engine" and spec.get("profile"):
        spy = _spy(spec, os.getpid())
        time.sleep(1.0)
        try:
            res = child_engine(spec)
        finally:
            _stop_spy(spy)
    else:
        res = {"raw": child_raw, "engine": child_engine, "http": child_http,
               "prime": child_prime}[mode](spec)
    dense = res.pop("dense", None)
    if dense is not None:
        np.save(Path(spec["out"]).with_suffix(".npy"), dense)
    Path(spec["out"]).write_text(json.dumps(res))
    return 0


# ------------------------------------------------------------------------------ parent
def measure(args: argparse.Namespace, work: Path, name: str, spec: dict[str, Any]) -> dict:
    spec = {"export_dir": str(args.export_dir), "work_dir": str(work), "repo": str(args.repo),
            "threads": args.threads, "out": str(work / f"{name}.json"), **spec}
    repo = spec["repo"]
    if args.profile and spec["mode"] in ("engine", "http"):
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        spec["profile"] = str(Path(args.profile) / f"{name}.txt")
    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec, ensure_ascii=False))
    env = {**os.environ, "PYTHONPATH": repo, "OMP_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "true"}
    t = time.perf_counter()
    rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_child",
                         str(spec_path)], env=env, cwd=repo, check=False).returncode
    if rc != 0:
        raise SystemExit(f"{name} failed (exit {rc})")
    res = json.loads(Path(spec["out"]).read_text())
    print(f"  {name}: {time.perf_counter() - t:.0f} s"
          + (f", {res['wall_s']:.2f} s timed" if "wall_s" in res else ""), flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        return child_main(argv[1])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export-dir", type=Path, required=True)
    p.add_argument("--variants", default="int8,bf16,fp32")
    p.add_argument("--modes", default="raw,engine,http4,http16",
                   help="raw, engine, httpN (N clients); 'none' for --query alone")
    p.add_argument("--texts", type=int, default=24, help="rows of bench.py's mixed corpus")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=float, default=0.0,
                   help="share of repeated rows; engine/http run with the cache off and on")
    p.add_argument("--cache-mb", type=int, default=128, help="the cache size of the -cache rows")
    p.add_argument("--query", action="store_true", help="16-token query latency, raw vs HTTP")
    p.add_argument("--query-n", type=int, default=60)
    p.add_argument("--repo", type=Path, default=REPO, help="checkout whose bgeserve runs")
    p.add_argument("--repo-b", type=Path, default=None,
                   help="a second checkout: every engine / http / query row also runs on it "
                        "('@b' rows), interleaved, with the ratio b / a")
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--warm-pass", action="store_true",
                   help="every measurement runs the corpus once untimed first (a runtime that "
                        "has seen its shapes: a long-running server)")
    p.add_argument("--probe", action="store_true",
                   help="servers probe (primed once per checkout); raw and engine pack with the "
                        "run cost it measured")
    p.add_argument("--share-probe", action="store_true",
                   help="with --probe: the first checkout's probe serves every checkout (one run "
                        "cost on both sides of an A/B; they must share PROBE_SCHEMA, else the "
                        "other probes again in the background)")
    p.add_argument("--profile", metavar="DIR", help="py-spy raw stacks of engine/server runs")
    args = p.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="serving-loss-"))
    work.mkdir(parents=True, exist_ok=True)
    modes = [] if args.modes == "none" else args.modes.split(",")
    data = corpus(args.export_dir, work, args.texts, args.repeat)
    tokens = sum(data["lengths"])
    queries = query_texts(args.export_dir, args.query_n) if args.query else []
    print(f"corpus: {len(data['texts'])} texts ({data['unique']} distinct), {tokens} tokens; "
          f"work dir {work}", flush=True)
    plan: list[tuple[str, str, dict[str, Any]]] = []
    for v in args.variants.split(","):
        for m in modes:
            cache_states = [0, args.cache_mb] if args.repeat and m != "raw" else [0]
            for cache_mb in cache_states:
                label = f"{v}-{m}" + ("-cache" if cache_mb else "")
                spec: dict[str, Any] = {"variant": v, "texts": data["texts"],
                                        "cache_mb": cache_mb}
                if m.startswith("http"):
                    spec.update(mode="http", clients=int(m[4:]))
                else:
                    spec["mode"] = m
                plan.append((label, v, spec))
        if args.query:
            plan.append((f"{v}-qraw", v, {"mode": "raw", "variant": v, "queries": queries}))
            plan.append((f"{v}-qhttp", v, {"mode": "http", "variant": v, "queries": queries,
                                           "cache_mb": 0, "clients": 1}))
    if args.repo_b:
        plan += [(f"{label}@b", v, {**spec, "repo": str(args.repo_b)})
                 for label, v, spec in plan if spec["mode"] != "raw"]
    if args.probe:
        prime(args, work, plan)
    for _, _, spec in plan:
        spec["warm_pass"] = args.warm_pass
    rows: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in plan}
    for r in range(args.rounds):
        order = plan[r % len(plan):] + plan[: r % len(plan)]
        if r % 2:
            order.reverse()
        print(f"round {r + 1}/{args.rounds}", flush=True)
        for label, _, spec in order:
            res = measure(args, work, f"{label}-r{r}", spec)
            if "wall_s" in res:
                res["tokens_per_s"] = tokens / res["wall_s"]
            rows[label].append(res)
    report(rows, plan, args, data, work)
    return 0


def prime(args: argparse.Namespace, work: Path, plan) -> None:
    """``--probe``: one probing server per checkout and variant, before the rounds; every
    measurement of that checkout and variant then starts on its cache (``cache_dir``) and
    packs with its run cost (raw: the working tree's measured cost)."""
    costs: dict[tuple[str, str], Any] = {}
    repos = list(dict.fromkeys(spec.get("repo", str(args.repo)) for _, _, spec in plan))
    for repo in repos[:1] if args.share_probe else repos:
        for v in args.variants.split(","):
            cache_dir = work / f"probe-cache-{v}-{len(costs)}"
            res = measure(args, work, f"{v}-prime-{len(costs)}", {
                "mode": "prime", "variant": v, "repo": repo, "probe": True, "cache_mb": 0,
                "cache_dir": str(cache_dir)})
            costs[repo, v] = (str(cache_dir), res["run_cost"])
            print(f"  probe {v} @ {repo}: {res['probe_status']} in {res['seconds']:.0f} s, "
                  f"run cost {res['run_cost']}, chunk tokens {res['chunk_tokens']}", flush=True)
    for repo in repos[1:] if args.share_probe else ():
        for v in args.variants.split(","):
            costs[repo, v] = costs[repos[0], v]
    for _, v, spec in plan:
        cache_dir, run_cost = costs[spec.get("repo", str(args.repo)), v]
        if spec["mode"] == "raw":
            run_cost = costs[str(args.repo), v][1]
        spec.update(probe=True, cache_dir=cache_dir, run_cost=run_cost)


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(rows: dict[str, list[dict]], plan, args, data, work: Path) -> None:
    print(f"\n{len(data['texts'])} texts, {sum(data['lengths'])} tokens, {args.rounds} rounds, "
          f"{args.threads} threads\n")
    print("| run | tokens/s per round | median | inside the runtime (median share) | chunks "
          "per round | padding tokens per round |")
    print("|---|---|---|---|---|---|")
    for label, _, _ in plan:
        rs = rows[label]
        if rs and "tokens_per_s" in rs[0]:
            inside = [r["inside_s"] / r["wall_s"] for r in rs if r.get("inside_s")]
            rates = " / ".join(f"{r['tokens_per_s']:.1f}" for r in rs)
            print(f"| {label} | {rates} | "
                  f"{_med([r['tokens_per_s'] for r in rs]):.1f} | "
                  + (f"{_med(inside):.1%}" if inside else "—") + " | "
                  + (" / ".join(str(r.get("chunks", "—")) for r in rs)) + " | "
                  + (" / ".join(str(r.get("padding", "—")) for r in rs)) + " |")
    print()
    variants = args.variants.split(",")
    for v in variants:
        def ratio(a: str, b: str, v: str = v) -> None:
            _ratio(rows, v, a, b)

        ratio("engine", "raw")
        for m in args.modes.split(","):
            if m.startswith("http"):
                ratio(m, "engine")
                if args.repeat:
                    ratio(f"{m}-cache", m)
        if args.repeat:
            ratio("engine-cache", "engine")
            for m in args.modes.split(","):
                if m != "raw":
                    _compare(work, f"{v}-{m}", f"{v}-{m}-cache", args.rounds)
        if args.repo_b:
            for m in [*args.modes.split(","), *(f"{m}-cache" for m in args.modes.split(","))]:
                if m != "raw" and rows.get(f"{v}-{m}@b"):
                    ratio(f"{m}@b", m)
        if args.query and rows.get(f"{v}-qraw"):
            for http in ("qhttp", "qhttp@b"):
                if rows.get(f"{v}-{http}"):
                    _query_line(v, rows[f"{v}-qraw"], rows[f"{v}-{http}"], http)


def _ratio(rows: dict[str, list[dict]], v: str, a: str, b: str) -> None:
    """The per-round ratio of tokens/s of rows ``a`` and ``b``, and its median."""
    ra, rb = rows.get(f"{v}-{a}"), rows.get(f"{v}-{b}")
    if not ra or not rb or "tokens_per_s" not in ra[0]:
        return
    per = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(ra, rb, strict=True)]
    print(f"- {v}: {a} / {b}: median **{_med(per):.3f}×** (rounds "
          + ", ".join(f"{x:.3f}" for x in per) + ")")


def _query_line(v: str, raw: list[dict], http: list[dict], label: str) -> None:
    qr = [np.percentile(r["latencies"], [50, 99]) * 1000 for r in raw]
    qh = [np.percentile(r["latencies"], [50, 99]) * 1000 for r in http]
    print(f"- {v}: 16-token query, p50 / p99 ms per round: raw "
          + ", ".join(f"{a:.1f} / {b:.1f}" for a, b in qr) + f"; {label} "
          + ", ".join(f"{a:.1f} / {b:.1f}" for a, b in qh)
          + f"; median p50 {label} − raw **{_med([h[0] - r[0] for h, r in zip(qh, qr)]):.2f}"
          " ms**")


def _compare(work: Path, off: str, on: str, rounds: int) -> None:
    """Dense vectors with the cache off vs on (round 0): cosine min and max |difference|."""
    a, b = work / f"{off}-r0.npy", work / f"{on}-r0.npy"
    if not (a.exists() and b.exists()):
        return
    x, y = np.load(a), np.load(b)
    cos = (x * y).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)
    print(f"  - {on} vs {off}: dense cos min {cos.min():.7f}, max |Δ| "
          f"{np.abs(x - y).max():.2e}, identical rows {int((x == y).all(1).sum())}/{len(x)}")


if __name__ == "__main__":
    sys.exit(main())
