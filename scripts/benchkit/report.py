"""The report: one row per measurement, agreement with the reference vectors, ratios, tables."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

from benchkit.common import MiB, load_vectors, percentiles


def summarize(name: str, mode: str, variant: str, corpus_kind: str, corpus: dict[str, Any],
              res: dict[str, Any]) -> dict[str, Any]:
    tokens = int(sum(corpus["lengths"]))
    row: dict[str, Any] = {"name": name, "mode": mode, "variant": variant, "corpus": corpus_kind,
                           "texts": len(corpus["texts"]), "tokens": tokens, "ok": res.get("ok"),
                           "error": res.get("error")}
    if not res.get("ok"):
        return row
    wall = res["wall_s"]
    p50, p99 = percentiles(res.get("latencies") or [])
    server = mode in ("http", "serve")
    if mode == "serve" and (res.get("served") or {}).get("variant"):
        row["variant"] = res["served"]["variant"]  # the server's own choice
    peak = res.get("peak_rss_server") if server else res.get("peak_rss")
    chunks = res.get("chunks")
    padded = sum(b * s for b, s in chunks) if chunks else None
    row.update({
        "wall_s": wall, "tokens_per_s": tokens / wall, "texts_per_s": len(corpus["texts"]) / wall,
        "p50_ms": p50, "p99_ms": p99, "peak_rss": peak, "rss_after_load": res.get("rss_after_load"),
        "load_s": res.get("load_s"), "chunks": len(chunks) if chunks else None,
        "padding_pct": 100.0 * (1 - tokens / padded) if padded else None,
        "errors": res.get("errors", 0), "vectors": res.get("vectors"),
    })
    if server and res.get("server_chunks"):
        row["chunks"], row["padding_pct"] = res["server_chunks"], res["server_padding_pct"]
    for key in ("tokens_reported", "requests", "clients", "http_batch", "error_samples",
                "server_env", "tuning", "peak_rss", "texts_per_chunk", "served"):
        if key in res:
            row["client_peak_rss" if (key == "peak_rss" and server) else key] = res[key]
    return row


def _rounds(row: dict[str, Any]) -> list[float]:
    """A row's tokens/s per round, in round order; [] if any round failed (the rounds of two
    rows then no longer pair up)."""
    return [] if row.get("rounds_failed") else list(row.get("rounds_tokens_per_s") or [])


def median_row(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for a measurement repeated over rounds: the round with the median throughput
    (the lower of the two middle ones for an even count; a real round, so its latencies,
    RSS and vectors belong together), with every round's tokens/s in ``rounds_tokens_per_s``.
    A failed round is left out; when all failed, the first failure."""
    good = sorted((r for r in rounds if r.get("ok")), key=lambda r: r["tokens_per_s"])
    if not good:
        return rounds[0]
    row = dict(good[(len(good) - 1) // 2])
    row["rounds_tokens_per_s"] = [r["tokens_per_s"] for r in rounds if r.get("ok")]
    row["rounds_load_s"] = [r.get("load_s") for r in rounds if r.get("ok")]
    row["rounds_serving_s"] = [(r.get("served") or {}).get("serving_s") for r in rounds
                               if r.get("ok")]
    row["rounds_failed"] = len(rounds) - len(good)
    return row


def agreement(rows: list[dict[str, Any]]) -> None:
    """Dense cosine (min/mean) and sparse max |Δweight| against the reference vectors."""
    by_corpus: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_corpus.setdefault(r["corpus"], []).append(r)
    prefer = [("flag", "fp32"), ("engine", "fp32"), ("raw", "fp32"), ("raw1", "fp32"),
              ("http", "fp32"), ("ref", "fp32"), ("ort1", "fp32")]
    for corpus_rows in by_corpus.values():
        ref = None
        for mode, variant in prefer:
            ref = next((r for r in corpus_rows if r["mode"] == mode and r["variant"] == variant
                        and r.get("vectors")), None)
            if ref is not None:
                break
        if ref is None:
            continue
        ref_dense, ref_sparse = load_vectors(Path(ref["vectors"]))
        for r in corpus_rows:
            if not r.get("vectors"):
                continue
            r["reference"] = ref["name"]
            dense, sparse = load_vectors(Path(r["vectors"]))
            if dense is not None and ref_dense is not None and dense.shape == ref_dense.shape:
                cos = (dense * ref_dense).sum(1) / (np.linalg.norm(dense, axis=1)
                                                   * np.linalg.norm(ref_dense, axis=1))
                r["cos_min"], r["cos_mean"] = float(cos.min()), float(cos.mean())
            if sparse is not None and ref_sparse is not None and len(sparse) == len(ref_sparse):
                worst, same_keys = 0.0, 0
                for a, b in zip(sparse, ref_sparse):
                    same_keys += set(a) == set(b)
                    for k in set(a) | set(b):
                        worst = max(worst, abs(a.get(k, 0.0) - b.get(k, 0.0)))
                r["sparse_max_abs"] = worst
                r["sparse_same_keys"] = same_keys / max(len(sparse), 1)


def _fmt(v: Any, spec: str = ".1f") -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _cell(v: Any) -> str:
    return " ".join(str(v).replace("|", "/").split())[:100]


def _mib(v: Any) -> str:
    return "—" if not v else f"{v / MiB:,.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| corpus | mode | variant | texts | tokens | wall s | tokens/s | texts/s | p50 ms "
            "| p99 ms | peak RSS MiB | RSS after load MiB | chunks | pad % | cos min | cos mean "
            "| sparse max Δ | errors |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['corpus']} | {r['mode']} | {r['variant']} | {r['texts']} | "
                         f"{r['tokens']} | FAILED: {_cell(r.get('error'))} |" + " |" * 12)
            continue
        lines.append("| " + " | ".join([
            r["corpus"], r["mode"] + (f" ×{r['clients']}c/{r['http_batch']}t"
                                      if r["mode"] in ("http", "serve") else ""),
            r["variant"] + (" (its choice)" if r["mode"] == "serve" else ""),
            str(r["texts"]), str(r["tokens"]), _fmt(r["wall_s"], ".2f"), _fmt(r["tokens_per_s"]),
            _fmt(r["texts_per_s"], ".2f"), _fmt(r["p50_ms"], ".0f"), _fmt(r["p99_ms"], ".0f"),
            _mib(r["peak_rss"]), _mib(r["rss_after_load"]), _fmt(r["chunks"]),
            _fmt(r["padding_pct"]), _fmt(r.get("cos_min"), ".6f"), _fmt(r.get("cos_mean"), ".6f"),
            _fmt(r.get("sparse_max_abs"), ".2e"), str(r.get("errors", 0)),
        ]) + " |")
    return "\n".join(lines)


def ratios(rows: list[dict[str, Any]], default_variant: str | None = None,
           per_round: dict[str, list[float]] | None = None) -> dict[str, float]:
    """tokens/s ratios; ``default_variant``: what the server serves with neither BGE_M3_MODEL
    nor BGE_M3_EP set (``server_default_variant``). Of rows measured in rounds, the median of
    the per-round ratios (round i of one against round i of the other: they ran side by side,
    so the machine's drift cancels), each round's also put in ``per_round``."""
    out: dict[str, float] = {}
    by = {(r["corpus"], r["mode"], r["variant"]): r for r in rows if r.get("ok")}
    tps = {key: r["tokens_per_s"] for key, r in by.items()}
    corpora = sorted({r["corpus"] for r in rows})
    variants = [v for v in ("fp32", "int8", "bf16", "ov-int8")
                if any(r["variant"] == v for r in rows)]
    variants += sorted({r["variant"] for r in rows} - set(variants))

    def put(label: str, a: tuple[str, str, str], b: tuple[str, str, str]) -> None:
        if a not in tps or b not in tps:
            return
        out[label] = tps[a] / tps[b]
        ra, rb = _rounds(by[a]), _rounds(by[b])
        if len(ra) > 1 and len(ra) == len(rb):
            each = [x / y for x, y in zip(ra, rb)]
            out[label] = statistics.median(each)
            if per_round is not None:
                per_round[label] = each

    for c in corpora:
        for v in variants:
            put(f"{c}: engine {v} / flag fp32", (c, "engine", v), (c, "flag", "fp32"))
            put(f"{c}: http {v} / flag fp32"
                + (" (the server's default variant)" if v == default_variant else ""),
                (c, "http", v), (c, "flag", "fp32"))
            put(f"{c}: http {v} / engine {v}", (c, "http", v), (c, "engine", v))
            put(f"{c}: engine {v} / raw {v} (same packing)", (c, "engine", v), (c, "raw", v))
            put(f"{c}: engine {v} / raw1 {v}", (c, "engine", v), (c, "raw1", v))
            put(f"{c}: raw {v} / raw1 {v}", (c, "raw", v), (c, "raw1", v))
            if v != "fp32":
                put(f"{c}: engine {v} / engine fp32", (c, "engine", v), (c, "engine", "fp32"))
        for v in {r["variant"] for r in rows if r["corpus"] == c and r["mode"] == "serve"}:
            put(f"{c}: serve (the server's own choice, {v}) / flag fp32", (c, "serve", v),
                (c, "flag", "fp32"))
            put(f"{c}: serve ({v}) / http {v} (pinned, fixed budget)", (c, "serve", v),
                (c, "http", v))
        put(f"{c}: engine fp32 / raw1 fp32 (raw ORT batch 1)", (c, "engine", "fp32"),
            (c, "raw1", "fp32"))
        put(f"{c}: engine fp32 / ort1 (stock ORT, plain attention, batch 1)",
            (c, "engine", "fp32"), (c, "ort1", "fp32"))
    return out


def load_table(load_rows: list[dict[str, Any]]) -> str:
    lines = [("| variant | cross-request batching | clients | requests | wall s | requests/s "
              "| tokens/s | p50 ms | p99 ms | texts/chunk | errors | server peak RSS MiB |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in load_rows:
        if not r.get("ok"):
            lines.append(f"| {r['variant']} | {'on' if r['batching'] else 'off'} | FAILED: "
                         f"{_cell(r.get('error'))} |" + " |" * 9)
            continue
        for lv in r["levels"]:
            lines.append("| " + " | ".join([
                r["variant"], "on" if r["batching"] else "off", str(lv["clients"]),
                str(lv["requests"]), _fmt(lv["wall_s"], ".2f"), _fmt(lv["requests_per_s"]),
                _fmt(lv["tokens_per_s"]), _fmt(lv["p50_ms"], ".0f"), _fmt(lv["p99_ms"], ".0f"),
                _fmt(lv.get("texts_per_chunk"), ".2f"), str(lv["errors"]),
                _mib(r["peak_rss_server"])]) + " |")
    return "\n".join(lines)


def load_gains(load_rows: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    level = {(r["variant"], r["batching"], lv["clients"]): lv["requests_per_s"]
             for r in load_rows if r.get("ok") for lv in r["levels"]}
    for (variant, batching, clients), rps in level.items():
        off = level.get((variant, False, clients))
        if batching and off:
            label = f"{clients} client{'' if clients == 1 else 's'}"
            out[f"load {variant}, {label}: batching on / off (requests/s)"] = rps / off
    return out


def rss_table(rows: list[dict[str, Any]]) -> str:
    lines = [("| text tokens | variant | RSS before MiB | peak MiB | growth MiB | of which "
              "anonymous (workspace, sampled peak) MiB | file-backed (mapped weights) MiB "
              "| seconds |"),
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['target']} | {r['variant']} | FAILED: {_cell(r.get('error'))}"
                         " | | | | | |")
            continue
        lines.append(f"| {r['length']} | {r['variant']} | {_mib(r['rss_before'])} | "
                     f"{_mib(r['peak'])} | {_mib(r['growth'])} | {_mib(r.get('anon_growth'))} | "
                     f"{_mib(r.get('file_growth'))} | {r['seconds']:.2f} |"
                     + ("" if r.get("peak_reset") else " (peak not reset: includes load)"))
    return "\n".join(lines)


def sweep_row(name: str, variant: str, runtime: str, max_tokens: int, corpus: dict[str, Any],
              res: dict[str, Any]) -> dict[str, Any]:
    """One --chunk-sweep point: tokens/s of ``raw`` against the padded tokens per chunk."""
    row: dict[str, Any] = {"name": name, "variant": variant, "runtime": runtime,
                           "max_tokens": max_tokens, "ok": res.get("ok"),
                           "error": res.get("error")}
    if res.get("ok"):
        tokens = int(sum(corpus["lengths"]))
        chunks = res["chunks"]
        padded = sum(b * s for b, s in chunks)
        row.update({"tokens": tokens, "wall_s": res["wall_s"],
                    "tokens_per_s": tokens / res["wall_s"], "chunks": len(chunks),
                    "padded_per_chunk": padded / len(chunks),
                    "padding_pct": 100.0 * (1 - tokens / padded), "peak_rss": res["peak_rss"]})
    return row


def sweep_table(rows: list[dict[str, Any]]) -> str:
    lines = [("| variant | runtime | max tokens/chunk | chunks | padded tokens/chunk | pad % "
              "| tokens/s | peak RSS MiB |"), "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("ok"):
            lines.append(f"| {r['variant']} | {r['runtime']} | {r['max_tokens']} | FAILED: "
                         f"{_cell(r.get('error'))} | | | | |")
            continue
        lines.append(f"| {r['variant']} | {r['runtime']} | {r['max_tokens']} | {r['chunks']} | "
                     f"{r['padded_per_chunk']:.0f} | {r['padding_pct']:.1f} | "
                     f"{r['tokens_per_s']:.1f} | {_mib(r['peak_rss'])} |")
    return "\n".join(lines)

