"""Request bodies: raw bytes → a validated ``EmbedRequest``, or ``InvalidInput`` / ``TooLarge``.

Pure and synchronous (the handler runs big bodies on a thread). Every schema error is a 400
whose ``param`` names the field at fault (``input[3]``, ``sparse_top_k``); a text over
``max_text_chars`` that would be tokenized whole (not truncated) is a 413. Fields an endpoint
does not read are ignored, as OpenAI clients send extras.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from bgeserve.config import Settings
from bgeserve.errors import InvalidInput, TooLarge, surrogate_error
from bgeserve.http.errors import ModelNotFound
from bgeserve.results import EmbedOptions
from bgeserve.vocab import VOCAB_SIZE  # bge-m3's; the engine checks the loaded tokenizer's

OUTPUTS = ("dense", "sparse", "colbert")
_INPUT_SHAPES = (
    "a string, an array of strings, an array of token ids, or an array of arrays of token ids"
)


@dataclass(frozen=True)
class EmbedRequest:
    """A validated embedding request (defaults are the documented ones)."""

    inputs: list[str] | list[list[int]]
    outputs: frozenset[str]
    truncate: bool
    encoding_format: str = "float"
    dimensions: int | None = None
    sparse_top_k: int | None = None
    sparse_min_weight: float | None = None
    sparse_format: str = "indices"
    sparse_empty: str = "keep"
    colbert_dtype: str = "float32"

    @property
    def options(self) -> EmbedOptions:
        """What the service should compute."""
        return EmbedOptions(
            dense="dense" in self.outputs,
            sparse="sparse" in self.outputs,
            colbert="colbert" in self.outputs,
            truncate=self.truncate,
        )


@dataclass(frozen=True)
class Endpoint:
    """What one embedding route reads and returns."""

    item_object: str  # the per-item ``object`` field
    default_outputs: tuple[str, ...]
    options: tuple[str, ...] = field(default=())  # optional fields read besides the common ones


DENSE = Endpoint("embedding", ("dense",), ("encoding_format", "dimensions"))
_SPARSE_OPTIONS = ("sparse_top_k", "sparse_min_weight", "sparse_format", "sparse_empty")
SPARSE = Endpoint("sparse_embedding", ("sparse",), _SPARSE_OPTIONS)
BOTH = Endpoint(
    "embedding",
    ("dense", "sparse"),
    ("encoding_format", "dimensions", *_SPARSE_OPTIONS, "outputs", "colbert_dtype"),
)


def flag(body: dict[str, Any], name: str, default: bool) -> bool:
    """``body[name]`` as a JSON boolean (absent or null: ``default``); else InvalidInput."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidInput(f"{name} must be true or false", param=name)
    return value


def _as_int(value: Any) -> int | None:
    """``value`` as an int if JSON Schema calls it an integer (``3``, ``3.0``), else None."""
    if type(value) is int:  # not isinstance: bool is an int subclass, and JSON true is no number
        return value
    if type(value) is float and value.is_integer():
        return int(value)
    return None


def _choice(*allowed: str) -> Callable[[str, Any], str]:
    def parse(name: str, value: Any) -> str:
        if value not in allowed:
            raise InvalidInput(f"{name} must be one of {', '.join(map(repr, allowed))}", param=name)
        return value

    return parse


def _positive_int(name: str, value: Any) -> int:
    number = _as_int(value)
    if number is None or number < 1:
        raise InvalidInput(f"{name} must be an integer >= 1", param=name)
    return number


def _weight(name: str, value: Any) -> float:
    if type(value) not in (int, float) or not value >= 0:
        raise InvalidInput(f"{name} must be a number >= 0", param=name)
    return float(value)


def _dimensions(name: str, value: Any) -> int:
    number = _as_int(value)
    if number is None:
        raise InvalidInput(f"{name} must be an integer", param=name)
    return number


def check_dimensions(requested: int | None, width: int, name: str = "dimensions") -> None:
    """``dimensions`` (Cohere's: ``output_dimension``, passed as ``name``) may only repeat the
    model's own width (1,024 for bge-m3): it is not trained for truncated vectors. Checked
    against the loaded model, so a smaller test model with bge-m3's layout is held to its own
    width."""
    if requested is not None and requested != width:
        raise InvalidInput(
            f"{name}={requested} is not supported: this model returns {width}-dimensional "
            "vectors and bge-m3 is not trained for truncated (Matryoshka) vectors; omit "
            f"{name} or pass {width}",
            param=name,
            code="unsupported_dimensions",
        )


def _outputs(name: str, value: Any) -> frozenset[str]:
    if not isinstance(value, list) or not value:
        raise InvalidInput(f"{name} must be a non-empty array of {', '.join(OUTPUTS)}", param=name)
    for i, item in enumerate(value):
        if item not in OUTPUTS:
            raise InvalidInput(
                f"{name}[{i}] must be one of {', '.join(OUTPUTS)}", param=f"{name}[{i}]"
            )
    return frozenset(value)


OPTION_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "encoding_format": _choice("float", "base64"),
    "dimensions": _dimensions,
    "sparse_top_k": _positive_int,
    "sparse_min_weight": _weight,
    "sparse_format": _choice("indices", "tokens", "dict"),
    "sparse_empty": _choice("keep", "omit"),
    "outputs": _outputs,
    "colbert_dtype": _choice("float32", "float16"),
}


def _token_ids(ids: list[Any], param: str) -> list[int]:
    if not ids:
        raise InvalidInput(f"{param} is an empty array of token ids", param=param)
    out = ids
    for j, token in enumerate(ids):
        number = _as_int(token)
        if number is None:
            raise InvalidInput(f"{param} must hold only integer token ids", param=f"{param}[{j}]")
        # Only what no model of bge-m3's layout could take: the loaded model's own vocabulary
        # (a random test model's may be smaller) is the engine's check, which names its size.
        if number < 0:
            raise InvalidInput(f"token id {number} is negative: token ids start at 0",
                               param=f"{param}[{j}]")
        if number >= VOCAB_SIZE:
            # Not "the vocabulary of 250002": the served model's may be smaller (QA: a 3,000-id
            # model's refusal named 250,002 as its size).
            raise InvalidInput(f"token id {number} is past any vocabulary of bge-m3's layout "
                               f"(at most {VOCAB_SIZE} ids; the served model's may have fewer)",
                               param=f"{param}[{j}]")
        if number is not token:  # 7.0 is an integer to JSON Schema; the service gets ints
            out = list(ids) if out is ids else out
            out[j] = number
    return out


TOKEN_IDS_REFUSED = (
    "{name} holds token ids, which this server refuses by default: clients such as LangChain's "
    "OpenAIEmbeddings send ids of another tokenizer (tiktoken's cl100k_base), and bge-m3 would "
    "embed them as the wrong tokens, silently. Send the texts as strings (LangChain: "
    "OpenAIEmbeddings(..., check_embedding_ctx_length=False)), or, if your client sends "
    "bge-m3's own (XLM-RoBERTa) token ids, start the server with BGE_M3_ACCEPT_TOKEN_IDS=1"
)


def parse_input(value: Any, settings: Settings, name: str = "input", *,
                whole: bool = True) -> list[str] | list[list[int]]:
    """``input`` (TEI: ``inputs``, passed as ``name``) as a batch: a list of texts or a list of
    token-id lists (only with ``BGE_M3_ACCEPT_TOKEN_IDS``). ``whole``: the texts are
    tokenized whole (not truncated, or cut from the left), so one over ``max_text_chars`` is
    a 413 here; a text truncated from the right is bounded by the engine (it keeps only its
    leading words, where that is exact)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise InvalidInput(f"{name} must be {_INPUT_SHAPES}", param=name)
    if not value:
        raise InvalidInput(f"{name} must not be empty", param=name, code="empty_input")
    first = value[0]
    if isinstance(first, list) and first and _as_int(first[0]) is None:
        # Nested strings ([["a"]]) and the like are no token ids: say what is wrong with them
        # rather than explain the token-id setting.
        raise InvalidInput(f"{name}[0] must be a string or an array of integer token ids "
                           f"({name}[0][0] is not an integer): {name} must be {_INPUT_SHAPES}",
                           param=f"{name}[0][0]")
    ids = _as_int(first) is not None or isinstance(first, list)
    if ids and not settings.accept_token_ids:
        raise InvalidInput(TOKEN_IDS_REFUSED.format(name=name), param=name,
                           code="token_ids_not_accepted")
    if _as_int(value[0]) is not None:
        return [_token_ids(value, name)]
    if len(value) > settings.max_batch:
        raise InvalidInput(
            f"batch of {len(value)} inputs exceeds the maximum of {settings.max_batch} "
            "(BGE_M3_MAX_BATCH); split the request",
            param=name,
            code="batch_too_large",
        )
    if ids:
        batch = []
        for i, item in enumerate(value):
            if not isinstance(item, list):
                raise InvalidInput(f"{name}[{i}] must be an array of token ids",
                                   param=f"{name}[{i}]")
            batch.append(_token_ids(item, f"{name}[{i}]"))
        return batch
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise InvalidInput(
                f"{name}[{i}] must be a string: {name} must be {_INPUT_SHAPES}",
                param=f"{name}[{i}]",
            )
        if whole and len(text) > settings.max_text_chars:
            raise TooLarge(
                f"{name}[{i}] has {len(text)} characters, over the limit of "
                f"{settings.max_text_chars} (BGE_M3_MAX_TEXT_CHARS)",
                param=f"{name}[{i}]",
            )
    return value


def check_model(value: Any, model_ids: Collection[str]) -> None:
    """``model`` may be absent; if given it must name bge-m3 or a configured alias."""
    if value is None:
        return
    if not isinstance(value, str):
        raise InvalidInput("model must be a string", param="model")
    if value not in model_ids:
        raise ModelNotFound(
            f"the model {value!r} does not exist; this server serves {', '.join(model_ids)}",
            param="model",
        )


def load_object(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object; bad UTF-8, bad JSON and too-deep nesting are all 400s."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:  # also raised for recursion past orjson's limit
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:  # orjson words it as "surrogates not allowed"
            raise InvalidInput(f"request body is not valid UTF-8 (byte {bad.start}: "
                               f"{raw[bad.start:bad.start + 1]!r}); send UTF-8 JSON",
                               code="invalid_json") from None
        if "surrogate" in str(exc):  # valid JSON, but a string is no text: name which one
            raise _surrogate(raw) or InvalidInput(f"request body is not valid JSON: {exc}",
                                                  code="invalid_json") from None
        raise InvalidInput(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidInput("request body must be a JSON object", code="invalid_json")
    return body


def _surrogate(raw: bytes) -> InvalidInput | None:
    """The refusal naming the field of ``raw`` that holds a lone surrogate (``input[1]``),
    which orjson refuses to decode and the standard library decodes; None if none is found."""
    try:
        body = json.loads(raw)
        return surrogate_error(body, "", code="invalid_json")  # a body orjson refused: TEI's 400
    # Both recurse per level: Python's limit comes before orjson's 1,024 levels (a body nested
    # ~960 deep with a surrogate in it was a RecursionError, a 500): then no name is given.
    except (ValueError, RecursionError):
        return None


def parse_embed_request(
    raw: bytes, endpoint: Endpoint, settings: Settings, model_ids: Collection[str]
) -> EmbedRequest:
    """Validate a body for ``endpoint``; raises ``InvalidInput``/``ModelNotFound``/``TooLarge``."""
    body = load_object(raw)
    check_model(body.get("model"), model_ids)
    if "input" not in body:
        raise InvalidInput("input is required", param="input")
    truncate = flag(body, "truncate", settings.truncate)
    request = EmbedRequest(
        inputs=parse_input(body["input"], settings, whole=not truncate),
        outputs=frozenset(endpoint.default_outputs),
        truncate=truncate,
    )
    changes = {
        name: OPTION_PARSERS[name](name, body[name])
        for name in endpoint.options
        if body.get(name) is not None
    }
    return replace(request, **changes)
