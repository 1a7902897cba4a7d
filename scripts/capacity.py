"""Capacity plan from measured throughput: replicas for a corpus, memory, the KEDA target.

    python scripts/capacity.py                                # the table of docs/scaling.md
    python scripts/capacity.py --docs 50e6 --tokens 300 --hours 12
    python scripts/capacity.py --simulate --burst-tokens 2e6  # KEDA on a burst, second by second

Every rate below is a measured end-to-end figure of one replica (docs/benchmarks.md; the
source is named per row): replicas = ceil(docs × tokens / (hours × 3600 × rate × utilization)).
``--utilization`` (default 0.7) leaves room for uneven shards, restarts and slow nodes. The KEDA
threshold (queued tokens per replica) for a backlog of B seconds is rate × B: a replica whose
queue holds more than B seconds of its own work asks for another.

``--simulate`` runs the KEDA rule on a burst: every ``--poll-s`` the desired replicas are
ceil(queued tokens / threshold) (within min/max), a new replica serves after ``--startup-s``,
and each serving replica drains ``rate`` tokens per second. It prints the backlog (in seconds
of the whole fleet's work) and the replicas over time, and when the queue is empty again.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Replica:
    """One replica kind: its measured rate (tokens/s) and peak memory (MiB, None: unmeasured)."""

    kind: str
    variant: str
    rate: float
    memory_mib: float | None
    source: str


# Measured: docs/benchmarks.md (full-size random bge-m3, mixed corpus of 16-512 tokens).
REPLICAS = (
    Replica("CPU 2 cores, Zen 4 (VNNI, AVX512_BF16)", "int8", 740.8, 2499,
            "run 20261130-040814 engine (HTTP 749); RSS run 20261130-003812"),
    Replica("CPU 2 cores, Zen 4 (VNNI, AVX512_BF16)", "bf16", 534.5, 1648,
            "run 20261130-003812 engine (HTTP 515)"),
    Replica("CPU 2 cores, Zen 4 (VNNI, AVX512_BF16)", "fp32", 276.1, 1667,
            "run 20261130-040814 engine (HTTP 284); RSS run 20261130-003812"),
    Replica("GPU 1x H200, CUDA", "fp16", 20413.0, None,
            "GPU section: engine, 1,024 mixed texts (HTTP 16 clients 27,641)"),
)


def replicas_needed(total_tokens: float, hours: float, rate: float, utilization: float) -> int:
    """Replicas that embed ``total_tokens`` within ``hours`` at ``utilization`` of ``rate``."""
    return max(1, math.ceil(total_tokens / (hours * 3600 * rate * utilization)))


def table(docs: float, tokens: float, hours: float, utilization: float,
          backlog_s: float) -> str:
    """The capacity table as Markdown."""
    total = docs * tokens
    title = (f"{docs:,.0f} documents x {tokens:,.0f} tokens = {total:,.0f} tokens in {hours:g} h "
             f"at {utilization:.0%} utilization; KEDA threshold for {backlog_s:g} s of backlog")
    header = ("| replica | variant | tokens/s | replicas | memory per replica | fleet memory | "
              "hours on 1 replica | KEDA threshold (tokens) |")
    lines = [title, "", header, "|---|---|---|---|---|---|---|---|"]
    for r in REPLICAS:
        n = replicas_needed(total, hours, r.rate, utilization)
        mem = f"{r.memory_mib / 1024:.1f} GiB" if r.memory_mib else "not measured"
        fleet = f"{n * r.memory_mib / 1024:,.0f} GiB" if r.memory_mib else "—"
        lines.append(f"| {r.kind} | {r.variant} | {r.rate:,.0f} | {n:,} | {mem} | {fleet} | "
                     f"{total / r.rate / 3600:,.0f} | {r.rate * backlog_s:,.0f} |")
    lines += ["", "Sources: " + "; ".join(f"{r.kind} {r.variant}: {r.source}" for r in REPLICAS)]
    return "\n".join(lines)


def simulate(rate: float, threshold: float, burst: float, arrival: float, seconds: int,
             poll_s: int, startup_s: int, min_r: int, max_r: int) -> list[tuple[int, float, int]]:
    """(second, queued tokens, serving replicas) under the KEDA rule."""
    queue, serving, ready_at = burst, min_r, []  # ready_at: when each new replica serves
    out = []
    for t in range(seconds):
        serving += sum(1 for x in ready_at if x == t)
        ready_at = [x for x in ready_at if x > t]
        if t % poll_s == 0:
            desired = min(max_r, max(min_r, math.ceil(queue / threshold)))
            pending = serving + len(ready_at)
            ready_at += [t + startup_s] * max(0, desired - pending)
        queue = max(0.0, queue + arrival - serving * rate)
        out.append((t, queue, serving))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=float, default=10e6)
    p.add_argument("--tokens", type=float, default=512, help="mean tokens per document")
    p.add_argument("--hours", type=float, default=24)
    p.add_argument("--utilization", type=float, default=0.7)
    p.add_argument("--target-backlog-s", type=float, default=2.0)
    p.add_argument("--simulate", action="store_true")
    p.add_argument("--replica", type=int, default=len(REPLICAS) - 1,
                   help="REPLICAS row for --simulate (default: the GPU)")
    p.add_argument("--burst-tokens", type=float, default=2e6)
    p.add_argument("--arrival", type=float, default=0.0, help="tokens/s arriving steadily")
    p.add_argument("--poll-s", type=int, default=15)
    p.add_argument("--startup-s", type=int, default=20)
    p.add_argument("--max-replicas", type=int, default=8)
    p.add_argument("--seconds", type=int, default=240)
    args = p.parse_args()
    print(table(args.docs, args.tokens, args.hours, args.utilization, args.target_backlog_s))
    if args.simulate:
        r = REPLICAS[args.replica]
        threshold = r.rate * args.target_backlog_s
        print(f"\n{r.kind} {r.variant}: a burst of {args.burst_tokens:,.0f} tokens, threshold "
              f"{threshold:,.0f}, poll {args.poll_s} s, start-up {args.startup_s} s\n")
        print("| s | queued tokens | backlog s (fleet) | replicas serving |")
        print("|---|---|---|---|")
        trace = simulate(r.rate, threshold, args.burst_tokens, args.arrival, args.seconds,
                         args.poll_s, args.startup_s, 1, args.max_replicas)
        for t, q, n in trace:
            if t % 5 == 0 or q == 0:
                print(f"| {t} | {q:,.0f} | {q / (n * r.rate):.1f} | {n} |")
            if q == 0:
                print(f"\nqueue empty after {t} s (one replica alone: "
                      f"{args.burst_tokens / r.rate:.0f} s)")
                break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
