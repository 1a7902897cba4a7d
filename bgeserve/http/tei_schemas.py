"""TEI's request bodies (text-embeddings-inference ``router/src/http/types.rs``) → validated
requests, or ``InvalidInput`` / ``TooLarge`` (which the TEI routes answer in TEI's shape).

As in TEI, unknown fields are ignored and ``null`` means the default. ``inputs`` takes the
shapes of bgeserve's ``input`` (token ids only with ``BGE_M3_ACCEPT_TOKEN_IDS``). What bge-m3
cannot do is refused with a message saying why, never ignored: ``prompt_name`` (bge-m3 has no
prompts) and ``dimensions`` other than its width. ``normalize: false`` alone is answered, with
the normalised vectors and a line in the log (``_answer_normalised``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from bgeserve.config import Settings
from bgeserve.errors import BgeServeError, InvalidInput, TooLarge
from bgeserve.http.rerank_schemas import RerankRequest, tei_rerank_fields
from bgeserve.http.schemas import OPTION_PARSERS, _as_int, flag, load_object, parse_input

DIRECTIONS = {"right": False, "Right": False, "left": True, "Left": True}


log = logging.getLogger("bgeserve.http")
_told_normalised = False


def _answer_normalised() -> None:
    """``normalize: false`` is answered with the L2-normalised vectors, said once in the log.
    The served graph's dense output is normalised inside it (the raw CLS vector is not one of
    its outputs), and a 422 failed every request of clients that send ``false`` by default
    (Haystack's TEI embedders); bge-m3's vectors are meant normalised (FlagEmbedding's
    default), cosine is unchanged and a dot product becomes the cosine."""
    global _told_normalised
    if not _told_normalised:
        _told_normalised = True
        log.warning("a TEI request sent normalize=false: answered with L2-normalised vectors "
                    "(bge-m3's dense output is normalised in the served graph); said once")


@dataclass(frozen=True)
class TeiEmbedRequest:
    """``/embed``, ``/embed_sparse``, ``/embed_all`` (and ``/similarity``'s parameters)."""

    inputs: list[str] | list[list[int]]
    truncate: bool
    left: bool = False  # truncation_direction: left
    dimensions: int | None = None
    sparse_top_k: int | None = None
    sparse_min_weight: float | None = None


@dataclass(frozen=True)
class TokenizeRequest:
    """``/tokenize``: texts only (TEI takes no ids here)."""

    inputs: list[str]
    add_special_tokens: bool = True


@dataclass(frozen=True)
class DecodeRequest:
    """``/decode``: one or more id sequences."""

    ids: list[list[int]]
    skip_special_tokens: bool = True


def _no_prompt(body: dict[str, Any]) -> None:
    if body.get("prompt_name") is not None:
        raise InvalidInput(
            "prompt_name is not supported: bge-m3 defines no prompts (it needs no instruction "
            "for queries or passages); omit prompt_name", param="prompt_name")


def _required(body: dict[str, Any], name: str) -> Any:
    if body.get(name) is None:
        raise InvalidInput(f"{name} is required", param=name)
    return body[name]


def embed_fields(body: dict[str, Any], settings: Settings, *, dense: bool = False,
                 sparse: bool = False) -> TeiEmbedRequest:
    """The fields shared by the embedding routes; ``dense`` adds ``normalize`` and
    ``dimensions``, ``sparse`` bgeserve's ``sparse_top_k`` and ``sparse_min_weight``."""
    _no_prompt(body)
    value = _required(body, "inputs")
    direction = body.get("truncation_direction")
    if direction is not None and (not isinstance(direction, str) or direction not in DIRECTIONS):
        raise InvalidInput("truncation_direction must be one of Left, left, Right, right",
                           param="truncation_direction")
    truncate = flag(body, "truncate", settings.truncate)
    # Without truncation nothing is cut, from either side (token ids with "left" were a 422).
    left = direction is not None and DIRECTIONS[direction] and truncate
    # A text cut from the left is tokenized whole (its last words are kept): limited here.
    inputs = parse_input(value, settings, "inputs", whole=left or not truncate)
    if left and inputs and not isinstance(inputs[0], str):
        raise InvalidInput("truncation_direction left needs texts; token-id inputs are cut "
                           "from the right", param="truncation_direction")
    extra: dict[str, Any] = {}
    if dense:
        if not flag(body, "normalize", True):
            _answer_normalised()
        if body.get("dimensions") is not None:
            extra["dimensions"] = OPTION_PARSERS["dimensions"]("dimensions", body["dimensions"])
            if extra["dimensions"] < 1:
                raise InvalidInput("dimensions should be positive", param="dimensions")
    if sparse:
        for name in ("sparse_top_k", "sparse_min_weight"):
            if body.get(name) is not None:
                extra[name] = OPTION_PARSERS[name](name, body[name])
    return TeiEmbedRequest(inputs=inputs, truncate=truncate, left=left, **extra)


def parse_embed(raw: bytes, settings: Settings, *, dense: bool = False,
                sparse: bool = False) -> TeiEmbedRequest:
    """An ``/embed`` (``dense``), ``/embed_sparse`` (``sparse``) or ``/embed_all`` body."""
    return embed_fields(load_object(raw), settings, dense=dense, sparse=sparse)


def similarity_inputs(body: dict[str, Any], settings: Settings) -> TeiEmbedRequest:
    """``/similarity``: ``{"inputs": {"source_sentence", "sentences"}, "parameters"?}`` as one
    batch, the source sentence first."""
    inputs = body.get("inputs")
    if not isinstance(inputs, dict) or not isinstance(inputs.get("source_sentence"), str):
        raise InvalidInput("inputs must be an object with source_sentence (a string) and "
                           "sentences (an array of strings)", param="inputs")
    sentences = inputs.get("sentences")
    if not isinstance(sentences, list):  # TEI's body type refuses it: 422, not "Empty"
        raise InvalidInput("inputs.sentences must be an array of strings",
                           param="inputs.sentences")
    if not sentences:
        raise InvalidInput("inputs.sentences must be a non-empty array of strings",
                           param="inputs.sentences", code="empty_input")
    if len(sentences) + 1 > settings.max_batch:  # the batch counts the source sentence too
        raise InvalidInput(
            f"inputs.sentences has {len(sentences)} sentences: with the source sentence, over "
            f"the maximum batch of {settings.max_batch} texts (BGE_M3_MAX_BATCH); split the "
            "request", param="inputs.sentences", code="batch_too_large")
    parameters = body.get("parameters")
    parameters = {} if parameters is None else parameters
    if not isinstance(parameters, dict):
        raise InvalidInput("parameters must be an object", param="parameters")
    try:
        return embed_fields({**parameters, "inputs": [inputs["source_sentence"], *sentences]},
                            settings)
    except BgeServeError as exc:
        raise as_similarity(exc) from None


def as_similarity(exc: BgeServeError) -> BgeServeError:
    """``exc`` naming a text as the similarity body does (``inputs[2]`` of the batch, the
    engine's ``input[2]``, is ``inputs.sentences[1]``: the source sentence comes first)."""
    found = re.fullmatch(r"inputs?\[(\d+)\]", exc.param or "")
    if found is None:
        return exc
    i = int(found.group(1))
    name = "inputs.source_sentence" if i == 0 else f"inputs.sentences[{i - 1}]"
    return type(exc)(exc.message.replace(exc.param or "", name), param=name, code=exc.code)


def parse_similarity(raw: bytes, settings: Settings) -> TeiEmbedRequest:
    """A ``/similarity`` body."""
    return similarity_inputs(load_object(raw), settings)


def parse_root(raw: bytes, settings: Settings) -> tuple[str, TeiEmbedRequest | RerankRequest]:
    """A ``POST /`` body by what it holds (TEI picks by the model it serves; this server
    serves both): ("similarity", its request) when ``inputs`` is an object, ("embed", an
    ``/embed`` request) when it has ``inputs``, ("rerank", a ``/rerank`` request) when it has
    a ``query`` or ``texts`` and no ``inputs``."""
    body = load_object(raw)
    if "inputs" not in body and ("query" in body or "texts" in body):
        return "rerank", tei_rerank_fields(body, settings)
    if isinstance(body.get("inputs"), dict):
        return "similarity", similarity_inputs(body, settings)
    return "embed", embed_fields(body, settings, dense=True)


def parse_tokenize(raw: bytes, settings: Settings) -> TokenizeRequest:
    """A ``/tokenize`` body."""
    body = load_object(raw)
    _no_prompt(body)
    value = _required(body, "inputs")
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise InvalidInput("inputs must be a string or an array of strings", param="inputs")
    parse_input(texts, settings, "inputs")  # the batch and length limits
    return TokenizeRequest(texts, flag(body, "add_special_tokens", True))


# Ids one /decode takes (as /tokenize answers at most MAX_TOKENIZE_TOKENS): 10M ids in 28.6 MiB
# took ~2 GiB of Python lists and strings per request, 35-42 s each, /health waiting behind.
MAX_DECODE_IDS = 1 << 20


def parse_decode(raw: bytes, settings: Settings) -> DecodeRequest:
    """A ``/decode`` body: ``ids`` is one sequence or an array of them."""
    body = load_object(raw)
    ids = _required(body, "ids")
    if not isinstance(ids, list):  # an object, a number, a string: not "empty"
        raise InvalidInput("ids must be an array of token ids (integers >= 0) or an array of "
                           "such arrays", param="ids")
    # As TEI (serde reads ``[]`` as one empty sequence), an empty sequence is its tokenizer's
    # 400 "Empty" (`input_ids` cannot be empty), in a batch too.
    sequences = ids if ids and isinstance(ids[0], list) else [ids]
    if len(sequences) > settings.max_batch:
        raise InvalidInput(f"batch of {len(sequences)} id sequences exceeds the maximum of "
                           f"{settings.max_batch} (BGE_M3_MAX_BATCH); split the request",
                           param="ids", code="batch_too_large")
    total = sum(len(seq) if isinstance(seq, list) else 1 for seq in sequences)
    if total > MAX_DECODE_IDS:  # counted before any id is looked at
        raise TooLarge(f"this request holds {total} token ids, more than the {MAX_DECODE_IDS} "
                       "one /decode answers; send fewer per request", param="ids")
    out: list[list[int]] = []
    for i, seq in enumerate(sequences):
        if seq == []:
            where = "ids" if seq is ids else f"ids[{i}]"
            raise InvalidInput(f"{where} is empty: give at least one token id", param=where,
                               code="empty_input")
        # JSON Schema's integers: 3.0 is one (as everywhere else in the API)
        ints = [_as_int(t) for t in seq] if isinstance(seq, list) else [None]
        bad = next((j for j, t in enumerate(ints) if t is None or t < 0), None)
        if bad is not None:
            # The item itself: ids[j] of one sequence, ids[i][j] of a batch (ids[i] when the
            # batch's item is no array).
            where = (f"ids[{bad}]" if seq is ids else
                     f"ids[{i}][{bad}]" if isinstance(seq, list) else f"ids[{i}]")
            raise InvalidInput(f"{where} is no token id: ids must be an array of token ids "
                               "(integers >= 0) or an array of such arrays", param=where)
        out.append([t for t in ints if t is not None])
    return DecodeRequest(out, flag(body, "skip_special_tokens", True))
