"""Embeddings as Arrow columns: what a bulk shard and ``bgeserve.ray.Embedder`` write.

| column | Arrow type | what |
|---|---|---|
| ``n_tokens`` | int32 | tokens after truncation, special tokens included |
| ``truncated`` | bool | the text was cut to ``BGE_M3_MAX_SEQ_LENGTH`` tokens |
| ``dense`` | fixed_size_list<float32>[hidden] | L2-normalised CLS vector |
| ``sparse_indices`` / ``sparse_values`` | list<int32> / list<float32> | unique token ids, ascending, and their weights (FlagEmbedding's lexical weights) |
| ``colbert`` | list<fixed_size_list<float32>[hidden]> | one normalised vector per token, CLS excluded |

Fixed-size lists load as (n, hidden) arrays without a copy and are what vector databases'
Parquet importers (Milvus bulk insert, LanceDB) read as vectors. The columns are built from
offsets and flat buffers, never row by row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from bgeserve.errors import InvalidInput
from bgeserve.results import Embeddings, EmbedOptions

OUTPUTS = ("dense", "sparse", "colbert")


def parse_outputs(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"dense,sparse"`` (or a sequence) → the outputs in canonical order; InvalidInput
    naming ``--outputs`` for an unknown or empty one."""
    names = [n.strip().lower() for n in (text.split(",") if isinstance(text, str) else text)]
    names = [n for n in names if n]
    unknown = sorted(set(names) - set(OUTPUTS))
    if unknown or not names:
        raise InvalidInput(f"--outputs {','.join(names) or '(empty)'}: choose one or more of "
                           f"{', '.join(OUTPUTS)}", param="--outputs")
    return tuple(n for n in OUTPUTS if n in names)


def embed_options(outputs: Sequence[str]) -> EmbedOptions:
    """What to ask the engine for ``outputs`` (texts past max_seq truncated and flagged)."""
    return EmbedOptions(dense="dense" in outputs, sparse="sparse" in outputs,
                        colbert="colbert" in outputs, truncate=True)


def schema(outputs: Sequence[str], width: int, with_id: bool = True) -> pa.Schema:
    """The columns for ``outputs`` (a string ``id`` first when ``with_id``)."""
    vector = pa.list_(pa.float32(), width)
    fields = [pa.field("id", pa.string())] if with_id else []
    fields += [pa.field("n_tokens", pa.int32()), pa.field("truncated", pa.bool_())]
    if "dense" in outputs:
        fields.append(pa.field("dense", vector))
    if "sparse" in outputs:
        fields += [pa.field("sparse_indices", pa.list_(pa.int32())),
                   pa.field("sparse_values", pa.list_(pa.float32()))]
    if "colbert" in outputs:
        fields.append(pa.field("colbert", pa.list_(vector)))
    return pa.schema(fields)


def _offsets(lengths: Sequence[int]) -> pa.Array:
    return pa.array(np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).astype(np.int32))


def arrays(emb: Embeddings, outputs: Sequence[str], width: int) -> dict[str, pa.Array]:
    """Arrow columns (n_tokens, truncated, then the outputs asked for) of ``emb``'s rows."""
    out: dict[str, pa.Array] = {
        "n_tokens": pa.array(np.asarray(emb.n_tokens, dtype=np.int32)),
        "truncated": pa.array(np.asarray(emb.truncated, dtype=bool)),
    }
    n = len(emb)
    if "dense" in outputs:
        dense = (np.zeros((0, width), np.float32) if emb.dense is None and n == 0
                 else np.ascontiguousarray(emb.dense, dtype=np.float32))
        out["dense"] = pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1)), width)
    if "sparse" in outputs:
        pairs = emb.sparse or []
        lengths = [len(i) for i, _ in pairs]
        ids = np.concatenate([i for i, _ in pairs]) if pairs else np.zeros(0)
        weights = np.concatenate([w for _, w in pairs]) if pairs else np.zeros(0)
        offsets = _offsets(lengths)
        out["sparse_indices"] = pa.ListArray.from_arrays(offsets, pa.array(ids.astype(np.int32)))
        out["sparse_values"] = pa.ListArray.from_arrays(
            offsets, pa.array(weights.astype(np.float32)))
    if "colbert" in outputs:
        mats = emb.colbert or []
        flat = (np.concatenate(mats) if mats else np.zeros((0, width))).astype(np.float32,
                                                                              copy=False)
        vectors = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), width)
        out["colbert"] = pa.ListArray.from_arrays(_offsets([len(m) for m in mats]), vectors)
    return out


def scatter(columns: dict[str, pa.Array], positions: Sequence[int], n: int
            ) -> dict[str, pa.Array]:
    """Columns of ``n`` rows: row ``positions[k]`` gets ``columns[...][k]``, the others null."""
    where: list[int | None] = [None] * n
    for k, p in enumerate(positions):
        where[p] = k
    take = pa.array(where, type=pa.int64())
    return {name: col.take(take) for name, col in columns.items()}
