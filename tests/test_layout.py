"""Tests for bgeserve.model.layout: a graph's layout from its output names."""

from __future__ import annotations

import pytest

from bgeserve.model.layout import Layout, layout_of


@pytest.mark.parametrize(("outputs", "layout"), [
    (("dense", "sparse_weights", "colbert"), Layout.BGESERVE),
    (("colbert", "dense", "sparse_weights", "last_hidden_state"), Layout.BGESERVE),
    (("sentence_embedding", "token_embeddings"), Layout.BAAI),
    (("token_embeddings", "sentence_embedding", "last_hidden_state"), Layout.BAAI),
    (("last_hidden_state",), Layout.HIDDEN),
    (("last_hidden_state", "pooler_output"), Layout.HIDDEN),
    (("token_embeddings",), None),
    (("dense", "sparse_weights"), None),
    ((), None),
])
def test_the_most_specific_layout_whose_outputs_are_all_there_wins(outputs, layout) -> None:
    """A layout matches when the graph has all of its outputs; heads-in-graph beats BAAI beats
    hidden states; partial matches are no layout."""
    assert layout_of(outputs) is layout


def test_each_hub_layout_names_its_hidden_state_output() -> None:
    """BAAI's hidden state is token_embeddings, Xenova's / optimum's last_hidden_state."""
    assert Layout.BAAI.hidden_output == "token_embeddings"
    assert Layout.HIDDEN.hidden_output == "last_hidden_state"
    assert Layout.BGESERVE.hidden_output is None
