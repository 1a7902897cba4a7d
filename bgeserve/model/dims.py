"""The encoder sizes a model's files record: what the cost model and the limits are sized by.

A ``bgeserve export`` records them in its manifest (``model``: hidden, heads, intermediate,
attention_block, max_positions); a hub snapshot in its ``config.json``. Both are read without
loading the graph; a missing or unreadable file means "bge-m3's", never an error.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from bgeserve.model.artifacts import ModelArtifacts

log = logging.getLogger("bgeserve.engine")
DENSE_WIDTH = 1024  # BAAI/bge-m3's hidden size
# transformers' model types whose positions count from padding_idx + 1.
ROBERTA_TYPES = frozenset({"xlm-roberta", "roberta", "camembert", "xlm-roberta-xl", "xmod"})


def _manifest_model(artifacts: ModelArtifacts, keys: Sequence[str]) -> dict[str, int]:
    """The export manifest's ``model`` sizes among ``keys`` (none for hub layouts)."""
    if artifacts.layout.exported:
        manifest = artifacts.onnx_path.parent.parent / "manifest.json"
        try:
            dims = json.loads(manifest.read_text()).get("model", {})
            return {k: int(dims[k]) for k in keys if dims.get(k) is not None}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}
    return {}


def model_dims(artifacts: ModelArtifacts) -> dict[str, int]:
    """Encoder sizes for the conservative cost model: an export's manifest, a snapshot's
    config.json (its graph has plain attention, so no ``attention_block``); bge-m3's for
    whatever neither says."""
    keys = ("hidden", "heads", "intermediate", "attention_block")
    if artifacts.layout.exported:
        return _manifest_model(artifacts, keys)
    config = _config_json(artifacts)
    names = {"hidden": "hidden_size", "heads": "num_attention_heads",
             "intermediate": "intermediate_size"}
    out = {}
    for key, name in names.items():
        try:
            out[key] = int(config[name])
        except (KeyError, TypeError, ValueError):
            continue
    return out


def model_max_seq(artifacts: ModelArtifacts) -> int | None:
    """Tokens per text the model's position embeddings hold (8,192 for bge-m3, 512 for a
    model left at XLM-R's 514 positions): an export's manifest records it, a hub snapshot's
    config.json has ``max_position_embeddings`` (2 more); None when neither says."""
    if artifacts.layout.exported:
        return _manifest_model(artifacts, ("max_positions",)).get("max_positions")
    config = _config_json(artifacts)
    try:
        return int(config["max_position_embeddings"]) - position_offset(config)
    except (KeyError, TypeError, ValueError):
        return None


def position_offset(config: dict) -> int:
    """Positions a model of ``config`` keeps before its first token's: RoBERTa's family counts
    from the pad id + 1 (2 for XLM-R: 514 positions hold 512 tokens); BERT's and the others'
    from 0 (a BERT reranker's stock graph was held to 510 tokens of its 512)."""
    if config.get("model_type", "xlm-roberta") in ROBERTA_TYPES:
        return int(config.get("pad_token_id", 1)) + 1
    return 0


def fitting_max_seq(requested: int, artifacts: ModelArtifacts) -> int:
    """``requested`` tokens per text, but no more than the model holds: a longer text would
    index past its position embeddings and fail the whole chunk."""
    held = model_max_seq(artifacts)
    return held if held is not None and 2 <= held < requested else requested


def clamp_max_seq(requested: int, artifacts: ModelArtifacts) -> int:
    """``fitting_max_seq``, said in the log where it cuts ``requested``."""
    fitted = fitting_max_seq(requested, artifacts)
    if fitted < requested:
        log.warning("max_seq %d is more than this model's %d positions hold: texts are "
                    "truncated at %d tokens (BGE_M3_MAX_SEQ_LENGTH)", requested, fitted, fitted)
    return fitted


def _config_json(artifacts: ModelArtifacts) -> dict:
    try:
        config = json.loads((artifacts.tokenizer_path.parent / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def width(artifacts: ModelArtifacts) -> int:
    """The dense and ColBERT vector width (1,024 for bge-m3): the export's manifest or the
    snapshot's config.json (``hidden_size``) says; bge-m3's when neither does."""
    if artifacts.layout.exported:
        return _manifest_model(artifacts, ("hidden",)).get("hidden", DENSE_WIDTH)
    try:
        return int(_config_json(artifacts)["hidden_size"])
    except (KeyError, TypeError, ValueError):
        return DENSE_WIDTH
