"""``Embedder``: bge-m3 embeddings as a Ray Data ``map_batches`` stage.

    ds = ray.data.read_parquet("s3://bucket/docs/")
    ds = ds.map_batches(Embedder, fn_constructor_kwargs={"outputs": ("dense", "sparse"),
                        "env": {"BGE_M3_MODEL_PATH": "/models/bge-m3-onnx"}},
                        batch_format="pyarrow", batch_size=256, concurrency=4, num_cpus=8)
    ds.write_parquet("s3://bucket/vectors/")

Each actor builds the server's engine from ``BGE_M3_*`` settings (``env`` over the actor's
environment): the default variant, the memory probe on its own node and its cache, the budget.
Its intra-op threads are the CPUs Ray gave it (unless ``BGE_M3_INTRA_THREADS`` is set), and
when it shares a node with other actors its memory budget is its CPUs' share of the node's.

The batch comes back as Arrow tables, its rows in order: the input columns but the text, plus
``n_tokens``, ``truncated`` and the outputs asked for (see ``bgeserve.bulk.columns``). It is one
table unless its ColBERT vectors would pass half of ``BGE_M3_MAX_COLBERT_MB`` (its default as
the server's): the batch is then embedded and given a part at a time, each within it (the call
is a generator, as ``map_batches`` allows). A row whose text is missing or not a string keeps
its place with null outputs (``n_tokens`` null) and is named in a warning; filter with
``ds.filter(expr="n_tokens is not null")``.

``Embedder.identity`` names the model files the actor loaded (variant and graph sha256, as
``bgeserve bulk`` records them); ``identity_column`` adds it to every row (``bgeserve bulk
--ray`` checks it against the output folder's before writing a shard).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import pyarrow as pa

from bgeserve.bulk import columns
from bgeserve.bulk.model import BulkModel, resolve_settings
from bgeserve.cgroup import usable_cpus
from bgeserve.errors import InvalidInput
from bgeserve.tuning import memory

log = logging.getLogger("bgeserve.ray")


def _ray_cpus() -> float | None:
    """The CPUs Ray assigned to this actor (None outside Ray)."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_assigned_resources().get("CPU")


def actor_environ(env: Mapping[str, str] | None, cpus: float | None,
                  node_cpus: int | None = None) -> dict[str, str]:
    """The actor's ``BGE_M3_*`` environment: ``env`` over ``os.environ``, threads from its
    CPUs, and a memory share when it has only part of the node."""
    environ = {**os.environ, **(env or {})}
    if cpus:
        # The node's CPUs as this process may use them: a pod's CPU limit, not its host's
        # cores (on a 64-core host an actor of an 8-CPU pod would get an eighth of its share).
        node_cpus = node_cpus or usable_cpus().count
        environ.setdefault("BGE_M3_INTRA_THREADS", str(max(1, int(cpus))))
        if cpus < node_cpus and "BGE_M3_AVAILABLE_MEMORY_BYTES" not in environ:
            available = memory.detect_available_memory().available_bytes
            environ["BGE_M3_AVAILABLE_MEMORY_BYTES"] = str(int(available * cpus / node_cpus))
    return environ


def split_batch(batch: Any, text_column: str) -> tuple[list[Any], pa.Table]:
    """A Ray Data batch (Arrow table, pandas DataFrame or dict of numpy arrays) as (its texts,
    as given, and the other columns as Arrow). The texts are taken out first: a column
    mixing strings with other values has no Arrow type. A batch without ``text_column`` is
    an InvalidInput naming the columns it has (it was pyarrow's or pandas' bare KeyError)."""
    names = list(batch.column_names if isinstance(batch, pa.Table) else
                 batch.keys() if isinstance(batch, Mapping) else batch.columns)
    if text_column not in names:
        raise InvalidInput(f"the batch has no column {text_column!r} to embed; its columns are "
                           f"{', '.join(map(repr, names)) or 'none'}: name the texts' column "
                           "with Embedder(text_column=...)", param="text_column")
    if isinstance(batch, pa.Table):
        return (batch.column(text_column).to_pylist(), batch.drop_columns([text_column]))
    if isinstance(batch, Mapping):
        rest = {name: _array(col) for name, col in batch.items() if name != text_column}
        return list(batch[text_column]), pa.table(rest) if rest else _empty(batch[text_column])
    texts = batch[text_column].tolist()
    return texts, pa.Table.from_pandas(batch.drop(columns=[text_column]), preserve_index=False)


def _empty(col: Any) -> pa.Table:
    """A table of no columns and ``len(col)`` rows."""
    return pa.table({"_": pa.nulls(len(col))}).drop_columns(["_"])


def _array(col: Any) -> pa.Array:
    col = np.asarray(col)
    if col.ndim <= 1:
        return pa.array(col.tolist() if col.dtype == object else col)
    # A tensor column of the caller's: Ray's own extension type keeps its shape.
    from ray.data.extensions import ArrowTensorArray

    return ArrowTensorArray.from_numpy(col)


class Embedder:
    """A callable class for ``Dataset.map_batches``: embeds the ``text_column`` of each batch.

    Args:
        outputs: any of ``"dense"``, ``"sparse"``, ``"colbert"`` (a sequence or ``"a,b"``).
        text_column: the column of texts (dropped from the output unless ``keep_text``;
            kept, a text that was not a string is null).
        env: ``BGE_M3_*`` variables for the model (over the actor's own environment).
        identity_column: a column to add holding ``identity`` in every row (none by default).
    """

    def __init__(self, outputs: str | Sequence[str] = ("dense", "sparse"), *,
                 text_column: str = "text", env: Mapping[str, str] | None = None,
                 keep_text: bool = False, identity_column: str | None = None):
        self.outputs = columns.parse_outputs(outputs)
        self.text_column = text_column
        self.keep_text = keep_text
        self.identity_column = identity_column
        self.options = columns.embed_options(self.outputs)
        cpus = _ray_cpus()
        environ = actor_environ(env, cpus)
        # As ``bgeserve bulk`` does, at the actor's CPUs, for a pipeline of the user's own
        # (``bulk --ray`` sets MALLOC_ARENA_MAX when the actor starts: this then does nothing).
        # Ray's threads may have made more than 8 arenas already: glibc then keeps its limit.
        memory.limit_malloc_arenas(environ, int(cpus) if cpus else None)
        self.model = BulkModel(resolve_settings(environ))
        self.identity = self.model.identity  # bgeserve.bulk.model.model_identity
        # A part's vectors are held twice while given (the engine's arrays, then Arrow's).
        self.limit = self.model.colbert_limit // 2 if self.options.colbert else None

    def __call__(self, batch: Any) -> Iterator[pa.Table]:
        given_texts, table = split_batch(batch, self.text_column)
        n = len(given_texts)
        texts = [t if isinstance(t, str) else None for t in given_texts]
        # bgeserve bulk's reader says why a row has no text (_error); a user's batch does not.
        given = (table.column("_error").to_pylist() if "_error" in table.column_names
                 else [None] * n)
        errors: list[str | None] = [
            None if t is not None else (why or f"no string {self.text_column!r}")
            for t, why in zip(texts, given, strict=True)]
        return self._parts(table, texts, errors)

    def _parts(self, table: pa.Table, texts: list[str | None], errors: list[str | None]
               ) -> Iterator[pa.Table]:
        # A generator of its own: the batch's errors (no text column) raise from the call.
        for start, end, good, job in self.model.spans(texts, errors, self.options, self.limit):
            if job is not None:
                self.model.engine.submit(job)
            yield self._table(table.slice(start, end - start), texts[start:end],
                              errors[start:end], good, job.future if job is not None else None)

    def _table(self, table: pa.Table, texts: list[str | None], errors: list[str | None],
               good: list[int], future: Future | None) -> pa.Table:
        """The output of ``table``'s rows, whose ``good`` texts ``future`` embeds."""
        n = len(texts)
        if future is not None:
            data = columns.arrays(future.result(), self.outputs, self.model.width)
        else:
            data = {f.name: pa.nulls(0, f.type)
                    for f in columns.schema(self.outputs, self.model.width, with_id=False)}
        if len(good) < n:
            data = columns.scatter(data, good, n)
            self._warn(table, [i for i in range(n) if errors[i] is not None], errors)
        out = table
        if self.keep_text:
            out = out.append_column(self.text_column, pa.array(texts, pa.string()))
        if self.identity_column:
            data[self.identity_column] = pa.repeat(pa.scalar(self.identity, pa.string()), n)
        for name, array in data.items():
            if name in out.column_names:
                out = out.drop_columns([name])
            out = out.append_column(name, array)
        return out

    def _warn(self, table: pa.Table, bad: list[int], errors: list[str | None]) -> None:
        ids = (table.column("id").take(bad).to_pylist() if "id" in table.column_names
               else [f"row {i} of the batch" for i in bad])
        reasons = "; ".join(f"id {i!r}: {errors[b]}" for i, b in zip(ids, bad, strict=True))
        log.warning("%d rows were not embedded: %s", len(bad), reasons)
