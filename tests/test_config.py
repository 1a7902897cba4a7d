"""Tests for bgeserve.config: every BGE_M3_* variable parsed from a plain dict, and refused
with a ConfigError naming the variable when it is malformed."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from bgeserve.config import REFERENCE_NAMES, Settings
from bgeserve.errors import ConfigError

PACKAGE = Path(__file__).resolve().parents[1] / "bgeserve"
RECORDS = {"explicit", "variant_choice"}
# The fields bound to a variable; ``explicit`` and ``variant_choice`` record how they were set.
VARIABLE_FIELDS = [f for f in dataclasses.fields(Settings) if f.name not in RECORDS]
ENV = {f.metadata["env"]: f for f in VARIABLE_FIELDS}


def parse(**env: str) -> Settings:
    return Settings.from_env(env)


def refuse(env: dict[str, str], var: str | None = None) -> ConfigError:
    """The ConfigError ``env`` raises; it must name ``var`` (default: the only key)."""
    var = var or next(iter(env))
    with pytest.raises(ConfigError) as info:
        Settings.from_env(env)
    assert info.value.param == var
    assert var in info.value.message
    return info.value


# ------------------------------------------------------------------------------ defaults
def test_an_empty_environment_gives_the_defaults():
    """from_env({}) equals Settings(): every field at its documented default."""
    s = Settings.from_env({})
    assert s == Settings()
    assert (s.model_path, s.variant, s.offline) == (None, "fp32", False)
    assert s.cache_dir == Path.home() / ".cache" / "bgeserve" and s.prepare
    assert (s.max_seq_length, s.truncate, s.model_aliases) == (8192, True, ())
    assert (s.execution_provider, s.workers, s.intra_threads, s.max_chunk) == ("cpu", 1, 0, 64)
    assert (s.max_chunk_tokens, s.cross_request_batching) == (None, True)  # per backend
    assert (s.available_memory_bytes, s.memory_safety_factor, s.token_budget) == (None, 0.7, None)
    assert (s.cost_model_a, s.cost_model_b, s.onnx_batch_size) == (None, None, None)
    assert (s.disable_auto_budget, s.disable_probe_cache) == (False, False)
    assert (s.bind, s.max_batch, s.max_body_bytes, s.max_text_chars) == (
        "0.0.0.0:8081", 2048, 32 * 1024 * 1024, 131_072)
    assert (s.api_keys, s.metrics_auth, s.accept_token_ids) == ((), False, False)
    assert (s.batch_delay_ms, s.max_queue_tokens, s.request_timeout_secs) == (0.0, 1_000_000,
                                                                              300.0)
    assert (s.idle_timeout_secs, s.shutdown_timeout_secs, s.heartbeat_secs) == (300.0, 30.0,
                                                                                60.0)
    assert (s.log_format, s.log_level) == ("auto", "info")
    assert s.keep_alive_secs > 60  # nginx's upstream keepalive_timeout, ALB's idle timeout
    assert (s.gpu_count, s.gpu_vram_budget_bytes, s.trt_warmup_shapes) == (None, None, "")
    assert (s.warmup_only, s.allow_cpu_fallback) == (False, False)


def test_unrelated_variables_are_ignored():
    """Variables bgeserve does not know (PATH, BGE_M3_TYPO) change nothing."""
    assert Settings.from_env({"PATH": "/bin", "BGE_M3_TYPO": "x"}) == Settings()


def test_settings_are_frozen():
    """Settings cannot be changed after parsing."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().workers = 2  # type: ignore[misc]


def test_every_field_is_bound_to_a_documented_variable():
    """Each field names its variable, a parser and a help line; no variable is used twice."""
    fields = VARIABLE_FIELDS
    assert len(ENV) == len(fields)
    for f in fields:
        assert re.fullmatch(r"BGE_M3_[A-Z0-9_]+|HF_HUB_OFFLINE", f.metadata["env"])
        assert callable(f.metadata["parse"]) and f.metadata["doc"]


def test_cache_dir_defaults_to_the_users_cache_not_a_root_path():
    """Without BGE_M3_CACHE_DIR the cache is $XDG_CACHE_HOME/bgeserve (absolute XDG only), else
    ~/.cache/bgeserve: a directory any user may create, never /cache."""
    assert Settings.from_env({"XDG_CACHE_HOME": "/x/c"}).cache_dir == Path("/x/c/bgeserve")
    home = Path.home() / ".cache" / "bgeserve"
    assert Settings.from_env({"XDG_CACHE_HOME": "relative"}).cache_dir == home
    assert Settings.from_env({}).cache_dir == home
    explicit = {"XDG_CACHE_HOME": "/x/c", "BGE_M3_CACHE_DIR": "/srv/cache"}
    assert Settings.from_env(explicit).cache_dir == Path("/srv/cache")


# ------------------------------------------------------------------------------- parsing
PARSED = [
    ("BGE_M3_MODEL_PATH", "/models/m3", "model_path", Path("/models/m3")),
    ("BGE_M3_MODEL_PATH", "~/m3", "model_path", Path("~/m3").expanduser()),
    ("BGE_M3_MODEL", "FP16", "variant", "fp16"),
    ("BGE_M3_MODEL", " int8 ", "variant", "int8"),
    ("BGE_M3_CACHE_DIR", "/tmp/c", "cache_dir", Path("/tmp/c")),
    ("HF_HUB_OFFLINE", "1", "offline", True),
    ("BGE_M3_PREPARE", "0", "prepare", False),
    ("BGE_M3_MAX_SEQ_LENGTH", "512", "max_seq_length", 512),
    ("BGE_M3_TRUNCATE", "false", "truncate", False),
    ("BGE_M3_MODEL_ALIASES", "m3, bge ,,x", "model_aliases", ("m3", "bge", "x")),
    ("BGE_M3_RERANK_MODEL_ALIASES", "rerank-english-v3.0, jina-reranker-v2-base-multilingual",
     "rerank_model_aliases", ("rerank-english-v3.0", "jina-reranker-v2-base-multilingual")),
    ("BGE_M3_EP", "CUDA", "execution_provider", "cuda"),
    ("BGE_M3_WORKERS", "4", "workers", 4),
    ("BGE_M3_INTRA_THREADS", "2", "intra_threads", 2),
    ("BGE_M3_MAX_CHUNK", "16", "max_chunk", 16),
    ("BGE_M3_MAX_CHUNK_TOKENS", "4096", "max_chunk_tokens", 4096),
    ("BGE_M3_PAD_MULTIPLE", "64", "pad_multiple", 64),
    ("BGE_M3_CROSS_REQUEST_BATCHING", "no", "cross_request_batching", False),
    ("BGE_M3_AVAILABLE_MEMORY_BYTES", "8589934592", "available_memory_bytes", 8 << 30),
    ("BGE_M3_MEMORY_SAFETY_FACTOR", "0.5", "memory_safety_factor", 0.5),
    ("BGE_M3_TOKEN_BUDGET", "1000000", "token_budget", 1_000_000),
    ("BGE_M3_DISABLE_AUTO_BUDGET", "yes", "disable_auto_budget", True),
    ("BGE_M3_DISABLE_PROBE_CACHE", "on", "disable_probe_cache", True),
    ("BGE_M3_BIND", "127.0.0.1:9000", "bind", "127.0.0.1:9000"),
    ("BGE_M3_BIND", "[::1]:80", "bind", "[::1]:80"),
    ("BGE_M3_MAX_BATCH", "32", "max_batch", 32),
    ("BGE_M3_ACCEPT_TOKEN_IDS", "1", "accept_token_ids", True),
    ("BGE_M3_MAX_BODY_BYTES", "1024", "max_body_bytes", 1024),
    ("BGE_M3_MAX_TEXT_CHARS", "10", "max_text_chars", 10),
    ("BGE_M3_MAX_COLBERT_MB", "64", "max_colbert_mb", 64),
    ("BGE_M3_MAX_INFLIGHT_MB", "100", "max_inflight_mb", 100),
    ("BGE_M3_API_KEY", "k1,k2", "api_keys", ("k1", "k2")),
    ("BGE_M3_API_KEY", "", "api_keys", ()),
    ("BGE_M3_METRICS_AUTH", "TRUE", "metrics_auth", True),
    ("BGE_M3_CORS_ALLOW_ORIGINS", "https://a.example, http://localhost:3000",
     "cors_allow_origins", ("https://a.example", "http://localhost:3000")),
    ("BGE_M3_CORS_ALLOW_ORIGINS", "", "cors_allow_origins", ()),
    ("BGE_M3_TLS_CERT_FILE", "/tls/cert.pem", "tls_cert_file", Path("/tls/cert.pem")),
    ("BGE_M3_TLS_KEY_FILE", "/tls/key.pem", "tls_key_file", Path("/tls/key.pem")),
    ("BGE_M3_TLS_CLIENT_CA_FILE", "/tls/ca.pem", "tls_client_ca_file", Path("/tls/ca.pem")),
    ("BGE_M3_BATCH_DELAY_MS", "2.5", "batch_delay_ms", 2.5),
    ("BGE_M3_MAX_QUEUE_TOKENS", "100", "max_queue_tokens", 100),
    ("BGE_M3_CACHE_MB", "0", "cache_mb", 0),
    ("BGE_M3_CACHE_MB", "512", "cache_mb", 512),
    ("BGE_M3_REQUEST_TIMEOUT_SECS", "0", "request_timeout_secs", 0.0),
    ("BGE_M3_IDLE_TIMEOUT_SECS", "10", "idle_timeout_secs", 10.0),
    ("BGE_M3_SHUTDOWN_TIMEOUT_SECS", "5", "shutdown_timeout_secs", 5.0),
    ("BGE_M3_KEEP_ALIVE_SECS", "650", "keep_alive_secs", 650.0),
    ("BGE_M3_LOG_FORMAT", "json", "log_format", "json"),
    ("BGE_M3_LOG_LEVEL", "DEBUG", "log_level", "debug"),
    ("BGE_M3_HEARTBEAT_SECS", "0", "heartbeat_secs", 0.0),
    ("BGE_M3_GPU_COUNT", "2", "gpu_count", 2),
    ("BGE_M3_GPU_VRAM_BUDGET_BYTES", "1000", "gpu_vram_budget_bytes", 1000),
    ("BGE_M3_TRT_WARMUP_SHAPES", " 1x512,8x128 ", "trt_warmup_shapes", "1x512,8x128"),
    ("BGE_M3_WARMUP_ONLY", "1", "warmup_only", True),
    ("BGE_M3_ALLOW_CPU_FALLBACK", "1", "allow_cpu_fallback", True),
    ("BGE_M3_RERANK_MODEL_PATH", "/m/rr", "rerank_model_path", Path("/m/rr")),
    ("BGE_M3_RERANK", "1", "rerank", True),
    ("BGE_M3_RERANK_VARIANT", "INT8", "rerank_variant", "int8"),
    ("BGE_M3_RERANK_MAX_LENGTH", "512", "rerank_max_length", 512),
    ("BGE_M3_RERANK_WORKERS", "2", "rerank_workers", 2),
    ("BGE_M3_RERANK_NORMALIZE", "true", "rerank_normalize", True),
    ("BGE_M3_RERANK_MEMORY_SHARE", "0.25", "rerank_memory_share", 0.25),
]


# Variables that are only valid beside another one.
COMPANIONS = {"BGE_M3_TLS_KEY_FILE": {"BGE_M3_TLS_CERT_FILE": "/tls/cert.pem"},
              "BGE_M3_TLS_CLIENT_CA_FILE": {"BGE_M3_TLS_CERT_FILE": "/tls/cert.pem"},
              "BGE_M3_METRICS_AUTH": {"BGE_M3_API_KEY": "k"}}


def test_metrics_auth_without_a_key_is_refused():
    """It would serve /metrics open, as the operator meant it not to (QA: it started
    silently)."""
    assert "BGE_M3_API_KEY" in refuse({"BGE_M3_METRICS_AUTH": "1"}).message
    assert not Settings.from_env({"BGE_M3_METRICS_AUTH": "0"}).metrics_auth


@pytest.mark.parametrize("var, raw, name, value", PARSED)
def test_each_variable_is_parsed(var, raw, name, value):
    """Each variable is read, stripped, cast and stored on its field."""
    assert getattr(Settings.from_env({var: raw, **COMPANIONS.get(var, {})}), name) == value


def test_the_parsing_table_covers_every_variable():
    """Every variable appears in the table above (a new one needs a parsing test)."""
    assert {var for var, *_ in PARSED} | {"BGE_M3_COST_MODEL_A", "BGE_M3_COST_MODEL_B",
                                           "BGE_M3_ONNX_BATCH_SIZE"} == set(ENV)


@pytest.mark.parametrize("raw, value", [
    ("1", True), ("true", True), ("Yes", True), ("ON", True),
    ("0", False), ("false", False), ("No", False), ("off", False),
])
def test_booleans_accept_the_usual_spellings(raw, value):
    """1/true/yes/on and 0/false/no/off, in any case."""
    assert parse(BGE_M3_WARMUP_ONLY=raw).warmup_only is value


@pytest.mark.parametrize("var", ["BGE_M3_WORKERS", "BGE_M3_MEMORY_SAFETY_FACTOR",
                                 "BGE_M3_TRUNCATE", "BGE_M3_MODEL_PATH", "BGE_M3_GPU_COUNT"])
def test_a_blank_non_text_variable_means_the_default(var):
    """VAR= (empty or spaces) leaves a number, bool or path at its default."""
    assert Settings.from_env({var: "  "}) == Settings()


def test_the_cost_model_pair_is_read_together():
    """BGE_M3_COST_MODEL_A and _B set together give both coefficients."""
    s = parse(BGE_M3_COST_MODEL_A="1000", BGE_M3_COST_MODEL_B="2.5")
    assert (s.cost_model_a, s.cost_model_b) == (1000.0, 2.5)


# -------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("var, raw", [
    ("BGE_M3_WORKERS", "two"),
    ("BGE_M3_WORKERS", "1.5"),
    ("BGE_M3_MAX_SEQ_LENGTH", "0x10"),
    ("BGE_M3_MEMORY_SAFETY_FACTOR", "half"),
    ("BGE_M3_BATCH_DELAY_MS", "1ms"),
])
def test_a_malformed_number_is_refused(var, raw):
    """A value that is not a number of the right kind is a ConfigError naming the variable."""
    assert "not a valid" in refuse({var: raw}).message


@pytest.mark.parametrize("var, raw", [
    ("BGE_M3_WORKERS", "0"),
    ("BGE_M3_WORKERS", "257"),
    ("BGE_M3_MAX_SEQ_LENGTH", "8193"),
    ("BGE_M3_MAX_SEQ_LENGTH", "-1"),
    ("BGE_M3_MAX_SEQ_LENGTH", "1"),  # no room for <s> and </s>
    ("BGE_M3_MAX_CHUNK", "0"),
    ("BGE_M3_MEMORY_SAFETY_FACTOR", "1.5"),
    ("BGE_M3_MEMORY_SAFETY_FACTOR", "0.05"),
    ("BGE_M3_BATCH_DELAY_MS", "10001"),
    ("BGE_M3_MAX_BODY_BYTES", "1023"),
    ("BGE_M3_REQUEST_TIMEOUT_SECS", "-1"),
    # past threading.TIMEOUT_MAX a wait raised OverflowError in the thread (workers died)
    ("BGE_M3_REQUEST_TIMEOUT_SECS", "1e10"),
    ("BGE_M3_IDLE_TIMEOUT_SECS", "1e10"),
    ("BGE_M3_SHUTDOWN_TIMEOUT_SECS", "1000000001"),
    ("BGE_M3_HEARTBEAT_SECS", "1e300"),
    ("BGE_M3_KEEP_ALIVE_SECS", "0"),  # every idle connection closed: every reuse a race
    ("BGE_M3_COST_MODEL_A", "-0.1"),
])
def test_an_out_of_range_number_is_refused(var, raw):
    """A number outside its allowed range is a ConfigError that shows the range."""
    assert "out of range" in refuse({var: raw}).message


@pytest.mark.parametrize("var", ["BGE_M3_HEARTBEAT_SECS", "BGE_M3_IDLE_TIMEOUT_SECS"])
def test_a_period_is_off_or_at_least_a_second(var):
    """0 turns a period off and 1 s is the shortest taken: a heartbeat every 0.001 s wrote
    1,000 log lines a second."""
    assert "0 (off) or at least 1 s" in refuse({var: "0.001"}).message
    assert "0 (off) or at least 1 s" in refuse({var: "0.999"}).message
    for raw, want in (("0", 0.0), ("1", 1.0), ("2.5", 2.5)):
        s = parse(**{var: raw})
        assert getattr(s, "heartbeat_secs" if "HEARTBEAT" in var else "idle_timeout_secs") == want


def test_range_bounds_are_inclusive():
    """The documented bounds themselves are accepted."""
    s = parse(BGE_M3_WORKERS="256", BGE_M3_MAX_SEQ_LENGTH="2", BGE_M3_MEMORY_SAFETY_FACTOR="1.0",
              BGE_M3_BATCH_DELAY_MS="10000")
    assert (s.workers, s.max_seq_length, s.memory_safety_factor, s.batch_delay_ms) == (
        256, 2, 1.0, 10000.0)


@pytest.mark.parametrize("var, raw", [
    ("BGE_M3_MEMORY_SAFETY_FACTOR", "nan"),
    ("BGE_M3_REQUEST_TIMEOUT_SECS", "inf"),
    ("BGE_M3_IDLE_TIMEOUT_SECS", "Infinity"),
    ("BGE_M3_SHUTDOWN_TIMEOUT_SECS", "NaN"),
    ("BGE_M3_COST_MODEL_A", "inf"),
])
def test_non_finite_numbers_are_refused(var, raw):
    """nan and inf are ConfigErrors: nan passes every range check, inf crashes at use."""
    assert "finite" in refuse({var: raw}).message


@pytest.mark.parametrize("var", ["BGE_M3_TRUNCATE", "HF_HUB_OFFLINE", "BGE_M3_METRICS_AUTH"])
@pytest.mark.parametrize("raw", ["maybe", "2", "y", "enabled"])
def test_a_malformed_boolean_is_refused(var, raw):
    """Only the listed spellings are booleans; anything else names the variable."""
    assert "not a boolean" in refuse({var: raw}).message


@pytest.mark.parametrize("var, raw", [
    ("BGE_M3_MODEL", "fp64"),
    ("BGE_M3_EP", "rocm"),
    ("BGE_M3_LOG_FORMAT", "xml"),
    ("BGE_M3_LOG_LEVEL", "trace"),
    ("BGE_M3_RERANK_VARIANT", "ov-int8"),  # made for bge-m3 only: it failed at load
])
def test_a_value_outside_the_choices_is_refused(var, raw):
    """A choice variable lists the allowed values in its error."""
    assert "must be one of" in refuse({var: raw}).message


@pytest.mark.parametrize("raw", ["8081", "localhost", ":8081", "host:", "host:0", "host:65536",
                                 "host:http", "host:-1", "host:²", "host:８０"])
def test_a_malformed_bind_is_refused(raw):
    """BGE_M3_BIND must be HOST:PORT with an ASCII port in 1..65535."""
    assert "HOST:PORT with a port in [1, 65535]" in refuse({"BGE_M3_BIND": raw}).message


@pytest.mark.parametrize("raw", ["garbage", "8x512,x", "0x512", "8x0", "8*512", "8x512x2"])
def test_a_malformed_warm_up_shape_is_refused(raw):
    """Every bad value stops the start (README); these were skipped with a warning (QA)."""
    assert "is not a shape BxL" in refuse({"BGE_M3_TRT_WARMUP_SHAPES": raw}).message


@pytest.mark.parametrize(("typo", "meant"), [
    ("BGE_M3_API_KEYS", "BGE_M3_API_KEY"), ("BGE_M3_APIKEY", "BGE_M3_API_KEY"),
    ("BGE_M3_METRIC_AUTH", "BGE_M3_METRICS_AUTH"),
    ("BGE_M3_TLS_CERTFILE", "BGE_M3_TLS_CERT_FILE"), ("bge_m3_api_key", "BGE_M3_API_KEY"),
    # Farther off, in a guard's family (QA: these only warned, and served unguarded).
    ("BGE_M3_TLS_CERT", "BGE_M3_TLS_CERT_FILE"), ("BGE_M3_API_TOKEN", "BGE_M3_API_KEY"),
    ("BGE_M3_CORS_ORIGINS", "BGE_M3_CORS_ALLOW_ORIGINS"),
    ("BGE_M3_TLS_CA_FILE", "BGE_M3_TLS_CLIENT_CA_FILE"),
])
def test_serve_refuses_a_misspelt_security_setting(
        typo: str, meant: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """A near miss of the API key (TLS, metrics auth, CORS) served with no key and a warning
    (QA); it stops the start now, naming the setting it resembles. Other typos still warn."""
    from bgeserve.cli import main
    from bgeserve.config import refuse_misspelt_guards

    monkeypatch.setenv(typo, "secret")
    monkeypatch.setenv("BGE_M3_MODEL_PATH", "/nonexistent")  # never a real start, whatever
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert f"{typo} is not a bgeserve setting; did you mean {meant}?" in err, err
    assert "Not starting" in err and "secret" not in err
    for fine in ({"BGE_M3_MAX_SEQ_LENTGH": "512"}, {"BGE_M3_TLS_CERT_PATH": "x"},
                 {"BGE_M3_METRICS_PORT": "9090"}, {"BGE_M3_API_URL": "http://x"},
                 {"BGE_M3_CORS_MAX_AGE": "600"}, {"BGE_M3_API_TIMEOUT": "3"},
                 {typo: "x", meant: "y"}):  # warned, not refused
        refuse_misspelt_guards(fine)


def test_a_batch_window_as_long_as_the_deadline_is_refused():
    """Every request would be a 504 (QA); below the deadline, or with none, it is taken."""
    refuse({"BGE_M3_BATCH_DELAY_MS": "8000", "BGE_M3_REQUEST_TIMEOUT_SECS": "3"},
           var="BGE_M3_BATCH_DELAY_MS")
    refuse({"BGE_M3_BATCH_DELAY_MS": "3000", "BGE_M3_REQUEST_TIMEOUT_SECS": "3"},
           var="BGE_M3_BATCH_DELAY_MS")
    Settings.from_env({"BGE_M3_BATCH_DELAY_MS": "2999", "BGE_M3_REQUEST_TIMEOUT_SECS": "3"})
    Settings.from_env({"BGE_M3_BATCH_DELAY_MS": "8000", "BGE_M3_REQUEST_TIMEOUT_SECS": "0"})


def test_cost_model_a_without_b_is_refused():
    """One cost coefficient without the other is a ConfigError naming the missing one."""
    error = refuse({"BGE_M3_COST_MODEL_A": "1000"}, var="BGE_M3_COST_MODEL_B")
    assert "BGE_M3_COST_MODEL_A" in error.message
    refuse({"BGE_M3_COST_MODEL_B": "2"}, var="BGE_M3_COST_MODEL_A")


def test_the_first_bad_variable_stops_parsing_with_its_own_name():
    """With several bad values, the error still names exactly one real culprit."""
    with pytest.raises(ConfigError) as info:
        parse(BGE_M3_WORKERS="x", BGE_M3_LOG_LEVEL="loud")
    assert info.value.param in {"BGE_M3_WORKERS", "BGE_M3_LOG_LEVEL"}


def test_onnx_batch_size_is_deprecated():
    """BGE_M3_ONNX_BATCH_SIZE still parses but warns that it is deprecated."""
    with pytest.warns(DeprecationWarning, match="BGE_M3_ONNX_BATCH_SIZE"):
        s = parse(BGE_M3_ONNX_BATCH_SIZE="8")
    assert s.onnx_batch_size == 8


def test_the_deprecation_warning_points_at_the_caller():
    """The warning is attributed to the code calling from_env, not to config.py."""
    with pytest.warns(DeprecationWarning) as record:
        Settings.from_env({"BGE_M3_ONNX_BATCH_SIZE": "8"})
    assert record[0].filename == __file__


# --------------------------------------------------------------------- derived, redacted
def test_threads_per_worker(monkeypatch):
    """Explicit intra threads win; otherwise the usable CPUs (affinity narrowed by a cgroup CPU
    quota: tests/test_cgroup.py) are shared among workers (at least 1)."""
    from bgeserve import config
    from bgeserve.cgroup import Cpus

    monkeypatch.setattr(config, "usable_cpus", lambda: Cpus(8, 64, 8.0))
    assert parse(BGE_M3_INTRA_THREADS="3").threads_per_worker == 3
    assert parse(BGE_M3_WORKERS="2").threads_per_worker == 4
    assert parse(BGE_M3_WORKERS="16").threads_per_worker == 1
    monkeypatch.setattr(config, "usable_cpus", lambda: Cpus(1, 1, None))
    assert Settings().threads_per_worker == 1


def test_compute_threads_past_the_cpus_are_named_in_a_warning(monkeypatch):
    """Workers x intra-op threads over the usable CPUs: a warning naming the variables and
    the figures (QA: started without a word); within them, or on a GPU, none."""
    from bgeserve import config
    from bgeserve.cgroup import Cpus
    from bgeserve.service.plan import oversubscribed

    monkeypatch.setattr(config, "usable_cpus", lambda: Cpus(2, 2, None))
    said = oversubscribed(parse(BGE_M3_WORKERS="4", BGE_M3_INTRA_THREADS="2"), 2)
    assert said is not None and said.startswith(
        "BGE_M3_WORKERS=4 x BGE_M3_INTRA_THREADS=2 runs 8 compute threads on 2 usable CPUs")
    said = oversubscribed(parse(BGE_M3_WORKERS="3"), 2)
    assert said is not None and "runs 3 compute threads on 2" in said
    assert said.endswith("run at most 2 workers (each then gets the CPUs' share)")
    said = oversubscribed(parse(BGE_M3_WORKERS="4", BGE_M3_INTRA_THREADS="1"), 2)
    assert said is not None and said.endswith("run at most 2 workers and unset "
                                              "BGE_M3_INTRA_THREADS")
    for fine in (parse(), parse(BGE_M3_WORKERS="2"), parse(BGE_M3_INTRA_THREADS="2"),
                 parse(BGE_M3_WORKERS="4", BGE_M3_EP="cuda")):
        assert oversubscribed(fine, 2) is None


def test_redacted_hides_the_api_keys():
    """The loggable dict shows how many keys there are, never the keys themselves."""
    s = parse(BGE_M3_API_KEY="sk-secret-one,sk-secret-two", BGE_M3_MODEL_PATH="/m")
    out = s.redacted()
    assert out["api_keys"] == "<2 key(s)>"
    assert "sk-secret" not in repr(out)
    assert out["model_path"] == "/m" and out["workers"] == 1
    assert set(out) == {f.name for f in VARIABLE_FIELDS}


def test_help_text_lists_every_variable_with_its_default():
    """One line per variable: its name, its description and its default, unless the
    description says what unset means (BGE_M3_MODEL read "unset: the fastest ... (default:
    fp32)", as if fp32 were served when unset)."""
    text = Settings.help_text()
    lines = text.splitlines()
    assert len(lines) == len(ENV)
    for var, f in ENV.items():
        line = next(line for line in lines if line.split()[0] == var)
        assert f.metadata["doc"] in line
    by_name = {line.split()[0]: line for line in lines}
    assert "unset: the fastest" in by_name["BGE_M3_MODEL"]
    assert "(default: fp32)" not in by_name["BGE_M3_MODEL"]
    assert "(default: None)" not in by_name["BGE_M3_MAX_CHUNK_TOKENS"]
    # "default" or "unset" in another sense: the default is still shown
    assert by_name["BGE_M3_TRUNCATE"].endswith("(default: True)")
    assert by_name["BGE_M3_RERANK"].endswith("(default: False)")
    assert by_name["BGE_M3_WORKERS"].endswith("(default: 1)")
    # what a value may be: a number's range, a choice's values (pretty was missing)
    assert "[1, 256] (default: 1)" in by_name["BGE_M3_WORKERS"]
    assert "auto|json|text|pretty" in by_name["BGE_M3_LOG_FORMAT"]
    assert "fp32|fp16|int8|bf16|ov-int8" in by_name["BGE_M3_MODEL"]
    assert by_name["BGE_M3_EP"].count("cpu|") == 1  # listed by hand: not twice
    assert "[0.1, 1.0]" in by_name["BGE_M3_MEMORY_SAFETY_FACTOR"]


def test_every_variable_the_code_mentions_exists():
    """Each BGE_M3_* name in bgeserve's messages is a real setting (no stale or typo names)."""
    mentioned = set()
    for path in PACKAGE.rglob("*.py"):
        mentioned |= set(re.findall(r"BGE_M3_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert mentioned - set(ENV) == set(REFERENCE_NAMES)  # read as bgeserve's own


@pytest.mark.parametrize("command", ["serve", "probe", "prepare"])
def test_a_bad_variable_stops_the_cli_with_its_message_not_a_traceback(
        command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from bgeserve.cli import main

    monkeypatch.setenv("BGE_M3_WORKERS", "0")
    assert main([command]) == 2
    err = capsys.readouterr().err
    assert "BGE_M3_WORKERS" in err and "Traceback" not in err


@pytest.mark.parametrize("available_mib, expected", [(600, 75), (24 * 1024, 512), (100, 32)])
def test_the_inflight_allowance_follows_the_memory(available_mib: int, expected: int) -> None:
    """An eighth of the memory, at most 512 MiB, at least one largest body (32 MiB)."""
    from bgeserve.cli import inflight_mb

    assert inflight_mb(Settings(available_memory_bytes=available_mib << 20)) == expected


def test_the_environment_records_which_variables_it_set():
    """from_env remembers the variables given (the plan tells a default from a choice), and
    fields given in code count as set; neither changes equality."""
    s = Settings.from_env({"BGE_M3_MODEL": "int8", "BGE_M3_WORKERS": "2", "PATH": "/bin"})
    assert s.explicit == {"BGE_M3_MODEL", "BGE_M3_WORKERS"}
    assert s.is_explicit("BGE_M3_MODEL") and not s.is_explicit("BGE_M3_EP")
    assert Settings(variant="int8").is_explicit("BGE_M3_EP")
    assert Settings.from_env({}) == Settings() and Settings.from_env({}).explicit == frozenset()
    assert {f.name for f in dataclasses.fields(Settings)} - {f.name for f in VARIABLE_FIELDS} \
        == RECORDS


@pytest.mark.parametrize("bind", ["nonsense", "127.0.0.1:99999", ":8081"])
def test_a_bad_bind_flag_stops_serve_as_a_bad_variable_does(
        bind: str, capsys: pytest.CaptureFixture) -> None:
    """``--bind`` is checked as BGE_M3_BIND is: exit 2 with its message (it was taken as
    given: a traceback, or port 99999 listening on 34463)."""
    from bgeserve.cli import main

    assert main(["serve", "--bind", bind]) == 2
    err = capsys.readouterr().err
    assert "--bind" in err and "HOST:PORT" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", [True, False])
def test_a_port_in_use_stops_serve_before_the_model_loads(
        flag: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """A port something listens on is refused at once, exit 2, naming where the address came
    from: uvicorn found it only after the model began loading, and its exit met ONNX
    Runtime's threads mid-load (exit 134 in about half the runs)."""
    import socket

    from bgeserve import service
    from bgeserve.cli import main

    monkeypatch.setattr(service, "Service", None)  # never reached: nothing loads
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        bind = f"127.0.0.1:{held.getsockname()[1]}"
        if flag:
            code = main(["serve", "--bind", bind])
        else:
            monkeypatch.setenv("BGE_M3_BIND", bind)
            code = main(["serve"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"cannot listen on {bind}" in err and ("--bind" if flag else "BGE_M3_BIND") in err
    assert "stop what holds it" in err


def test_a_port_refused_for_permission_or_address_says_what_to_do(monkeypatch) -> None:
    """EACCES (a port under 1024 without the right) and EADDRNOTAVAIL (an address this host
    lacks) each get their own advice, not "stop what holds it" (QA)."""
    import errno
    import socket

    from bgeserve.cli import port_taken

    for code, words in ((errno.EACCES, "CAP_NET_BIND_SERVICE"),
                        (errno.EADDRNOTAVAIL, "no such address")):
        def refuse(self, address, code=code):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(socket.socket, "bind", refuse)
        said = port_taken("127.0.0.1:80", "BGE_M3_BIND")
        assert said is not None and words in said and "stop what holds it" not in said


def test_unknown_bge_m3_variables_are_named_with_the_closest_setting(caplog):
    """A misspelt variable was ignored without a word (BGE_M3_MAX_SEQ_LENGHT=512 served
    8,192-token texts): each BGE_M3_* name that is no setting is warned of, with the setting
    it is closest to; other variables and real settings are not."""
    import logging

    from bgeserve.config import unknown_variables, warn_unknown_variables

    environ = {"BGE_M3_MAX_SEQ_LENGHT": "512", "BGE_M3_MODEL": "fp32", "BGE_M3_XYZZY": "1",
               "PATH": "/bin"}
    assert unknown_variables(environ) == [
        ("BGE_M3_MAX_SEQ_LENGHT is not a bgeserve setting and is ignored; did you mean "
         "BGE_M3_MAX_SEQ_LENGTH?"),
        "BGE_M3_XYZZY is not a bgeserve setting and is ignored"]
    with caplog.at_level(logging.WARNING, logger="bgeserve"):
        warn_unknown_variables(environ)
    assert [r.getMessage() for r in caplog.records] == unknown_variables(environ)
    assert unknown_variables({"BGE_M3_MODEL": "fp32", "HOME": "/root"}) == []
    # Names are case-sensitive: a lower-case one is not read, and is said so (QA: silently).
    assert unknown_variables({"bge_m3_workers": "2", "Bge_M3_Model": "int8"}) == [
        "Bge_M3_Model is not a bgeserve setting and is ignored; did you mean BGE_M3_MODEL?",
        "bge_m3_workers is not a bgeserve setting and is ignored; did you mean BGE_M3_WORKERS?"]


def test_a_cors_origin_no_browser_sends_is_warned_of():
    """Origins are matched exactly against the Origin header (scheme://host[:port]): one
    without a scheme, or with a path or a trailing slash, matches no page (QA: silently)."""
    from bgeserve.config import setting_notes

    notes = setting_notes({"BGE_M3_CORS_ALLOW_ORIGINS": "example.com, https://a.com/,"
                                                        "https://b.example.com:8443,*,null"})
    assert notes == [f"BGE_M3_CORS_ALLOW_ORIGINS: {o!r} is no origin a browser sends "
                     "(scheme://host[:port], no path, e.g. https://app.example.com): pages "
                     "are matched exactly, so none gets CORS headers by it"
                     for o in ("example.com", "https://a.com/")]


def test_bind_flag_overrides_a_bad_bge_m3_bind(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    """``--bind`` takes BGE_M3_BIND's place: a bad value of the variable it overrides was
    refused ("BGE_M3_BIND='garbage' must be HOST:PORT") before the flag was read."""
    import socket

    from bgeserve import service
    from bgeserve.cli import main

    monkeypatch.setattr(service, "Service", None)  # never reached: the port is taken
    monkeypatch.setenv("BGE_M3_BIND", "garbage")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        bind = f"127.0.0.1:{held.getsockname()[1]}"
        assert main(["serve", "--bind", bind]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on {bind}" in err and "garbage" not in err


@pytest.mark.parametrize("var", ["BGE_M3_TOKEN_BUDGET", "BGE_M3_AVAILABLE_MEMORY_BYTES",
                                 "BGE_M3_MAX_BODY_BYTES", "BGE_M3_MAX_CHUNK_TOKENS",
                                 "BGE_M3_MAX_QUEUE_TOKENS", "BGE_M3_GPU_VRAM_BUDGET_BYTES"])
def test_integers_past_what_json_keeps_are_refused_with_the_range(var):
    """2**64 was taken: /health, /info and /openapi.json write these, orjson refuses integers
    of 64 bits and more, and every poll was a 500 (a container's health check never passed)."""
    import orjson

    from bgeserve.config import MAX_INT

    assert getattr(parse(**{var: str(MAX_INT)}), ENV[var].name) == MAX_INT
    error = refuse({var: str(2**64)})
    assert "out of range [" in error.message and f"{MAX_INT}]" in error.message
    orjson.dumps(MAX_INT)  # what a setting may hold, JSON writes


@pytest.mark.parametrize(("var", "raw"), [("BGE_M3_MAX_INFLIGHT_MB", str(2**44)),
                                          ("BGE_M3_MAX_COLBERT_MB", str(2**44)),
                                          ("BGE_M3_ONNX_BATCH_SIZE", "4097")])
def test_counts_multiplied_later_are_bounded_where_they_are_read(var, raw):
    """MiB are shifted into bytes: bounded so the product stays one JSON keeps;
    ONNX_BATCH_SIZE caps the texts of a run as BGE_M3_MAX_CHUNK, which it stands for, and
    is bounded as that is."""
    assert "out of range" in refuse({var: raw}).message


@pytest.mark.parametrize("raw", ["1_0", "\u0662", "\uff18", "1_000"])
def test_numbers_are_plain_ascii_digits(raw):
    """int() takes "1_0" (10) and other scripts' digits ("٢" is 2): refused, with the range."""
    error = refuse({"BGE_M3_WORKERS": raw})
    assert "is not a valid int in [1, 256]" in error.message
    assert "is not a valid float in [0.1, 1.0]" in refuse(
        {"BGE_M3_MEMORY_SAFETY_FACTOR": "0_5"}).message


def test_the_reference_servers_tls_names_are_read_as_bgeserves():
    """BGE_M3_TLS_CERT_PATH / _KEY_PATH (the reference server's names) were ignored with a
    warning and the server served plain HTTP: they are read as *_FILE, said in the log, and
    both names set to different files is refused."""
    from bgeserve.config import setting_notes, unknown_variables

    env = {"BGE_M3_TLS_CERT_PATH": "/tls/c.pem", "BGE_M3_TLS_KEY_PATH": "/tls/k.pem"}
    s = Settings.from_env(env)
    assert (s.tls_cert_file, s.tls_key_file) == (Path("/tls/c.pem"), Path("/tls/k.pem"))
    assert s.is_explicit("BGE_M3_TLS_CERT_FILE")
    assert unknown_variables(env) == []
    assert setting_notes(env) == [
        "BGE_M3_TLS_CERT_PATH (the reference server's name) is read as BGE_M3_TLS_CERT_FILE",
        "BGE_M3_TLS_KEY_PATH (the reference server's name) is read as BGE_M3_TLS_KEY_FILE"]
    assert Settings.from_env({**env, "BGE_M3_TLS_CERT_FILE": "/tls/c.pem"}).tls_cert_file == \
        Path("/tls/c.pem")
    refuse({**env, "BGE_M3_TLS_CERT_FILE": "/other.pem"}, var="BGE_M3_TLS_CERT_FILE")
    # an empty slot of an old template is no name given (it refused a start with the other)
    blank = {"BGE_M3_TLS_CERT_PATH": " ", "BGE_M3_TLS_CERT_FILE": "/tls/c.pem"}
    assert Settings.from_env(blank).tls_cert_file == Path("/tls/c.pem")
    assert setting_notes(blank) == []
    refuse({"BGE_M3_TLS_KEY_PATH": "/tls/k.pem"}, var="BGE_M3_TLS_KEY_FILE")  # needs a cert


def test_onnx_batch_size_says_what_it_stands_for_and_what_wins(caplog):
    """BGE_M3_ONNX_BATCH_SIZE stands for a budget and a chunk cap: each of the two settings it
    replaces, set, wins (BGE_M3_MAX_CHUNK lost without a word), and the log says which (the
    DeprecationWarning alone is hidden by Python's default filters)."""
    import logging

    from bgeserve.config import setting_notes, warn_unknown_variables
    from bgeserve.service.plan import profile_max_batch

    with pytest.warns(DeprecationWarning):
        alone = parse(BGE_M3_ONNX_BATCH_SIZE="16")
    with pytest.warns(DeprecationWarning):
        capped = parse(BGE_M3_ONNX_BATCH_SIZE="16", BGE_M3_MAX_CHUNK="4")
    assert (profile_max_batch(alone), profile_max_batch(capped)) == (16, 4)
    assert setting_notes({"BGE_M3_ONNX_BATCH_SIZE": "16"}) == [
        ("BGE_M3_ONNX_BATCH_SIZE=16 is deprecated: read as BGE_M3_TOKEN_BUDGET (the workspace "
        "of 16 512-token texts); read as BGE_M3_MAX_CHUNK (16 texts per run)")]
    both = {"BGE_M3_ONNX_BATCH_SIZE": "16", "BGE_M3_MAX_CHUNK": "4",
            "BGE_M3_TOKEN_BUDGET": "1000000"}
    assert setting_notes(both) == [
        ("BGE_M3_ONNX_BATCH_SIZE=16 is deprecated: BGE_M3_TOKEN_BUDGET is set and wins over "
        "it; BGE_M3_MAX_CHUNK is set and wins over it")]
    with caplog.at_level(logging.WARNING, logger="bgeserve"):
        warn_unknown_variables(both)
    assert [r.getMessage() for r in caplog.records] == setting_notes(both)


def test_an_api_key_variable_without_a_key_is_said(caplog):
    """BGE_M3_API_KEY=" " (a secret that rendered empty) asks for no key: still so (empty
    means no auth), but the log says so."""
    from bgeserve.config import setting_notes

    assert parse(BGE_M3_API_KEY=" , ").api_keys == ()
    assert setting_notes({"BGE_M3_API_KEY": " , "}) == [
        ("BGE_M3_API_KEY is set but holds no key: requests need none (unset it, or give it "
        "the keys)")]
    assert setting_notes({"BGE_M3_API_KEY": "k1"}) == setting_notes({}) == []
    # any other variable left empty (a template's slot): its default, and a word
    assert setting_notes({"BGE_M3_MODEL_PATH": "", "BGE_M3_WORKERS": " "}) == [
        "BGE_M3_MODEL_PATH is set but empty: its default is used",
        "BGE_M3_WORKERS is set but empty: its default is used"]
