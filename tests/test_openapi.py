"""openapi.yaml is a valid OpenAPI 3.1 document and describes exactly what the app does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import schemathesis
import yaml
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.specs.openapi.definitions import OPENAPI_31_VALIDATOR
from starlette.routing import Route

from bgeserve.config import Settings
from bgeserve.http.app import TEI_PATHS, create_app, routes
from tests.fakes import FakeService

SPEC_PATH = Path(__file__).resolve().parent.parent / "openapi.yaml"
SPEC: dict[str, Any] = yaml.safe_load(SPEC_PATH.read_text())
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def test_spec_is_valid_openapi_31() -> None:
    """The document validates against the official OpenAPI 3.1 schema."""
    assert SPEC["openapi"].startswith("3.1")
    errors = [str(e) for e in OPENAPI_31_VALIDATOR.iter_errors(SPEC)]
    assert errors == []


def test_spec_and_app_have_the_same_operations() -> None:
    """Every route/method the app serves is documented, and nothing else is (HEAD is implicit)."""
    served = {
        (route.path.replace(":path}", "}"), method.lower())
        for route in routes
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"
    }
    documented = {(path, method) for path, item in SPEC["paths"].items() for method in item}
    assert served == documented


# Health checks answer 503 with their report: /health, /health/deep, TEI's GET / and /ping.
HEALTH_CHECKS = frozenset({"health", "deepHealth", "teiRootHealth", "teiPing"})


def test_every_error_status_uses_the_envelope() -> None:
    """Every documented 4xx/5xx response is the error envelope (TEI's error body on TEI's
    paths); 429 documents Retry-After."""
    components = SPEC["components"]["responses"]
    for path, item in SPEC["paths"].items():
        error_schema = "TeiError" if path in TEI_PATHS else "Error"
        for operation in item.values():
            for status, response in operation["responses"].items():
                if "$ref" in response:
                    response = components[response["$ref"].rsplit("/", 1)[1]]
                headers = response.get("headers", {})
                assert "X-Request-ID" in headers
                health_503 = status == "503" and operation["operationId"] in HEALTH_CHECKS
                if int(status) >= 400 and not health_503:
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": f"#/components/schemas/{error_schema}"}
                if status == "429":
                    assert headers["Retry-After"]["required"] is True


# A fresh app for schemathesis; it runs the lifespan itself (once, for the process).
_fake = FakeService(settings=Settings(max_seq_length=64))
schema = schemathesis.openapi.from_path(SPEC_PATH)
schema.app = create_app(_fake.settings, lambda _: _fake)
# Negative cases too: bodies that break the schema must be 4xx, never 5xx.
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])


@schema.parametrize()
@settings(
    max_examples=50,
    derandomize=True,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_app_conforms_to_spec(case: schemathesis.Case) -> None:
    """Generated requests never get a 5xx, and every response is documented and conforms.

    Each case is also replayed with ``model: bge-m3``, since random model names are all 404s.
    """
    case.call_and_validate(checks=CHECKS)
    if isinstance(case.body, dict) and case.body.get("model") != "bge-m3":
        case.body["model"] = "bge-m3"
        case.call_and_validate(checks=CHECKS)
