"""The served contract: ``GET /openapi.json`` is openapi.yaml with this server's bounds, and a
live server agrees with it under a thousand generated requests (schemathesis, every check).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from schemathesis.specs.openapi.definitions import OPENAPI_31_VALIDATOR
from starlette.testclient import TestClient

from bgeserve.config import Settings
from bgeserve.errors import NotReady
from bgeserve.http import contract
from bgeserve.http.app import create_app
from bgeserve.http.errors import ERROR_STATUS
from tests.fakes import HIDDEN, VOCAB, FakeService
from tests.serverproc import ServerProc
from tests.test_server_live import START_TIMEOUT, server_env

ROOT = Path(__file__).resolve().parent.parent
BOUNDS = contract.Bounds(dense_width=32, vocab_size=3000, max_batch=8, max_text_chars=125,
                         max_seq_length=128, max_body_bytes=1 << 20,
                         model_ids=("bge-m3", "BAAI/bge-m3", "mine"), auth=True,
                         metrics_auth=False)


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def test_the_package_ships_the_root_contract() -> None:
    """bgeserve/http/openapi.yaml (what an installed server reads) is the root openapi.yaml."""
    assert contract.CONTRACT_PATH.read_bytes() == (ROOT / "openapi.yaml").read_bytes()


def test_the_contract_version_is_the_package_version() -> None:
    """openapi.yaml's info.version follows bgeserve's (the served copy keeps it)."""
    from bgeserve import __version__

    assert contract.generic()["info"]["version"] == __version__


def test_every_component_is_referenced() -> None:
    """No response, schema or header component is dead text that no operation uses."""
    doc = contract.generic()
    used = _refs(doc["paths"])
    while True:  # components referenced by referenced components
        more = used | set().union(*(_refs(doc["components"][r.split("/")[2]][r.split("/")[3]])
                                    for r in used))
        if more == used:
            break
        used = more
    for kind in ("responses", "schemas", "headers"):
        for name in doc["components"][kind]:
            assert f"#/components/{kind}/{name}" in used, f"{kind}/{name} is referenced by nothing"


def test_every_status_the_error_table_gives_is_documented() -> None:
    """The embedding routes document every status in ERROR_STATUS, 499 (log-only) included."""
    documented = set(contract.generic()["paths"]["/v1/embeddings"]["post"]["responses"])
    statuses = {str(s) for s in ERROR_STATUS.values()}
    assert statuses <= documented, statuses - documented


def test_the_overlay_fills_in_every_bound() -> None:
    """Each bound lands where the schema states it, and the result is valid OpenAPI 3.1."""
    doc = contract.specialise(contract.generic(), BOUNDS)
    assert [str(e) for e in OPENAPI_31_VALIDATOR.iter_errors(doc)] == []
    schemas = doc["components"]["schemas"]
    assert schemas["TokenIds"]["items"]["maximum"] == 2999
    strings, batch, _, id_batch = schemas["Input"]["oneOf"]
    # No maxLength: a text of any length is valid truncated (its leading words are kept);
    # the limit for one tokenized whole is in the bounds and the prose (Truncate).
    assert "maxLength" not in strings and "maxLength" not in batch["items"]
    assert doc["info"]["x-bgeserve-bounds"]["max_text_chars"] == 125
    assert batch["maxItems"] == id_batch["maxItems"] == 8
    assert schemas["Dimensions"]["enum"] == [32, None]
    assert schemas["Model"]["enum"] == ["bge-m3", "BAAI/bge-m3", "mine", None]
    floats, b64 = schemas["Vector"]["oneOf"]
    assert floats["minItems"] == floats["maxItems"] == 32
    assert b64["minLength"] == b64["maxLength"] == 172  # base64 of 128 bytes
    assert schemas["Colbert"]["oneOf"][0]["items"]["maxItems"] == 32
    assert schemas["Health"]["properties"]["max_seq_length"]["const"] == 128
    assert doc["security"] == [{"bearerAuth": []}]
    assert doc["paths"]["/metrics"]["get"]["security"] == []
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert doc["info"]["x-bgeserve-bounds"]["vocab_size"] == 3000
    assert schemas["TokenIds"]["not"] == {}  # token ids refused: no token-id input is valid
    assert schemas["RerankRequest"]["properties"]["documents"]["maxItems"] == 8
    assert schemas["CohereEmbedRequest"]["properties"]["texts"]["maxItems"] == 8
    by_type = schemas["CohereEmbedResponse"]["properties"]["embeddings"]["oneOf"][1]
    for kind in ("binary", "ubinary"):  # 32 dimensions, 8 sign bits a byte
        packed = by_type["properties"][kind]["items"]
        assert packed["minItems"] == packed["maxItems"] == 4
    accepting = contract.specialise(contract.generic(), replace(BOUNDS, token_ids=True))
    assert "not" not in accepting["components"]["schemas"]["TokenIds"]
    # the generic document is left as it was
    assert "maximum" in contract.generic()["components"]["schemas"]["TokenIds"]["items"]
    assert contract.generic()["components"]["schemas"]["TokenIds"]["items"]["maximum"] == 250001


def test_without_keys_nothing_needs_one() -> None:
    """No BGE_M3_API_KEY: the served document asks for no credentials anywhere."""
    open_bounds = contract.Bounds(**{**vars(BOUNDS), "auth": False, "metrics_auth": True})
    doc = contract.specialise(contract.generic(), open_bounds)
    assert doc["security"] == [] and doc["paths"]["/metrics"]["get"]["security"] == []


def test_a_moved_node_fails_loudly() -> None:
    """An overlay pointer that no longer lands in the document raises, naming it."""
    doc = contract.generic()
    broken = {**doc, "components": {**doc["components"], "schemas": {}}}
    with pytest.raises(KeyError, match="TokenIds"):
        contract.specialise(broken, BOUNDS)


def test_the_route_serves_the_service_bounds() -> None:
    """GET /openapi.json over the fake service: its width and vocabulary, the settings'
    limits, the configured aliases; the key is required like on every other route."""
    settings = Settings(max_batch=12, max_text_chars=999, model_aliases=("alias",),
                        api_keys=("k",))
    fake = FakeService(settings=settings)
    with TestClient(create_app(settings, lambda _: fake)) as client:
        assert client.get("/openapi.json").status_code == 401
        r = client.get("/openapi.json", headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    bounds = r.json()["info"]["x-bgeserve-bounds"]
    assert bounds == {"dense_width": HIDDEN, "vocab_size": VOCAB, "max_batch": 12,
                      "max_text_chars": 999, "max_seq_length": settings.max_seq_length,
                      "max_body_bytes": settings.max_body_bytes,
                      "model_ids": ["bge-m3", "BAAI/bge-m3", "alias"], "auth": True,
                      "metrics_auth": False, "token_ids": False}


def test_while_loading_the_route_answers_503() -> None:
    """Before the model is loaded its width is unknown: 503 in the envelope."""

    class Loading(FakeService):
        def dense_width(self) -> int:
            raise NotReady("the model is still loading; retry shortly")

    fake = Loading()
    with TestClient(create_app(fake.settings, lambda _: fake)) as client:
        r = client.get("/openapi.json")
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"


# -- the live server against its own contract -----------------------------------------------
KEY = "sk-contract"
MIN_CASES = 1000
# A 413 is the right answer to a body over BGE_M3_MAX_BODY_BYTES; schemathesis's default list
# of rejections lacks it.
NEGATIVE_STATUSES = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422",
                     "428", "429", "5xx"]


# The texts stay within BGE_M3_MAX_TEXT_CHARS (125): past it a text the tokenizer cannot cut at
# its leading words is a 413 the schema cannot state (it depends on the words). schemathesis
# mixes known hard strings into its data (a 210-character zalgo text: "input[2] has 210
# characters"), so the premise is enforced here rather than left to the generator's luck.
HOOKS = """
import schemathesis


def _strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


@schemathesis.hook
def filter_body(context, body):
    return all(len(text) <= 125 for text in _strings(body))
"""


@pytest.mark.slow
def test_the_live_server_conforms_to_its_served_contract(tiny_export: Path,
                                                         tmp_path: Path) -> None:
    """schemathesis, every check, >= 1,000 cases over every operation of /openapi.json
    against a live tiny-model server: no 5xx, no schema-valid request refused, no
    schema-invalid one accepted, no undocumented status, header or content type.

    The server runs where the served schema is as exact as its prose allows: texts of at
    most 125 characters under a 128-token limit always fit (this tokenizer gives at most one
    token per character plus the first word's marker, and <s> </s>), so truncate=false never
    meets the sequence length. A text over 125 characters is refused either way (its leading
    125 cannot hold the 128 tokens a cut needs: Truncate, in openapi.yaml), which the schema
    does not state: the generated texts stay far shorter.
    """
    env = server_env(tiny_export, tmp_path / "cache", BGE_M3_API_KEY=KEY,
                     BGE_M3_MAX_SEQ_LENGTH="128", BGE_M3_MAX_TEXT_CHARS="125",
                     BGE_M3_MAX_BATCH="8", BGE_M3_LOG_LEVEL="warning")
    config = tmp_path / "schemathesis.toml"
    config.write_text("[checks.negative_data_rejection]\nexpected-statuses = "
                      + json.dumps(NEGATIVE_STATUSES) + "\n")
    (tmp_path / "contract_hooks.py").write_text(HOOKS)
    report = tmp_path / "report.json"
    with ServerProc(env) as proc:
        proc.wait_health(timeout=START_TIMEOUT)
        served = httpx.get(f"{proc.url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"},
                           timeout=10)
        assert served.status_code == 200, served.text
        # From a file: run from its own URL, schemathesis leaves out the operation serving it.
        (tmp_path / "served.json").write_bytes(served.content)
        operations = sum(len(item) for item in served.json()["paths"].values())
        started = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color",
             "run", str(tmp_path / "served.json"), "--url", proc.url, "--checks", "all",
             "-H", f"Authorization: Bearer {KEY}", "--max-examples", "200", "--no-shrink",
             "--generation-deterministic", "--workers", "1", "--request-timeout", "30",
             "--report", "json", "--report-json-path", str(report)],
            capture_output=True, text=True, timeout=600, check=False,
            env={**os.environ, "SCHEMATHESIS_HOOKS": "contract_hooks",
                 "PYTHONPATH": str(tmp_path)},
            cwd=tmp_path)  # its cache (.schemathesis/) stays out of the checkout
        took = time.monotonic() - started
        assert proc.returncode is None, proc.output()
    summary = json.loads(report.read_text())
    tail = run.stdout[-6000:]
    assert summary["failures"] == [] and summary["errors"] == [], tail
    assert run.returncode == 0, tail
    assert summary["operations"]["tested"] == operations, summary["operations"]
    assert summary["test_cases"]["generated"] >= MIN_CASES, (summary["test_cases"], took)
    print(f"schemathesis: {summary['test_cases']['generated']} cases in {took:.1f}s")
