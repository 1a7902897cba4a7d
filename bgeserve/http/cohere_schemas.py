"""Cohere's embed bodies (``POST /v1/embed``, ``POST /v2/embed``: the Cohere SDK's
``embed``, LangChain's ``CohereEmbeddings``) → validated requests, or
``InvalidInput`` / ``ModelNotFound`` / ``TooLarge``.

Texts only (bge-m3 embeds no images). ``input_type`` is accepted and changes nothing: bge-m3
embeds queries and documents alike, with no instruction. What bge-m3 cannot give is refused
with a message saying why, never ignored: ``int8`` / ``uint8`` embeddings (Cohere's models are
trained for them; a scale for bge-m3's would be made up, or depend on the batch), another
``output_dimension`` than its width, a per-request ``max_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bgeserve.config import Settings
from bgeserve.errors import InvalidInput
from bgeserve.http.schemas import OPTION_PARSERS, check_model, load_object, parse_input

INPUT_TYPES = ("search_document", "search_query", "classification", "clustering")
EMBEDDING_TYPES = ("float", "base64", "binary", "ubinary")
# Cohere's truncate → (truncate, cut from the left)
TRUNCATE = {"END": (True, False), "START": (True, True), "NONE": (False, False)}


@dataclass(frozen=True)
class CohereEmbedRequest:
    """A validated embed body: ``truncate`` / ``left`` from Cohere's ``truncate``,
    ``dimensions`` its ``output_dimension``."""

    texts: list[str]
    types: tuple[str, ...] | None  # embedding_types as sent (v1 without: a bare float list)
    truncate: bool
    left: bool
    dimensions: int | None = None


def _refuse_unless_null(body: dict[str, Any], name: str, why: str) -> None:
    if body.get(name) is not None:
        raise InvalidInput(f"{name} is not supported: {why}", param=name)


def _types(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        raise InvalidInput("embedding_types must be a non-empty array of strings",
                           param="embedding_types")
    for i, kind in enumerate(value):
        if kind not in EMBEDDING_TYPES:
            why = ("bge-m3 has no trained integer quantization (a scale would be made up)"
                   if kind in ("int8", "uint8") else "unknown type")
            raise InvalidInput(f"embedding_types[{i}] {kind!r} is not supported ({why}): use "
                               f"{', '.join(EMBEDDING_TYPES)}", param=f"embedding_types[{i}]")
    return tuple(dict.fromkeys(value))


def parse_cohere_embed(raw: bytes, settings: Settings,
                       model_ids: tuple[str, ...]) -> CohereEmbedRequest:
    """A ``/v1/embed`` or ``/v2/embed`` body."""
    body = load_object(raw)
    check_model(body.get("model"), model_ids)
    _refuse_unless_null(body, "images", "bge-m3 embeds text only; send texts")
    _refuse_unless_null(body, "inputs", "send the texts as texts (bge-m3 embeds text only)")
    _refuse_unless_null(body, "max_tokens", "texts are cut at the server's maximum sequence "
                        "length (BGE_M3_MAX_SEQ_LENGTH) only; omit max_tokens")
    texts = body.get("texts")
    if texts is None:
        raise InvalidInput("texts is required", param="texts")
    if not isinstance(texts, list):
        raise InvalidInput("texts must be an array of strings", param="texts")
    for i, text in enumerate(texts):  # named as every other route names a bad item
        if not isinstance(text, str):
            raise InvalidInput(f"texts[{i}] must be a string: texts must be an array of strings",
                               param=f"texts[{i}]")
    input_type = body.get("input_type")
    if input_type is not None and input_type not in INPUT_TYPES:
        raise InvalidInput(f"input_type must be one of {', '.join(INPUT_TYPES)} (bge-m3 embeds "
                           "text only, queries and documents alike)", param="input_type")
    mode = body.get("truncate")
    if mode is None:
        truncate, left = settings.truncate, False
    elif isinstance(mode, str) and mode in TRUNCATE:
        truncate, left = TRUNCATE[mode]
    else:
        raise InvalidInput("truncate must be one of NONE, START, END", param="truncate")
    types = _types(body.get("embedding_types"))
    dimensions = None
    if body.get("output_dimension") is not None:
        dimensions = OPTION_PARSERS["dimensions"]("output_dimension", body["output_dimension"])
    # A text cut from the left, or not cut, is tokenized whole: limited here (as TEI's).
    parse_input(texts, settings, "texts", whole=left or not truncate)  # its limits
    return CohereEmbedRequest(texts=texts, types=types, truncate=truncate, left=left,
                              dimensions=dimensions)
