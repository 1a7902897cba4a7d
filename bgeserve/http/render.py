"""Response bodies: ``Embeddings`` → OpenAI-shaped JSON bytes (float lists or base64).

Pure and synchronous (the handler runs big results on a thread). numpy arrays go straight to
orjson (``OPT_SERIALIZE_NUMPY``), which needs C-contiguous arrays; base64 is always of
little-endian bytes, float32 unless ``colbert_dtype`` asks for float16.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import orjson

from bgeserve.http.schemas import EmbedRequest, Endpoint
from bgeserve.results import Embeddings, TextTokens, Token

TokenStrings = Callable[[Sequence[int]], list[str]]

# An answer whose vectors pass STREAM_BYTES (float32) is sent as it is rendered, PIECE_BYTES at
# a time: rendered whole, a ColBERT answer's JSON text (~3x its float32 vectors, more while
# orjson's buffer grows) and then its unsent part, copied into the transport's buffer, came on
# top of the vectors, outside every allowance.
STREAM_BYTES = 4 << 20
PIECE_BYTES = 1 << 20


def encode_array(array: np.ndarray, encoding_format: str, dtype: str = "<f4") -> Any:
    """A vector or matrix as a contiguous array (orjson writes nested lists) or base64 text."""
    data = np.ascontiguousarray(array, dtype=dtype)
    if encoding_format == "base64":
        return base64.b64encode(data.tobytes()).decode("ascii")
    return data


def select_sparse(
    indices: np.ndarray, values: np.ndarray, top_k: int | None, min_weight: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """Drop weights below ``min_weight``, keep the ``top_k`` largest; order stays by index."""
    indices = np.asarray(indices, dtype=np.int64)
    values = np.asarray(values, dtype=np.float32)
    if min_weight is not None:
        keep = values >= np.float64(min_weight)  # float64: a huge threshold must not overflow
        indices, values = indices[keep], values[keep]
    if top_k is not None and len(values) > top_k:
        # stable: among equal weights the lower token id wins, so results are deterministic
        keep = np.sort(np.argsort(-values, kind="stable")[:top_k])
        indices, values = indices[keep], values[keep]
    return np.ascontiguousarray(indices), np.ascontiguousarray(values)


def format_sparse(
    indices: np.ndarray, values: np.ndarray, sparse_format: str, token_strings: TokenStrings
) -> dict[str, Any]:
    """``{"indices", "values"}``, ``{"<id>": weight}`` (``dict``, ids ascending), or
    ``{token: weight}`` (``tokens``; max weight when strings collide)."""
    if sparse_format == "indices":
        return {"indices": indices, "values": values}
    if sparse_format == "dict":
        return dict(zip(map(str, indices.tolist()), values, strict=True))
    by_token: dict[str, np.float32] = {}
    for token, weight in zip(token_strings(indices.tolist()), values, strict=True):
        if token not in by_token or weight > by_token[token]:
            by_token[token] = weight
    return by_token


def render_embeddings(
    endpoint: Endpoint,
    request: EmbedRequest,
    result: Embeddings,
    model: str,
    token_strings: TokenStrings,
) -> bytes:
    """The full JSON body for an embedding route, items in input order: one ``orjson.dumps``
    (the text once; joining ``embedding_parts`` held it twice at the peak).

    With ``sparse_empty: omit``, an item whose sparse vector is empty (after ``sparse_top_k``
    and ``sparse_min_weight``) is left out; the others keep their input ``index``.
    """
    tokens = result.prompt_tokens
    body = {
        "object": "list",
        "model": model,
        "data": list(_items(endpoint, request, result, token_strings)),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def embedding_parts(
    endpoint: Endpoint,
    request: EmbedRequest,
    result: Embeddings,
    model: str,
    token_strings: TokenStrings,
) -> Iterator[bytes]:
    """``render_embeddings``' bytes in pieces of about ``PIECE_BYTES``, each rendered when it
    is asked for (a streamed answer holds one piece, not the whole text)."""
    items = (orjson.dumps(item, option=orjson.OPT_SERIALIZE_NUMPY)
             for item in _items(endpoint, request, result, token_strings))
    tokens = result.prompt_tokens
    usage = orjson.dumps({"prompt_tokens": tokens, "total_tokens": tokens})
    # What orjson.dumps writes for {"object", "model", "data", "usage"}, byte for byte.
    head = b'{"object":"list","model":' + orjson.dumps(model) + b',"data":['
    return json_pieces(head, items, b'],"usage":' + usage + b"}")


def _items(
    endpoint: Endpoint,
    request: EmbedRequest,
    result: Embeddings,
    token_strings: TokenStrings,
) -> Iterator[dict[str, Any]]:
    """The answer's items in input order, one at a time."""
    fmt = request.encoding_format
    colbert_dtype = "<f2" if request.colbert_dtype == "float16" else "<f4"
    dense = result.dense if "dense" in request.outputs else None
    sparse = result.sparse if "sparse" in request.outputs else None
    colbert = result.colbert if "colbert" in request.outputs else None
    omit_empty = sparse is not None and request.sparse_empty == "omit"
    for i in range(len(result)):
        item: dict[str, Any] = {"object": endpoint.item_object, "index": i}
        if sparse is not None:
            ids, weights = select_sparse(*sparse[i], request.sparse_top_k,
                                         request.sparse_min_weight)
            if omit_empty and len(ids) == 0:
                continue
        if dense is not None:
            item["embedding"] = encode_array(dense[i], fmt)
        if sparse is not None:
            item["sparse_values"] = format_sparse(ids, weights, request.sparse_format,
                                                  token_strings)
        if colbert is not None:
            item["colbert"] = encode_array(colbert[i], fmt, colbert_dtype)
        if result.truncated[i]:
            item["truncated"] = True
        yield item


def json_pieces(head: bytes, items: Iterable[bytes], tail: bytes) -> Iterator[bytes]:
    """``head``, the items comma-separated, ``tail``: in pieces of about ``PIECE_BYTES``."""
    def parts() -> Iterator[bytes]:
        yield head
        for k, item in enumerate(items):
            yield item if k == 0 else b"," + item
        yield tail
    return gathered(parts())


# What a sparse entry counts as toward STREAM_BYTES: its JSON is ~25 bytes, but the Python
# objects made to render it (a dict entry of a str key and a float, or an {index, value} dict)
# ~150 (QA: a TEI /embed_sparse answer of 2,048 texts of 800 distinct words, rendered whole,
# OOM-killed a server under a 400 MiB cap).
SPARSE_ENTRY_BYTES = 32
# A /tokenize token's JSON is ~65 bytes: a third of it, as float32 bytes count.
TOKEN_BYTES = 22
TOKENS_AT_ONCE = 4096  # tokens made into objects and rendered at a time


def numbers_bytes(result: Embeddings, outputs: Collection[str]) -> int:
    """The float32 bytes of the vectors an answer carries (its JSON text is ~3x that), a
    sparse entry counted as SPARSE_ENTRY_BYTES."""
    total = 0
    if "dense" in outputs and result.dense is not None:
        total += int(np.asarray(result.dense).nbytes)
    if "sparse" in outputs and result.sparse is not None:
        total += sum(len(ids) for ids, _ in result.sparse) * SPARSE_ENTRY_BYTES
    if "colbert" in outputs and result.colbert is not None:
        total += sum(int(np.asarray(m).size) * 4 for m in result.colbert)
    return total


def gathered(pieces: Iterable[bytes]) -> Iterator[bytes]:
    """``pieces`` joined into pieces of about ``PIECE_BYTES``."""
    piece: list[bytes] = []
    size = 0
    for part in pieces:
        piece.append(part)
        size += len(part)
        if size >= PIECE_BYTES:
            yield b"".join(piece)
            piece, size = [], 0
    if piece:
        yield b"".join(piece)


def token_pieces(texts: Sequence[Sequence[Token]]) -> Iterator[bytes]:
    """TEI's ``/tokenize`` answer, ``[[{id, text, special, start, stop}]]``, in pieces of
    about PIECE_BYTES: each text's tokens made (``TextTokens``) and rendered TOKENS_AT_ONCE
    at a time, byte for byte what ``orjson.dumps`` of the whole writes."""
    def parts() -> Iterator[bytes]:
        yield b"["
        for k, tokens in enumerate(texts):
            yield b"[" if k == 0 else b",["
            for i in range(0, len(tokens), TOKENS_AT_ONCE):
                part = (tokens.dicts(i, i + TOKENS_AT_ONCE) if isinstance(tokens, TextTokens)
                        else tokens[i:i + TOKENS_AT_ONCE])
                rendered = orjson.dumps(part)[1:-1]
                yield rendered if i == 0 else b"," + rendered
            yield b"]"
        yield b"]"
    return gathered(parts())


def render_json(content: Any) -> bytes:
    """Any other JSON body (health, models)."""
    return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
