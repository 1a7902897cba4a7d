"""Rerank request bodies → a validated ``RerankRequest``, or ``InvalidInput`` / ``TooLarge``.

Two shapes. Jina's and Cohere's (``/v1/rerank``, ``/v2/rerank``: what LangChain's and
LlamaIndex's rerankers send): ``{model, query, documents: [str | {text}], top_n,
return_documents}``, plus bgeserve's ``normalize``, ``mode``, ``weights``, ``long_documents``
and ``truncate``. TEI's (``/rerank``): ``{query, texts, raw_scores, return_text, truncate,
truncation_direction}``. As the clients expect, ``null`` means the default, ``top_n`` of 0
means all, and fields read by neither (Cohere's ``priority``, ``max_chunks_per_doc``) are
ignored. Cohere v1's document objects are ranked on their ``text`` (or their ``rank_fields``)
and echoed whole with ``return_documents``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import orjson

from bgeserve.config import Settings
from bgeserve.errors import InvalidInput, TooLarge
from bgeserve.http.schemas import _as_int, check_model, flag, load_object
from bgeserve.results import LONG_DOCUMENTS, RerankOptions

MODES = ("dense", "sparse", "colbert", "sparse+dense", "colbert+sparse+dense", "hybrid")
DIRECTIONS = {"right": "right", "Right": "right", "left": "left", "Left": "left"}


@dataclass(frozen=True)
class RerankRequest:
    """A validated rerank request: what to score, how, and what to return."""

    query: str
    documents: list[str]
    options: RerankOptions
    top_n: int | None = None  # None: every document
    return_documents: bool = False
    # Cohere's document objects as sent (None for a string), echoed whole with
    # return_documents ("all other fields will be preserved"); None when all were strings.
    objects: list[dict[str, Any] | None] | None = None


def _query(body: dict[str, Any]) -> str:
    if body.get("query") is None:
        raise InvalidInput("query is required", param="query")
    if not isinstance(body["query"], str):
        raise InvalidInput("query must be a string", param="query")
    # Not bounded here: only its leading tokens are read (FlagReranker's query cap, a
    # window's width), so one over BGE_M3_MAX_TEXT_CHARS is tokenized from its leading words.
    query: str = body["query"]
    return query


def _check_text(text: str, param: str, settings: Settings, how: str) -> None:
    if len(text) > settings.max_text_chars:
        raise TooLarge(f"{param} has {len(text)} characters, over the limit of "
                       f"{settings.max_text_chars} (BGE_M3_MAX_TEXT_CHARS) for a document "
                       f"scored to its end (windows, or truncation from the left); {how}, or "
                       "split it", param=param)


# How a long document is sent instead, in each body's own fields.
_JINA_HOW = "truncate it from the right (truncate: true) or set max_tokens_per_doc"
_TEI_HOW = "truncate it from the right (truncate: true, truncation_direction: right)"


def _documents(value: Any, name: str, settings: Settings, objects: bool, whole: bool = True,
               rank_fields: tuple[str, ...] | None = None, how: str = _JINA_HOW
               ) -> tuple[list[str], list[dict[str, Any] | None] | None]:
    """A non-empty list of strings (or, with ``objects``, of Cohere's objects with a
    ``text``: ranked on it, or on the values of ``rank_fields``); with ``whole``, none over
    ``max_text_chars``. Also the objects as sent (None where all were strings)."""
    shape = "strings or objects with a text field" if objects else "strings"
    if value is None:
        raise InvalidInput(f"{name} is required", param=name)
    if not isinstance(value, list):
        raise InvalidInput(f"{name} must be an array of {shape}", param=name)
    if not value:
        raise InvalidInput(f"{name} must not be empty", param=name, code="empty_input")
    if len(value) > settings.max_batch:
        raise InvalidInput(f"{len(value)} {name} exceed the maximum of {settings.max_batch} "
                           "(BGE_M3_MAX_BATCH); split the request", param=name,
                           code="batch_too_large")
    out = []
    sent: list[dict[str, Any] | None] = []
    for i, item in enumerate(value):
        if objects and isinstance(item, dict):
            if not isinstance(item.get("text"), str):  # echoed: it keeps Cohere's shape
                raise InvalidInput(f"{name}[{i}] must be one of: {shape}", param=f"{name}[{i}]")
            _check_echoable(item, f"{name}[{i}]")
            sent.append(item)
            item = _ranked_text(item, rank_fields)
        else:
            sent.append(None)
        if not isinstance(item, str):
            raise InvalidInput(f"{name}[{i}] must be one of: {shape}", param=f"{name}[{i}]")
        if whole:
            _check_text(item, f"{name}[{i}]", settings, how)
        out.append(item)
    return out, (sent if any(x is not None for x in sent) else None)


def _check_echoable(item: dict[str, Any], name: str) -> None:
    """Refuse, before it is scored, an object the answer could not echo (nor rank_fields
    write): orjson reads 1,024 levels of nesting but writes only 254."""
    try:
        orjson.dumps(item)
    except orjson.JSONEncodeError as exc:
        raise InvalidInput(f"{name} cannot be written back ({exc}): send a document object "
                           "nested less deeply", param=name) from exc


def _ranked_text(item: dict[str, Any], rank_fields: tuple[str, ...] | None) -> Any:
    """What a Cohere document object is ranked on: the values of those ``rank_fields`` it
    has, in that order, one per line (Cohere v1: "the values in title, author, text
    sequentially"; a string as it is, another value as its JSON); with none of them, or no
    ``rank_fields``, its ``text`` (not a string: the caller refuses it)."""
    values = [field if isinstance(field, str) else orjson.dumps(field).decode()
              for field in (item.get(key) for key in rank_fields or ()) if field is not None]
    return "\n".join(values) if values else item.get("text")


def _rank_fields(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
        raise InvalidInput("rank_fields must be an array of field names", param="rank_fields")
    return tuple(value)


def _top_n(value: Any) -> int | None:
    if value is None:
        return None
    number = _as_int(value)
    if number is None or number < 0:
        raise InvalidInput("top_n must be an integer >= 0 (0 or null: every document)",
                           param="top_n")
    return number or None


def _weights(value: Any) -> tuple[float, float, float]:
    if (not isinstance(value, list) or len(value) != 3
            or any(type(w) not in (int, float) or not w >= 0 for w in value)):
        raise InvalidInput("weights must be three numbers >= 0: [dense, sparse, colbert]",
                           param="weights")
    if not sum(value) > 0:
        raise InvalidInput("weights must not all be 0", param="weights")
    return float(value[0]), float(value[1]), float(value[2])


def _long_documents(body: dict[str, Any]) -> str:
    """``truncate`` wins when given (true: cut; false: windows), else ``long_documents``."""
    truncate = body.get("truncate")
    if truncate is not None:
        return "truncate" if flag(body, "truncate", False) else "max"
    value = body.get("long_documents")
    if value is None:
        return "max"
    if value not in LONG_DOCUMENTS:
        raise InvalidInput(f"long_documents must be one of {', '.join(map(repr, LONG_DOCUMENTS))}",
                           param="long_documents")
    return str(value)


def _max_tokens(value: Any) -> int | None:
    if value is None:
        return None
    number = _as_int(value)
    if number is None or number < 1:
        raise InvalidInput("max_tokens_per_doc must be an integer >= 1", param="max_tokens_per_doc")
    return number


def parse_rerank_request(raw: bytes, settings: Settings,
                         model_ids: Collection[str]) -> RerankRequest:
    """The Jina / Cohere body (``/v1/rerank``, ``/v2/rerank``); ``model`` must be one of
    ``model_ids`` (or absent: the default scorer)."""
    body = load_object(raw)
    check_model(body.get("model"), model_ids)
    mode = body.get("mode")
    if mode is not None and mode not in MODES:
        raise InvalidInput(f"mode must be one of {', '.join(map(repr, MODES))}", param="mode")
    options = RerankOptions(
        model=body.get("model"),
        normalize=flag(body, "normalize", settings.rerank_normalize),
        long_documents=_long_documents(body),
        max_tokens_per_doc=_max_tokens(body.get("max_tokens_per_doc")),
        mode=mode or "hybrid",
        weights=_weights(body["weights"]) if body.get("weights") is not None
        else RerankOptions.weights,
        given=frozenset(k for k in ("mode", "weights") if body.get(k) is not None),
    )
    documents, objects = _documents(body.get("documents"), "documents", settings, objects=True,
                                    whole=options.reads_document_ends,
                                    rank_fields=_rank_fields(body.get("rank_fields")))
    return RerankRequest(_query(body), documents, options, _top_n(body.get("top_n")),
                         flag(body, "return_documents", False), objects)


def parse_tei_rerank_request(raw: bytes, settings: Settings) -> RerankRequest:
    """TEI's ``/rerank`` body: sigmoid scores unless ``raw_scores``; ``truncate`` cuts (from
    the right, or the left with ``truncation_direction``), else long texts are windowed."""
    return tei_rerank_fields(load_object(raw), settings)


def tei_rerank_fields(body: dict[str, Any], settings: Settings) -> RerankRequest:
    """``parse_tei_rerank_request`` of a body already read (``POST /``'s)."""
    direction = body.get("truncation_direction")
    if direction is not None and (not isinstance(direction, str) or direction not in DIRECTIONS):
        raise InvalidInput("truncation_direction must be one of Left, left, Right, right",
                           param="truncation_direction")
    options = RerankOptions(
        normalize=not flag(body, "raw_scores", False),
        # null follows TEI's --auto-truncate, BGE_M3_TRUNCATE (it took false: windows)
        long_documents="truncate" if flag(body, "truncate", settings.truncate) else "max",
        truncation_direction=DIRECTIONS.get(direction or "right", "right"),
    )
    texts, _ = _documents(body.get("texts"), "texts", settings, objects=False,
                          whole=options.reads_document_ends, how=_TEI_HOW)
    return RerankRequest(_query(body), texts, options, None, flag(body, "return_text", False))
