"""Inputs for the bulk-job tests: texts spread over a JSONL, a Parquet and a CSV file, with
bad rows among them, and the checks every run's output must pass."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi")
BAD_IDS = {"j-bad-int": "'text' is int, not a string", "j-bad-missing": "no 'text'",
           "p-bad-null": "no 'text'", "c-bad-empty": "no 'text'"}


def make_inputs(folder: Path, n: int = 500, seed: int = 0) -> dict[str, str]:
    """``n`` good rows in three files (ids j*/p*/c*) plus the rows of BAD_IDS; returns
    id → text of the good rows."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    texts = {}
    split = [n // 3, n // 3, n - 2 * (n // 3)]

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))

    with open(folder / "part-1.jsonl", "w") as f:
        for i in range(split[0]):
            texts[f"j{i}"] = t = text()
            f.write(json.dumps({"id": f"j{i}", "text": t}) + "\n")
            if i == 10:
                f.write(json.dumps({"id": "j-bad-int", "text": 42}) + "\n")
                f.write(json.dumps({"id": "j-bad-missing", "title": "x"}) + "\n")
    ids = [f"p{i}" for i in range(split[1])]
    for i in ids:
        texts[i] = text()
    pq.write_table(pa.table({"id": ids + ["p-bad-null"], "text": [texts[i] for i in ids] + [None]}),
                   folder / "part-2.parquet", row_group_size=64)
    with open(folder / "part-3.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "text"])
        for i in range(split[2]):
            texts[f"c{i}"] = t = text()
            writer.writerow([f"c{i}", t])
        writer.writerow(["c-bad-empty", ""])
    return texts


def read_output(folder: Path) -> pa.Table:
    """Every shard's rows (pyarrow skips _bulk.json and dot-files by itself)."""
    return pq.read_table(folder)


def assert_rows_match(table: pa.Table, texts: dict[str, str], engine) -> None:
    """Exactly one row per good id, none for the bad ones, and the vectors, token counts and
    truncation flags that ``Engine.embed`` gives for the same texts."""
    ids = table["id"].to_pylist()
    assert len(ids) == len(set(ids)), "duplicate rows"
    assert set(ids) == set(texts), (set(ids) ^ set(texts))
    order = sorted(range(len(ids)), key=ids.__getitem__)
    want_ids = [ids[i] for i in order]
    want = engine.embed([texts[i] for i in want_ids], dense=True, sparse=True)
    table = table.take(order)
    dense = np.stack(table["dense"].to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(dense, want.dense, atol=1e-5, rtol=0)
    assert table["n_tokens"].to_pylist() == want.n_tokens.tolist()
    assert table["truncated"].to_pylist() == want.truncated.tolist()
    for got_i, got_w, (want_i, want_w) in zip(table["sparse_indices"].to_pylist(),
                                              table["sparse_values"].to_pylist(), want.sparse,
                                              strict=True):
        assert got_i == want_i.tolist()
        np.testing.assert_allclose(got_w, want_w, atol=1e-4, rtol=0)
