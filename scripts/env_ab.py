#!/usr/bin/env python3
"""Two ``bgeserve serve`` processes that differ in one environment variable, side by side.

    python scripts/env_ab.py --model-path EXPORT_DIR --env MALLOC_ARENA_MAX=16 --rounds 20

Both servers load the same model (embedding cache off); rounds of ``--seconds`` seconds with
``--clients`` concurrent clients, one text per request (12-400 words), go to one then the
other, the order flipped every round (A B, B A, ...), so the machine's drift falls on both.
Prints requests/s per round and RSS after it, each server's median, and the median of the
paired ratios B/A (what docs/reliability.md §9 reports for glibc's malloc arenas).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "scripts") not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(REPO / "scripts"))

from soak_server import KEY, SoakServer  # scripts/ is on the path: run as a script

WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed",
         "do", "eiusmod", "tempor", "incididunt", "ut", "labore", "混合", "检索", "données", "été"]


def corpus(n: int = 256, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 400))) for _ in range(n)]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


async def one_round(url: str, texts: list[str], clients: int, seconds: float) -> float:
    """Requests per second of ``clients`` closed-loop clients for ``seconds``."""
    done = 0
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http:
        async def client(i: int) -> None:
            nonlocal done
            while time.monotonic() < stop:
                body = {"input": texts[i % len(texts)], "model": "bge-m3"}
                async with http.post(url + "/v1/embeddings", json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
                    await r.read()
                done += 1
                i += clients

        started = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(clients)))
        return done / (time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True, help="a bgeserve export or snapshot")
    ap.add_argument("--env", required=True, metavar="KEY=VALUE",
                    help="what server B has in its environment and server A has not")
    ap.add_argument("--both", action="append", default=[], metavar="KEY=VALUE",
                    help="environment both servers have (repeatable), e.g. BGE_M3_MODEL=int8")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None, help="logs and result.json (default: a "
                    "temporary folder)")
    args = ap.parse_args(argv)
    for item in (args.env, *args.both):
        if "=" not in item:
            ap.error(f"{item!r}: KEY=VALUE expected")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    key, _, value = args.env.partition("=")
    out = args.out or Path(tempfile.mkdtemp(prefix="env-ab-"))
    out.mkdir(parents=True, exist_ok=True)
    common = {"BGE_M3_MODEL_PATH": args.model_path, "BGE_M3_CACHE_MB": "0",
              "BGE_M3_MAX_SEQ_LENGTH": "1024", "BGE_M3_LOG_LEVEL": "warning",
              **dict(item.partition("=")[::2] for item in args.both)}
    servers = {"A": SoakServer(dict(common), out / "a.log"),
               "B": SoakServer({**common, key: value}, out / "b.log")}
    servers["A"].env.pop(key, None)  # not even from this shell's environment
    texts = corpus()
    rates: dict[str, list[float]] = {"A": [], "B": []}
    rss: dict[str, list[float]] = {"A": [], "B": []}
    try:
        for server in servers.values():
            server.start()
        for n in range(args.rounds):
            for name in ("A", "B") if n % 2 == 0 else ("B", "A"):
                rate = asyncio.run(one_round(servers[name].url, texts, args.clients,
                                             args.seconds))
                rates[name].append(rate)
                rss[name].append(rss_mib(servers[name].pid))
                print(f"round {n} {name}: {rate:.3g} requests/s, RSS {rss[name][-1]:.0f} MiB",
                      flush=True)
    finally:
        for server in servers.values():
            server.stop()
    paired = [b / a for a, b in zip(rates["A"], rates["B"])]
    print(f"A (without {args.env}): median {statistics.median(rates['A']):.3g} requests/s; "
          f"B (with it): median {statistics.median(rates['B']):.3g}")
    print(f"B/A paired: median {statistics.median(paired):.3f}, min {min(paired):.3f}, "
          f"max {max(paired):.3f} over {len(paired)} rounds")
    (out / "result.json").write_text(json.dumps({"rates": rates, "rss_mib": rss,
                                                 "paired": paired}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
