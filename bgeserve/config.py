"""Settings: every ``BGE_M3_*`` variable, read once, cast and range-checked.

``Settings.from_env(environ)`` takes any mapping, so tests pass a dict. Nothing else in the
package reads ``os.environ``. Invalid values fail fast with a ``ConfigError`` that names the
variable and the allowed values.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from bgeserve.cgroup import usable_cpus
from bgeserve.errors import ConfigError

T = TypeVar("T")

# The names `model` may give bge-m3 by, whatever BGE_M3_MODEL_ALIASES adds.
M3_MODEL_IDS = ("bge-m3", "BAAI/bge-m3")
VARIANTS = ("fp32", "fp16", "int8", "bf16", "ov-int8")
OPENVINO_VARIANTS = ("bf16", "ov-int8")  # OpenVINO IRs of a `bgeserve export`
EXECUTION_PROVIDERS = ("cpu", "cuda", "tensorrt", "coreml", "openvino")
LOG_FORMATS = ("auto", "json", "text", "pretty")
# Request bodies in progress when BGE_M3_MAX_INFLIGHT_MB is unset (`bgeserve serve` sets it
# from the memory it has: cli.py).
DEFAULT_INFLIGHT_MB = 256
MAX_POSITIONS = 8192  # bge-m3: 8194 position embeddings minus the padding offset of 2
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use 1/true/yes or 0/false/no", param=name)


# The largest integer a setting may hold: every JSON reader keeps it exact, and /health,
# /info and /openapi.json write them (orjson refuses 2**64 and up: each poll was a 500).
MAX_INT = 2**53


def _number(cast: Callable[[str], T], lo: float | None = None, hi: float | None = None):
    if cast is int and hi is None:
        hi = MAX_INT
    bounds = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"

    def parse(name: str, raw: str) -> T:
        text = raw.strip()
        try:
            # int() and float() also take "1_0" and other scripts' digits ("٢"): not numbers
            # anyone writes in a variable on purpose.
            if not text.isascii() or "_" in text:
                raise ValueError(text)
            value = cast(text)
        except ValueError:
            raise ConfigError(
                f"{name}={raw!r} is not a valid {cast.__name__} in {bounds}", param=name
            ) from None
        # nan slips through every range check; inf crashes later (int(inf), Condition.wait(inf)).
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}={raw!r} is not a finite number", param=name)
        # T is int or float here (the casts _number is used with); mypy cannot see that.
        if (lo is not None and value < lo) or (hi is not None and value > hi):  # type: ignore[operator]
            raise ConfigError(f"{name}={raw!r} is out of range {bounds}", param=name)
        return value

    parse.allowed = bounds  # type: ignore[attr-defined]  # `serve --help` shows it
    return parse


# Durations: past threading.TIMEOUT_MAX (~292 years) a wait raises OverflowError in the thread
# that waits (workers died in a loop, the shutdown failed); 1e9 s (~31 years) is the most a
# deadline added to the clock stays clear of it; 0 = none.
MAX_SECONDS = 1e9
_SECONDS = _number(float, 0.0, MAX_SECONDS)


def _period(lo: float):
    """Seconds of a period: 0 = off, else at least ``lo`` (a heartbeat every 0.001 s wrote
    1,000 log lines a second; sessions unloaded after 0.01 s idle reload for every request)."""
    def parse(name: str, raw: str) -> float:
        value = _SECONDS(name, raw)
        if 0 < value < lo:
            raise ConfigError(f"{name}={raw!r} is too short: 0 (off) or at least {lo:g} s",
                              param=name)
        return value

    parse.allowed = f"0 or [{lo}, {MAX_SECONDS}]"  # type: ignore[attr-defined]
    return parse


# A doc that says what an unset variable means ("unset: ...", "default: ...", "(default ...").
SAYS_DEFAULT = re.compile(r"unset:|default:|\(default")


def _choice(*allowed: str):
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in allowed:
            raise ConfigError(f"{name}={raw!r} must be one of {', '.join(allowed)}", param=name)
        return value

    parse.allowed = "|".join(allowed)  # type: ignore[attr-defined]  # `serve --help` shows it
    return parse


def _text(name: str, raw: str) -> str:
    return raw.strip()


_SHAPE = re.compile(r"\s*([1-9]\d*)\s*[xX]\s*([1-9]\d*)\s*")


def _shapes(name: str, raw: str) -> str:
    """``BxL,BxL`` (empty: the default grid). A token that is no shape stops the start, as
    every other bad value does (it was skipped with a warning: QA)."""
    for token in (t for t in raw.split(",") if t.strip()):
        if _SHAPE.fullmatch(token) is None:
            raise ConfigError(f"{name}: {token.strip()!r} is not a shape BxL (texts x tokens, "
                              "both >= 1, e.g. 8x512)", param=name)
    return raw.strip()


def _path(name: str, raw: str) -> Path:
    return Path(raw.strip()).expanduser()


def _keys(name: str, raw: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in raw.split(",") if k.strip())


def parse_bind(name: str, raw: str) -> str:
    """``HOST:PORT`` with a port in 1-65535; ``name`` (the variable or flag) in the error."""
    host, sep, port = raw.strip().rpartition(":")
    # isascii: str.isdigit() accepts "²", which int() then rejects with a bare ValueError.
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ConfigError(f"{name}={raw!r} must be HOST:PORT with a port in [1, 65535], e.g. "
                          "0.0.0.0:8081", param=name)
    return raw.strip()


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/bgeserve`` (an absolute XDG_CACHE_HOME), else ``~/.cache/bgeserve``:
    somewhere any user can write, unlike the reference server's ``/cache``."""
    xdg = environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "bgeserve"
    return Path("~/.cache/bgeserve")  # expanded when Settings is made (__post_init__)


def _var(env: str, parse: Callable[[str, str], Any], default: Any, doc: str) -> Any:
    """A settings field bound to one environment variable (kept in the field metadata)."""
    return field(default=default, metadata={"env": env, "parse": parse, "doc": doc})


@dataclass(frozen=True)
class Settings:
    """Every tunable of bgeserve. Build with ``Settings.from_env(os.environ)``."""

    # model
    model_path: Path | None = _var(
        "BGE_M3_MODEL_PATH", _path, None,
        "local model directory: a `bgeserve export` or a Hugging Face snapshot")
    variant: str = _var("BGE_M3_MODEL", _choice(*VARIANTS), "fp32",
                        "model variant (bf16, ov-int8: OpenVINO; "
                        "unset: the fastest keeping dense cos >= 0.999 here, see "
                        "runtime/select.py)")
    cache_dir: Path = _var("BGE_M3_CACHE_DIR", _path, Path("~/.cache/bgeserve"),
                           "prepared graphs, probe coefficients and TensorRT engines "
                           "(default $XDG_CACHE_HOME/bgeserve, else ~/.cache/bgeserve; hub "
                           "downloads go to the Hugging Face cache: HF_HUB_CACHE / HF_HOME)")
    prepare: bool = _var("BGE_M3_PREPARE", _bool, True,
                         "build bgeserve's fast graphs (in-graph heads, bounded attention, "
                         "int8, bf16) from a hub snapshot once, cached; 0 = serve it as it is")
    offline: bool = _var("HF_HUB_OFFLINE", _bool, False, "never contact the Hugging Face hub")
    max_seq_length: int = _var("BGE_M3_MAX_SEQ_LENGTH", _number(int, 2, MAX_POSITIONS),
                               MAX_POSITIONS, "tokens per text, special tokens included")
    truncate: bool = _var("BGE_M3_TRUNCATE", _bool, True,
                          "default for requests: truncate over-long texts (else 413)")
    model_aliases: tuple[str, ...] = _var("BGE_M3_MODEL_ALIASES", _keys, (),
                                          "extra model names accepted besides bge-m3")
    # execution
    execution_provider: str = _var("BGE_M3_EP", _choice(*EXECUTION_PROVIDERS), "cpu",
                                   "cpu|cuda|tensorrt|coreml (ONNX Runtime) or openvino")
    workers: int = _var("BGE_M3_WORKERS", _number(int, 1, 256), 1,
                        "inference sessions (each runs on BGE_M3_INTRA_THREADS threads)")
    intra_threads: int = _var("BGE_M3_INTRA_THREADS", _number(int, 0, 1024), 0,
                              "threads per session; 0 = usable CPUs (affinity, cgroup CPU "
                              "quota) / workers")
    max_chunk: int = _var("BGE_M3_MAX_CHUNK", _number(int, 1, 4096), 64,
                          "texts per session.run() at most (a latency cap)")
    max_chunk_tokens: int | None = _var("BGE_M3_MAX_CHUNK_TOKENS", _number(int, 1), None,
                                        "padded tokens per session.run() at most (a text "
                                        "longer than this runs alone); default: the backend's "
                                        "measured best, 256 on ONNX Runtime CPU, 1024 on "
                                        "OpenVINO, 8192 on CUDA and TensorRT")
    pad_multiple: int | None = _var("BGE_M3_PAD_MULTIPLE", _number(int, 1, 8192), None,
                                    "round each chunk's padded length up to a multiple of "
                                    "this (fewer distinct shapes; never past "
                                    "BGE_M3_MAX_SEQ_LENGTH); default: 32 on CUDA and "
                                    "TensorRT, 1 (none) on CPUs")
    cross_request_batching: bool = _var("BGE_M3_CROSS_REQUEST_BATCHING", _bool, True,
                                        "pack texts of concurrent requests together")
    # memory
    available_memory_bytes: int | None = _var(
        "BGE_M3_AVAILABLE_MEMORY_BYTES", _number(int, 1), None,
        "override detected memory (cgroup v2 -> v1 -> /proc/meminfo)")
    memory_safety_factor: float = _var("BGE_M3_MEMORY_SAFETY_FACTOR", _number(float, 0.1, 1.0),
                                       0.7, "fraction of the free memory given to workspace")
    token_budget: int | None = _var("BGE_M3_TOKEN_BUDGET", _number(int, 1), None,
                                    "pin max workspace bytes per worker (disables the probe)")
    cost_model_a: float | None = _var("BGE_M3_COST_MODEL_A", _number(float, 0.0), None,
                                      "bytes per token position (with _B; disables the probe)")
    cost_model_b: float | None = _var("BGE_M3_COST_MODEL_B", _number(float, 0.0), None,
                                      "bytes per token position squared")
    disable_auto_budget: bool = _var("BGE_M3_DISABLE_AUTO_BUDGET", _bool, False,
                                     "conservative cost model, no probe")
    disable_probe_cache: bool = _var("BGE_M3_DISABLE_PROBE_CACHE", _bool, False,
                                     "always probe; never read or write the cache")
    onnx_batch_size: int | None = _var("BGE_M3_ONNX_BATCH_SIZE", _number(int, 1, 4096), None,
                                       "deprecated: translated to BGE_M3_TOKEN_BUDGET (the "
                                       "workspace of that many 512-token texts) and "
                                       "BGE_M3_MAX_CHUNK; either, set, wins")
    # http
    bind: str = _var("BGE_M3_BIND", parse_bind, "0.0.0.0:8081", "HOST:PORT to listen on")
    # uvicorn's own 5 s closed idle connections just as proxies (nginx keeps them 60 s, cloud
    # load balancers 60-600 s) and pooled clients (httpx: 5 s) sent on them: 502s and resets.
    keep_alive_secs: float = _var("BGE_M3_KEEP_ALIVE_SECS", _number(float, 1.0, MAX_SECONDS),
                                  75.0, "idle seconds before a kept-alive connection is "
                                  "closed: above the idle timeout of the proxy or load "
                                  "balancer in front")
    max_batch: int = _var("BGE_M3_MAX_BATCH", _number(int, 1, 100_000), 2048,
                          "texts per request (OpenAI's own limit; LangChain sends 1,000)")
    accept_token_ids: bool = _var("BGE_M3_ACCEPT_TOKEN_IDS", _bool, False,
                                  "accept token-id input (bge-m3 ids); off: 400, as clients "
                                  "such as LangChain send ids of another tokenizer")
    max_body_bytes: int = _var("BGE_M3_MAX_BODY_BYTES", _number(int, 1024), 32 * 1024 * 1024,
                               "request body limit")
    max_text_chars: int = _var("BGE_M3_MAX_TEXT_CHARS", _number(int, 1), 131_072,
                               "characters of a text tokenized whole (a longer one truncated "
                               "from the right keeps its leading words, where exact)")
    max_colbert_mb: int | None = _var("BGE_M3_MAX_COLBERT_MB", _number(int, 1, MAX_INT >> 20),
                                      None,
                                      "ColBERT output (float32 MiB) of a request before 413, "
                                      "and of the requests in progress together (others wait)"
                                      " (unset: 1/20 of the memory, <= 512)")
    max_inflight_mb: int | None = _var(
        "BGE_M3_MAX_INFLIGHT_MB", _number(int, 1, MAX_INT >> 20), None,
        "MiB of request bodies in progress (and answers not yet taken by their clients) before "
        "429 (unset: 1/8 of the memory, <= 512; "
        "never below BGE_M3_MAX_BODY_BYTES, so the largest body fits when nothing else is held)")
    api_keys: tuple[str, ...] = _var("BGE_M3_API_KEY", _keys, (),
                                     "comma-separated bearer keys; empty = no auth")
    metrics_auth: bool = _var("BGE_M3_METRICS_AUTH", _bool, False,
                              "require the API key on /metrics too (needs BGE_M3_API_KEY)")
    cors_allow_origins: tuple[str, ...] = _var(
        "BGE_M3_CORS_ALLOW_ORIGINS", _keys, ("*",),
        "comma-separated origins a browser page may call from, as TEI's --cors-allow-origin "
        "(default: * = any); empty = no CORS headers")
    tls_cert_file: Path | None = _var("BGE_M3_TLS_CERT_FILE", _path, None,
                                      "PEM certificate (chain): serve HTTPS")
    tls_key_file: Path | None = _var("BGE_M3_TLS_KEY_FILE", _path, None,
                                     "PEM private key of the certificate (unset: in that file)")
    tls_client_ca_file: Path | None = _var("BGE_M3_TLS_CLIENT_CA_FILE", _path, None,
                                           "PEM CA certificates: require client certificates "
                                           "they signed (mutual TLS)")
    # serving
    batch_delay_ms: float = _var("BGE_M3_BATCH_DELAY_MS", _number(float, 0.0, 10_000.0), 0.0,
                                 "coalescing window after the first arrival")
    max_queue_tokens: int = _var("BGE_M3_MAX_QUEUE_TOKENS", _number(int, 1), 1_000_000,
                                 "tokens waiting before 429")
    cache_mb: int | None = _var("BGE_M3_CACHE_MB", _number(int, 0, 1 << 20), None,
                                "MiB of embeddings kept for repeated texts (answered without "
                                "running the model); 0 = off (unset: 1/16 of the memory, "
                                "<= 128). Off for int8 unless BGE_M3_MAX_CHUNK=1: its vectors "
                                "move with their batch-mates")
    request_timeout_secs: float = _var("BGE_M3_REQUEST_TIMEOUT_SECS",
                                       _SECONDS, 300.0, "per-request deadline; 0 = none")
    idle_timeout_secs: float = _var("BGE_M3_IDLE_TIMEOUT_SECS", _period(1.0), 300.0,
                                    "unload sessions after this idle time; 0 = never")
    shutdown_timeout_secs: float = _var("BGE_M3_SHUTDOWN_TIMEOUT_SECS", _SECONDS,
                                        30.0, "SIGTERM: in-flight work gets this long, then what "
                                        "is left is answered 503; 0 = no bound")
    # rerank (docs/rerank.md)
    rerank_model_path: Path | None = _var(
        "BGE_M3_RERANK_MODEL_PATH", _path, None,
        "a reranker beside bge-m3: a `bgeserve export` of bge-reranker-v2-m3, or a snapshot "
        "with onnx/model.onnx")
    rerank: bool = _var("BGE_M3_RERANK", _bool, False,
                        "load BAAI/bge-reranker-v2-m3 (pinned commit, its hub ONNX graph) beside "
                        "bge-m3 when BGE_M3_RERANK_MODEL_PATH is unset")
    # ov-int8 is made for bge-m3 only (export/main.py): accepted here, it failed at load.
    rerank_variant: str = _var("BGE_M3_RERANK_VARIANT",
                               _choice(*(v for v in VARIANTS if v != "ov-int8")), "fp32",
                               "the reranker's variant: fp32|fp16|int8|bf16 (int8 moves "
                               "rankings: docs/rerank.md)")
    rerank_max_length: int = _var("BGE_M3_RERANK_MAX_LENGTH", _number(int, 16, MAX_POSITIONS),
                                  MAX_POSITIONS, "tokens per (query, document) pair or window, "
                                  "special tokens included")
    # Not BGE_M3_MODEL_ALIASES: those name bge-m3, whose own scores a rerank request naming
    # them gets (a client's default reranker name aliased there silently changed the scorer).
    rerank_model_aliases: tuple[str, ...] = _var(
        "BGE_M3_RERANK_MODEL_ALIASES", _keys, (),
        "extra model names that name the reranker (e.g. a client's default, "
        "rerank-english-v3.0), besides bge-reranker-v2-m3")
    rerank_normalize: bool = _var(
        "BGE_M3_RERANK_NORMALIZE", _bool, False,
        "the default of `normalize` on /v1/rerank and /v2/rerank: true gives the "
        "cross-encoder's sigmoid scores in [0, 1], as Cohere's and Jina's APIs do (their "
        "clients cannot ask); false FlagReranker's raw logits")
    rerank_workers: int | None = _var("BGE_M3_RERANK_WORKERS", _number(int, 1, 256), None,
                                      "the reranker's sessions (default: BGE_M3_WORKERS)")
    rerank_memory_share: float = _var("BGE_M3_RERANK_MEMORY_SHARE", _number(float, 0.05, 0.95),
                                      0.5, "the reranker's share of the memory both models "
                                      "leave free (workspace for its windows)")
    # operations
    log_format: str = _var("BGE_M3_LOG_FORMAT", _choice(*LOG_FORMATS), "auto",
                           "log lines (auto: json unless the log goes to a terminal)")
    log_level: str = _var("BGE_M3_LOG_LEVEL", _choice("debug", "info", "warning", "error"),
                          "info", "log level")
    heartbeat_secs: float = _var("BGE_M3_HEARTBEAT_SECS", _period(1.0), 60.0,
                                 "heartbeat log period; 0 = off")
    # gpu
    gpu_count: int | None = _var("BGE_M3_GPU_COUNT", _number(int, 1, 1024), None,
                                 "GPUs (default: /proc/driver/nvidia/gpus)")
    gpu_vram_budget_bytes: int | None = _var("BGE_M3_GPU_VRAM_BUDGET_BYTES", _number(int, 1),
                                             None, "workspace ceiling on GPU EPs")
    trt_warmup_shapes: str = _var("BGE_M3_TRT_WARMUP_SHAPES", _shapes, "",
                                  "BxL,BxL shapes to pre-build (tensorrt; unset: 24 shapes, "
                                  "1-32 texts x 128-8192 tokens, those past "
                                  "BGE_M3_MAX_SEQ_LENGTH left out)")
    warmup_only: bool = _var("BGE_M3_WARMUP_ONLY", _bool, False,
                             "build TensorRT engines, then exit")
    allow_cpu_fallback: bool = _var("BGE_M3_ALLOW_CPU_FALLBACK", _bool, False,
                                    "use the CPU when the requested GPU EP is unavailable")

    # Not variables: which ones the environment set (None: the fields were given in code, and
    # count as set), and how the variant was decided (``service.plan.resolve`` fills it in).
    explicit: frozenset[str] | None = field(default=None, compare=False, repr=False)
    variant_choice: str = field(default="", compare=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Parse every known variable from ``environ`` (default ``os.environ``)."""
        environ = _reference_names_read(os.environ if environ is None else environ)
        values: dict[str, Any] = {}
        given = set()
        for f in _env_fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw is not None and (raw.strip() or f.type in ("str", "tuple[str, ...]")):
                values[f.name] = f.metadata["parse"](f.metadata["env"], raw)
                given.add(f.metadata["env"])
        if "cache_dir" not in values:
            values["cache_dir"] = default_cache_dir(environ)
        settings = cls(**values, explicit=frozenset(given))
        settings.validate()
        return settings

    @property
    def inflight_limit_bytes(self) -> int:
        """Bytes of request bodies in progress before 429: BGE_M3_MAX_INFLIGHT_MB (unset:
        ``DEFAULT_INFLIGHT_MB``; `bgeserve serve` sets it from the memory it has), never below
        one largest body (BGE_M3_MAX_BODY_BYTES): a lone one goes in anyway, and would then
        fill it."""
        return max((self.max_inflight_mb or DEFAULT_INFLIGHT_MB) << 20, self.max_body_bytes)

    def is_explicit(self, variable: str) -> bool:
        """Whether ``variable`` (``BGE_M3_*``) was set, rather than left at its default."""
        return self.explicit is None or variable in self.explicit

    def __post_init__(self) -> None:
        # "~" is expanded when the settings are made (not at import): the default, or a path
        # given to the constructor, is then the same Path wherever it is used.
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())

    def validate(self) -> None:
        """Check rules that involve more than one field."""
        if (self.cost_model_a is None) != (self.cost_model_b is None):
            raise ConfigError(
                "BGE_M3_COST_MODEL_A and BGE_M3_COST_MODEL_B must be set together",
                param="BGE_M3_COST_MODEL_A" if self.cost_model_a is None else "BGE_M3_COST_MODEL_B",
            )
        for path, name in ((self.tls_key_file, "BGE_M3_TLS_KEY_FILE"),
                           (self.tls_client_ca_file, "BGE_M3_TLS_CLIENT_CA_FILE")):
            if path is not None and self.tls_cert_file is None:
                raise ConfigError(f"{name} needs BGE_M3_TLS_CERT_FILE (the server's certificate)",
                                  param=name)
        if self.metrics_auth and not self.api_keys:
            # It would serve /metrics open, as the operator meant it not to (QA: silent).
            raise ConfigError("BGE_M3_METRICS_AUTH=1 asks /metrics for BGE_M3_API_KEY, which is "
                              "not set: set a key, or leave BGE_M3_METRICS_AUTH unset",
                              param="BGE_M3_METRICS_AUTH")
        if self.request_timeout_secs and self.batch_delay_ms / 1000 >= self.request_timeout_secs:
            # Every request would wait out its deadline before its first run (QA: all 504s,
            # while /health/deep's canary, which skips the window, said ok).
            raise ConfigError(
                f"BGE_M3_BATCH_DELAY_MS={self.batch_delay_ms:g} is not below "
                f"BGE_M3_REQUEST_TIMEOUT_SECS={self.request_timeout_secs:g} s: every request "
                "would wait out its deadline for others to join it; lower it (a few ms to tens "
                "of ms gathers concurrent requests)", param="BGE_M3_BATCH_DELAY_MS")
        both = sorted({*M3_MODEL_IDS, *self.model_aliases}
                      & set(self.rerank_model_aliases))
        if both:
            raise ConfigError(
                f"{both[0]!r} names bge-m3 (its own name or BGE_M3_MODEL_ALIASES) and is in "
                f"BGE_M3_RERANK_MODEL_ALIASES (names the reranker); keep it in one",
                param="BGE_M3_RERANK_MODEL_ALIASES")
        if self.onnx_batch_size is not None:
            warnings.warn(
                "BGE_M3_ONNX_BATCH_SIZE is deprecated; it is translated to BGE_M3_TOKEN_BUDGET "
                "(the workspace of that many 512-token texts; the server logs the figure)",
                DeprecationWarning,
                stacklevel=3,
            )

    @property
    def threads_per_worker(self) -> int:
        """Intra-op threads per session: explicit, or the usable CPUs (affinity, narrowed by a
        cgroup CPU quota) shared among workers."""
        if self.intra_threads:
            return self.intra_threads
        return max(1, usable_cpus().count // self.workers)

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict for logging, API keys replaced by their count."""
        out = {f.name: getattr(self, f.name) for f in _env_fields(self)}
        out["api_keys"] = f"<{len(self.api_keys)} key(s)>"
        return {k: str(v) if isinstance(v, Path) else v for k, v in out.items()}

    @classmethod
    def help_text(cls) -> str:
        """One line per variable, for ``bgeserve serve --help``."""
        lines = []
        for f in _env_fields(cls):
            doc = f.metadata["doc"]
            # A doc that says what unset means already says the default ("(default: fp32)"
            # after "unset: the fastest ..." read as if fp32 were served when unset).
            default = "" if SAYS_DEFAULT.search(doc) else f" (default: {f.default})"
            allowed = getattr(f.metadata["parse"], "allowed", None)
            if allowed and "|" not in doc:  # a range [lo, hi] or the choices, unless listed
                doc = f"{doc} {allowed}"
            lines.append(f"  {f.metadata['env']:<34} {doc}{default}")
        return "\n".join(lines)


def _env_fields(cls: Any) -> list[dataclasses.Field]:
    """The fields bound to an environment variable (not ``explicit``, ``variant_choice``)."""
    return [f for f in dataclasses.fields(cls) if "env" in f.metadata]


# The reference server's names for settings bgeserve names otherwise (SPEC §7: a drop-in).
# Its TLS pair was ignored with a warning: the server then served plain HTTP.
REFERENCE_NAMES = {"BGE_M3_TLS_CERT_PATH": "BGE_M3_TLS_CERT_FILE",
                   "BGE_M3_TLS_KEY_PATH": "BGE_M3_TLS_KEY_FILE"}


def _reference_names_read(environ: Mapping[str, str]) -> Mapping[str, str]:
    """``environ`` with each reference name's value under bgeserve's name (ConfigError where
    both are set to different values)."""
    given = {old: new for old, new in REFERENCE_NAMES.items() if environ.get(old, "").strip()}
    if not given:
        return environ
    out = dict(environ)
    for old, new in given.items():
        if new in environ and environ[new].strip() != environ[old].strip():
            raise ConfigError(f"{old} (the reference server's name) and {new} are both set, "
                              "to different files: set one", param=new)
        out[new] = environ[old]
    return out


def setting_notes(environ: Mapping[str, str]) -> list[str]:
    """A line for each setting given in a way worth a word: a reference name read as
    bgeserve's, the deprecated BGE_M3_ONNX_BATCH_SIZE (and which of the settings it stands
    for wins), an API key variable that holds no key."""
    lines = [f"{old} (the reference server's name) is read as {new}"
             for old, new in REFERENCE_NAMES.items() if environ.get(old, "").strip()]
    batch = environ.get("BGE_M3_ONNX_BATCH_SIZE", "").strip()
    if batch:
        stands = {"BGE_M3_TOKEN_BUDGET": f"the workspace of {batch} 512-token texts",
                  "BGE_M3_MAX_CHUNK": f"{batch} texts per run"}
        parts = [f"{name} is set and wins over it" if environ.get(name, "").strip()
                 else f"read as {name} ({what})" for name, what in stands.items()]
        lines.append(f"BGE_M3_ONNX_BATCH_SIZE={batch} is deprecated: {'; '.join(parts)}")
    for f in _env_fields(Settings):  # VAR= (a template's empty slot): the default, said
        raw = environ.get(f.metadata["env"])
        if raw is not None and not raw.strip() and f.type not in ("str", "tuple[str, ...]"):
            lines.append(f"{f.metadata['env']} is set but empty: its default is used")
    if "BGE_M3_API_KEY" in environ and not _keys("BGE_M3_API_KEY", environ["BGE_M3_API_KEY"]):
        lines.append("BGE_M3_API_KEY is set but holds no key: requests need none (unset it, "
                     "or give it the keys)")
    origins = _keys("BGE_M3_CORS_ALLOW_ORIGINS", environ.get("BGE_M3_CORS_ALLOW_ORIGINS", ""))
    for origin in origins:
        # Matched exactly against the Origin header, which is scheme://host[:port] (QA:
        # "example.com" and "https://a.com/" matched no page, without a word).
        if origin not in ("*", "null") and not _ORIGIN.fullmatch(origin):
            lines.append(f"BGE_M3_CORS_ALLOW_ORIGINS: {origin!r} is no origin a browser sends "
                         "(scheme://host[:port], no path, e.g. https://app.example.com): pages "
                         "are matched exactly, so none gets CORS headers by it")
    return lines


_ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s]+")


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A line for each ``BGE_M3_*`` variable that is no setting (a misspelt one was ignored
    without a word: two letters swapped in BGE_M3_MAX_SEQ_LENGTH served 8,192-token texts),
    with the closest real name."""
    lines = []
    for name, close in _near_misses(environ, cutoff=0.8):
        hint = f"; did you mean {close}?" if close else ""
        lines.append(f"{name} is not a bgeserve setting and is ignored{hint}")
    return lines


def _near_misses(environ: Mapping[str, str], cutoff: float) -> list[tuple[str, str | None]]:
    """Each ``BGE_M3_*`` variable that is no setting, with the closest setting at ``cutoff``
    (difflib's ratio) or None."""
    known = [f.metadata["env"] for f in _env_fields(Settings)]
    # Names are case-sensitive: bge_m3_api_key is no BGE_M3_API_KEY (QA: ignored silently).
    unknown = sorted(n for n in environ if n.upper().startswith("BGE_M3_") and n not in known
                     and n not in REFERENCE_NAMES)
    return [(name, next(iter(difflib.get_close_matches(name.upper(), known, n=1,
                                                       cutoff=cutoff)), None))
            for name in unknown]


# Settings whose misspelling serves less safely than asked (no API key, /metrics open, plain
# HTTP, any origin): a near miss of one stops ``serve`` rather than warn (QA: the key's name
# with an S added warned "did you mean BGE_M3_API_KEY?" and served every client).
GUARDS = ("BGE_M3_API_KEY", "BGE_M3_METRICS_AUTH", "BGE_M3_TLS_CERT_FILE", "BGE_M3_TLS_KEY_FILE",
          "BGE_M3_TLS_CLIENT_CA_FILE", "BGE_M3_CORS_ALLOW_ORIGINS")


# An unknown name in one of these families means its guard, however far from its spelling
# (QA: the prefix with TLS_CERT, API_TOKEN or CORS_ORIGINS only warned, and served plain
# HTTP, every client, every origin). No setting but the guards is named so.
GUARD_FAMILIES = tuple(f"BGE_M3_{family}" for family in ("API", "TLS", "CORS", "METRICS_AUTH"))


def refuse_misspelt_guards(environ: Mapping[str, str]) -> None:
    """ConfigError for an unknown ``BGE_M3_*`` variable meaning a guard that is not set: very
    close to it (a letter or two off: a sidecar's metrics port variable is no
    BGE_M3_METRICS_AUTH), or in its family (``GUARD_FAMILIES``); a guard set beside its near
    miss is in force."""
    for name, close in _near_misses(environ, cutoff=0.9):
        if close not in GUARDS:
            close = _guard_of_family(name)
        if close is not None and close not in environ:
            raise ConfigError(f"{name} is not a bgeserve setting; did you mean {close}? Not "
                              f"starting: the server would run without {close} (rename the "
                              "variable, or unset it)", param=name)


def _guard_of_family(name: str) -> str | None:
    """The guard of ``name``'s family sharing most words with it, then closest, where it is
    as close as a warning's hint (difflib's 0.8: a TLS_CA_FILE means
    BGE_M3_TLS_CLIENT_CA_FILE; an API_URL or a CORS_MAX_AGE, a client's or another
    setting's, is no guard: review); None otherwise."""
    upper = name.upper()
    words = set(upper.split("_"))

    def ratio(guard: str) -> float:
        return difflib.SequenceMatcher(None, upper, guard).ratio()

    family = [g for f in GUARD_FAMILIES if upper.startswith(f) for g in GUARDS
              if g.startswith(f) and ratio(g) >= 0.8]
    return max(family, default=None, key=lambda g: (len(words & set(g.split("_"))), ratio(g)))


def warn_unknown_variables(environ: Mapping[str, str]) -> None:
    """Log ``unknown_variables`` and ``setting_notes`` as warnings (the commands call it once
    logging is set up; a DeprecationWarning alone is hidden by Python's default filters)."""
    for line in [*unknown_variables(environ), *setting_notes(environ)]:
        logging.getLogger("bgeserve").warning("%s", line)
