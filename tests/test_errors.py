"""``bgeserve.errors``: the refusals built from a value (no model, no server)."""

from __future__ import annotations

from bgeserve.errors import surrogate_error


def test_surrogate_error_names_the_first_string_holding_one() -> None:
    """Lists and objects are walked in order; a surrogate pair's halves together are not
    found (Python keeps a decoded pair as one character)."""
    assert surrogate_error({"input": ["ok", "\U0001f600"], "model": "m"}, "") is None
    found = surrogate_error({"model": "m", "input": ["ok", ["x", "a\ud800"]]}, "")
    assert found is not None and found.param == "input[1][1]"
    assert "U+D800 at character 1" in found.message
    found = surrogate_error(["ok", {"text": "\udfff"}], "documents")
    assert found is not None and found.param == "documents[1].text"
    assert surrogate_error(5, "x") is None and surrogate_error("", "x") is None
