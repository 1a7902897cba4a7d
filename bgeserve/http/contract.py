"""The contract served at ``GET /openapi.json``: ``openapi.yaml`` with this server's bounds.

``openapi.yaml`` (the repository root's, shipped in the package) is generic: it holds for any
model with bge-m3's layout. What this server accepts also depends on the loaded model (vector
width, vocabulary), on the settings (texts per request, characters per text, the maximum
sequence length, API keys) and on the names it answers to. ``served`` overlays those on the
document, as data: a list of JSON-pointer edits, each of which must land on a node the
document has (a reorganised ``openapi.yaml`` fails loudly here, and in the tests, instead of
serving a contract that silently lost a bound).
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml

from bgeserve.config import Settings

CONTRACT_PATH = Path(__file__).resolve().parent / "openapi.yaml"


@dataclass(frozen=True)
class Bounds:
    """What this server accepts and returns, as far as a schema can state it."""

    dense_width: int
    vocab_size: int
    max_batch: int
    max_text_chars: int
    max_seq_length: int
    max_body_bytes: int
    model_ids: tuple[str, ...]
    auth: bool  # BGE_M3_API_KEY is set
    metrics_auth: bool  # ... and /metrics needs it too
    token_ids: bool = False  # BGE_M3_ACCEPT_TOKEN_IDS: token-id input is embedded


@functools.cache
def generic() -> dict[str, Any]:
    """``openapi.yaml`` as parsed (shared: never mutate it; ``served`` copies)."""
    return yaml.safe_load(CONTRACT_PATH.read_text(encoding="utf-8"))


def _base64_length(n_bytes: int) -> int:
    return 4 * math.ceil(n_bytes / 3)


def overlay(b: Bounds) -> list[tuple[str, Any]]:
    """The edits, as (JSON pointer, value) pairs; the pointer's parent must exist."""
    ids = b.vocab_size - 1
    schemas = "/components/schemas"
    vector = _base64_length(4 * b.dense_width)
    by_type = f"{schemas}/CohereEmbedResponse/properties/embeddings/oneOf/1/properties"
    return [
        ("/info/x-bgeserve-bounds", asdict(b) | {"model_ids": list(b.model_ids)}),
        (f"{schemas}/TokenIds/items/maximum", ids),
        (f"{schemas}/TokenIds/description",
         f"Token ids in this model's vocabulary, 0 <= id < {b.vocab_size}."),
        (f"{schemas}/Input/oneOf/1/maxItems", b.max_batch),
        (f"{schemas}/Input/oneOf/3/maxItems", b.max_batch),
        (f"{schemas}/TeiInput/oneOf/1/maxItems", b.max_batch),
        (f"{schemas}/TeiInput/oneOf/3/maxItems", b.max_batch),
        (f"{schemas}/TeiTokenizeRequest/properties/inputs/oneOf/1/maxItems", b.max_batch),
        (f"{schemas}/RerankRequest/properties/documents/maxItems", b.max_batch),
        (f"{schemas}/CohereEmbedRequest/properties/texts/maxItems", b.max_batch),
        *((f"{by_type}/{kind}/items/{bound}", math.ceil(b.dense_width / 8))
          for kind in ("binary", "ubinary") for bound in ("minItems", "maxItems")),
        (f"{schemas}/TeiDecodeRequest/properties/ids/oneOf/1/maxItems", b.max_batch),
        (f"{schemas}/TeiDecodeRequest/properties/ids/oneOf/0/items/maximum", ids),
        (f"{schemas}/TeiDecodeRequest/properties/ids/oneOf/1/items/items/maximum", ids),
        # the source sentence is one of the batch's inputs
        (f"{schemas}/TeiSimilarityRequest/properties/inputs/properties/sentences/maxItems",
         max(1, b.max_batch - 1)),
        (f"{schemas}/TeiRerankRequest/properties/texts/maxItems", b.max_batch),
        (f"{schemas}/Model/enum", [*b.model_ids, None]),
        (f"{schemas}/Dimensions/enum", [b.dense_width, None]),
        (f"{schemas}/TeiEmbedRequest/properties/dimensions/enum", [b.dense_width, None]),
        (f"{schemas}/Vector/oneOf/0/minItems", b.dense_width),
        (f"{schemas}/Vector/oneOf/0/maxItems", b.dense_width),
        (f"{schemas}/Vector/oneOf/1/minLength", vector),
        (f"{schemas}/Vector/oneOf/1/maxLength", vector),
        (f"{schemas}/Colbert/oneOf/0/items/minItems", b.dense_width),
        (f"{schemas}/Colbert/oneOf/0/items/maxItems", b.dense_width),
        (f"{schemas}/SparseValues/anyOf/0/properties/indices/items/maximum", ids),
        (f"{schemas}/Health/properties/max_seq_length/const", b.max_seq_length),
        ("/security", [{"bearerAuth": []}] if b.auth else []),
        ("/paths/~1metrics/get/security",
         [{"bearerAuth": []}] if b.auth and b.metrics_auth else []),
        # Token ids refused (the default): no token-id input is valid here (``not: {}``, so
        # every input form built from them drops out of the served contract).
        *([] if b.token_ids else [
            (f"{schemas}/TokenIds/not", {}),
            (f"{schemas}/TokenIds/description", ("Token-id input is refused by this server "
             "(400 token_ids_not_accepted; BGE_M3_ACCEPT_TOKEN_IDS=1 accepts it).")),
        ]),
    ]


def _set(doc: Any, pointer: str, value: Any) -> None:
    *parents, leaf = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
    node = doc
    for part in parents:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError):
            raise KeyError(f"openapi.yaml has no {pointer!r}: update contract.overlay "
                           "to the document's new layout") from None
    if isinstance(node, list):
        node[int(leaf)] = value
    else:
        node[leaf] = value


def specialise(document: dict[str, Any], bounds: Bounds) -> dict[str, Any]:
    """A copy of ``document`` with ``bounds`` filled in."""
    doc = copy.deepcopy(document)
    for pointer, value in overlay(bounds):
        _set(doc, pointer, value)
    return doc


def bounds_of(service: Any, settings: Settings, model_ids: tuple[str, ...]) -> Bounds:
    """The bounds of a running server (``service.dense_width`` raises ``NotReady`` while the
    model loads). The maximum sequence length is the service's: clamped to the model's."""
    return Bounds(dense_width=service.dense_width(), vocab_size=service.vocab_size(),
                  max_batch=settings.max_batch, max_text_chars=settings.max_text_chars,
                  max_seq_length=service.settings.max_seq_length,
                  max_body_bytes=settings.max_body_bytes, model_ids=tuple(model_ids),
                  auth=bool(settings.api_keys), metrics_auth=settings.metrics_auth,
                  token_ids=settings.accept_token_ids)


@functools.lru_cache(maxsize=8)
def served(bounds: Bounds) -> bytes:
    """The JSON body of ``GET /openapi.json`` for ``bounds``."""
    return orjson.dumps(specialise(generic(), bounds))
