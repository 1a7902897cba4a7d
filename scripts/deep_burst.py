#!/usr/bin/env python3
"""A burst of concurrent ``GET /health/deep`` against a running server: how many chunks
(canaries) it ran and how long the burst took.

    bgeserve serve &                               # BGE_M3_MODEL_PATH=..., any variant
    python scripts/deep_burst.py --url http://127.0.0.1:8000 --checks 50

The chunks are read from ``/metrics`` (``bgeserve_chunk_texts_count``) before and after, so
run it on an otherwise idle server. Overlapping checks share one canary run (single flight,
docs/reliability.md §5): a burst should run about one chunk, not one per check.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


async def chunks(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "bgeserve_chunk_texts_count":
                return sample.value
    raise SystemExit("bgeserve_chunk_texts_count is missing from /metrics")


async def burst(url: str, checks: int) -> None:
    limits = httpx.Limits(max_connections=checks + 1)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        await client.get("/health/deep")  # one alone first: the path is warm
        before = await chunks(client)
        started = time.perf_counter()
        answers = await asyncio.gather(*(client.get("/health/deep") for _ in range(checks)))
        took = time.perf_counter() - started
        ran = await chunks(client) - before
    statuses = collections.Counter(
        f"{r.status_code} {r.json().get('status')}" for r in answers)
    print(f"{checks} concurrent /health/deep: {dict(statuses)}; {ran:.0f} chunks run; "
          f"the burst answered in {took:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--checks", type=int, default=50)
    args = parser.parse_args()
    asyncio.run(burst(args.url, args.checks))


if __name__ == "__main__":
    main()
