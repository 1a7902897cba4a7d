"""Large answers under a memory cap: a burst of requests whose answers are big, against a server
in a cgroup v1 memory limit, for code trees side by side. Did it survive, what did it peak at?

For each ``--tree`` in turn (``PYTHONPATH`` = that tree: ``git worktree add /tmp/before <commit>``)
it starts ``bgeserve serve`` on ``--export-dir`` inside a fresh cgroup of ``--limit-mib``, waits
for ``/health``, sends ``--clients`` copies of the ``--scenario`` request at once, and prints the
answers' statuses, the cgroup's peak (``memory.max_usage_in_bytes``) and whether the OOM killer
struck. Scenarios (random vocabulary words, so sparse answers are wide):

- ``embed_sparse``: TEI ``/embed_sparse``, ``--texts`` texts of 3,000 distinct words;
- ``sparse_dict``: ``/v1/sparse-embeddings`` with ``sparse_format: dict``, the same texts;
- ``tokenize``: TEI ``/tokenize``, 4 texts of 32,000 one-letter words (262,136 tokens, 16 MB
  of JSON); with ``--slow-readers`` each client reads its answer only after 20 s.

    sudo python scripts/answer_burst.py --export-dir /tmp/tinyx --limit-mib 400 --variant bf16 \\
        --scenario tokenize --clients 12 --slow-readers --tree before=/tmp/before --tree after=.

Needs root and a cgroup v1 memory controller at /sys/fs/cgroup/memory (as on the dev VMs).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

CGROUPS = Path("/sys/fs/cgroup/memory")


def vocabulary_words(export_dir: Path) -> list[str]:
    vocab = json.loads((export_dir / "tokenizer.json").read_text())["model"]["vocab"]
    return [w[1:] for w, _ in vocab if w.startswith("▁") and len(w) > 1 and w[1:].isalpha()]


def request(scenario: str, texts: int, words: list[str]) -> tuple[str, bytes]:
    rng = random.Random(1)

    def distinct(n: int) -> str:
        return " ".join(rng.sample(words, min(n, len(words))))

    if scenario == "embed_sparse":
        body: dict = {"inputs": [distinct(3000) for _ in range(texts)]}
        return "/embed_sparse", json.dumps(body).encode()
    if scenario == "sparse_dict":
        body = {"input": [distinct(3000) for _ in range(texts)], "sparse_format": "dict"}
        return "/v1/sparse-embeddings", json.dumps(body).encode()
    if scenario == "tokenize":
        return "/tokenize", json.dumps({"inputs": [("a " * 32000).strip()] * 4}).encode()
    raise SystemExit(f"unknown scenario {scenario}")


async def burst(url: str, path: str, body: bytes, clients: int, slow: bool) -> list[str]:
    async def one(session: aiohttp.ClientSession) -> str:
        try:
            async with session.post(url + path, data=body,
                                    headers={"Content-Type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=600)) as r:
                if slow:
                    await asyncio.sleep(20)
                await r.read()
                return str(r.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return type(exc).__name__

    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(one(session) for _ in range(clients)))


def run_tree(label: str, tree: str, args: argparse.Namespace, path: str, body: bytes) -> None:
    group = CGROUPS / f"answer-burst-{os.getpid()}-{label}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(args.limit_mib << 20))
    env = {**os.environ, "PYTHONPATH": tree, "BGE_M3_MODEL_PATH": str(args.export_dir),
           "BGE_M3_BIND": f"127.0.0.1:{args.port}",
           "BGE_M3_CACHE_DIR": f"{args.cache_dir}/{label}",
           **({"BGE_M3_MODEL": args.variant} if args.variant else {}),
           **dict(item.split("=", 1) for item in args.env)}
    log = open(f"{args.cache_dir}/{label}.log", "w")  # noqa: SIM115 (the server's lifetime)
    server = subprocess.Popen(
        ["sh", "-c", f"echo $$ > {group}/tasks; exec {sys.executable} -m bgeserve serve"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(300):
            if server.poll() is not None:
                print(f"{label}: the server exited {server.returncode} before it was ready "
                      f"(its log: {args.cache_dir}/{label}.log)", flush=True)
                return
            try:
                if asyncio.run(_get(url + "/health")) == 200:
                    break
            except (aiohttp.ClientError, TimeoutError):
                pass
            time.sleep(1)
        else:
            print(f"{label}: the server was not ready in 300 s", flush=True)
            return
        started = time.monotonic()
        statuses = asyncio.run(burst(url, path, body, args.clients, args.slow_readers))
        seconds = time.monotonic() - started
        peak = int((group / "memory.max_usage_in_bytes").read_text()) >> 20
        oom = (group / "memory.oom_control").read_text().split()[-1]
        alive = server.poll() is None
        print(f"{label}: {dict(collections.Counter(statuses))} in {seconds:.1f}s, cgroup peak "
              f"{peak} MiB of {args.limit_mib}, oom_kill {oom}, server "
              f"{'alive' if alive else 'dead (rc ' + str(server.returncode) + ')'}", flush=True)
    finally:
        server.terminate()
        server.wait()
        log.close()
        for _ in range(30):  # the server's children may outlive it a moment
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(1)


async def _get(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(
            url, timeout=aiohttp.ClientTimeout(total=3)) as r:
        return r.status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export-dir", type=Path, required=True)
    parser.add_argument("--limit-mib", type=int, default=400)
    parser.add_argument("--scenario", choices=("embed_sparse", "sparse_dict", "tokenize"),
                        required=True)
    parser.add_argument("--texts", type=int, default=2048)
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--slow-readers", action="store_true")
    parser.add_argument("--tree", action="append", required=True, metavar="LABEL=PATH")
    parser.add_argument("--variant", default=None,
                        help="BGE_M3_MODEL (default: unset, the measured choice)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="another variable for the server (repeatable)")
    parser.add_argument("--port", type=int, default=19391)
    parser.add_argument("--cache-dir", default="/tmp/answer-burst")
    args = parser.parse_args()
    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    path, body = request(args.scenario, args.texts, vocabulary_words(args.export_dir))
    print(f"{args.scenario}: {len(body)} bytes x {args.clients}", flush=True)
    for spec in args.tree:
        label, _, tree = spec.partition("=")
        run_tree(label, str(Path(tree).resolve()), args, path, body)


if __name__ == "__main__":
    main()
