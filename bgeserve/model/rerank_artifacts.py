"""Which reranker files to open: a local export or snapshot, or the pinned hub model.

Three sources reach the engine, each as ``ModelArtifacts`` with a reranker layout:

- a ``bgeserve export`` of the reranker (manifest ``kind: reranker``): ``score`` [B], the
  bounded-memory graph, any variant it holds (``Layout.SCORE``);
- a snapshot with a stock ONNX graph (``onnx/model.onnx``, ``onnx/model_fp16.onnx``,
  ``onnx/model_quantized.onnx``: optimum's / Xenova's names) whose ``logits`` [B, 1] comes from
  plain attention (``Layout.LOGITS``; its memory is the cost model's to bound);
- with no directory, ``BAAI/bge-reranker-v2-m3`` at the commit pinned here: its
  ``onnx/model.onnx`` (and ``onnx/model.onnx_data`` where the hub has it) and tokenizer.

A PyTorch-only checkpoint cannot be served (the server runs no torch): the error says to run
``bgeserve export`` on it.
"""

from __future__ import annotations

from pathlib import Path

from bgeserve.errors import ConfigError, ModelUnavailable
from bgeserve.model.artifacts import Layout, ModelArtifacts, resolve, validate_cache_dir
from bgeserve.model.hubfetch import Fetcher
from bgeserve.model.kind import RERANKER, directory_kind

# The hub's main at 2026-05, as two independent deployments record it (not verifiable from an
# offline machine: `huggingface-cli download BAAI/bge-reranker-v2-m3` prints the commit it got).
RERANK_REPO, RERANK_REVISION = "BAAI/bge-reranker-v2-m3", "953dc6f6f85a1b2dbfca4c34a2796e7dde08d41e"
RERANK_MODEL_ID = "bge-reranker-v2-m3"
RERANK_MODEL_IDS = (RERANK_MODEL_ID, RERANK_REPO)
STOCK_GRAPHS = {"fp32": "onnx/model.onnx", "fp16": "onnx/model_fp16.onnx",
                "int8": "onnx/model_quantized.onnx"}
HUB_DATA = "onnx/model.onnx_data"  # a 2.27 GB fp32 graph keeps its weights beside it
PARAM = "BGE_M3_RERANK_MODEL_PATH"


def resolve_reranker(*, model_path: Path | None, variant: str, cache_dir: Path,
                     offline: bool = False, endpoint: str | None = None,
                     progress: bool = True, hub_cache: Path | None = None) -> ModelArtifacts:
    """The reranker's files for ``variant``: from ``model_path``, else the pinned hub model
    (into the Hugging Face cache ``hub_cache``; None: huggingface_hub's own).

    Raises:
        ModelUnavailable: the directory holds no reranker bgeserve can serve (the message says
            what it found and what to do), or the download failed.
        ConfigError: a variant the source does not have.
    """
    if model_path is None:
        # The Hugging Face cache, as for bge-m3 (model/artifacts.py): files downloaded into
        # bgeserve's cache directory by an earlier version are still found there.
        return _hub(variant, Fetcher(hub_cache, offline, endpoint, progress,
                                     legacy_cache=validate_cache_dir(cache_dir),
                                     path_variable="BGE_M3_RERANK_MODEL_PATH"))
    root = Path(model_path).expanduser()
    kind = directory_kind(root) if root.is_dir() else None
    if (root / "manifest.json").is_file():
        if kind != RERANKER:
            raise ModelUnavailable(f"{root} is a bge-m3 export, not a reranker's: point "
                                   "BGE_M3_MODEL_PATH at it, and BGE_M3_RERANK_MODEL_PATH at "
                                   "`bgeserve export --model BAAI/bge-reranker-v2-m3`'s output",
                                   param=PARAM)
        return resolve(model_path=root, variant=variant, cache_dir=cache_dir, offline=offline,
                       endpoint=endpoint, progress=progress, reranker=True)
    if not root.is_dir():
        raise ModelUnavailable(f"reranker directory {root} ({PARAM}) does not exist",
                               param=PARAM)
    if kind != RERANKER:
        raise ModelUnavailable(f"{root} is not a reranker: its config.json names no "
                               "...ForSequenceClassification architecture", param=PARAM)
    return _stock(root, variant)


def _stock(root: Path, variant: str) -> ModelArtifacts:
    have = {v: root / name for v, name in STOCK_GRAPHS.items() if (root / name).is_file()}
    export = (f"run `bgeserve export --model {root} --out OUT` (it needs the export extra) and "
              "set BGE_M3_RERANK_MODEL_PATH=OUT")
    if not have:
        raise ModelUnavailable(f"{root} holds a PyTorch reranker but no ONNX graph: {export}",
                               param=PARAM)
    if variant not in have:
        raise ConfigError(f"{root} has no {variant} reranker graph ({STOCK_GRAPHS.get(variant)}); "
                          f"it has {', '.join(sorted(have))}: set BGE_M3_RERANK_VARIANT to one "
                          f"of those, or {export}", param="BGE_M3_RERANK_VARIANT")
    onnx = have[variant]
    tokenizer = next((p for p in (root / "tokenizer.json", onnx.parent / "tokenizer.json")
                      if p.is_file()), None)
    if tokenizer is None:
        raise ModelUnavailable(f"{root} has {onnx.name} but no tokenizer.json", param=PARAM)
    data = tuple(p for p in (onnx.with_name(onnx.name + "_data"),
                             onnx.with_name(onnx.name + ".data")) if p.is_file())
    return ModelArtifacts(onnx, tokenizer, Layout.LOGITS, variant, None,
                          f"local reranker snapshot {root} ({variant})", data)


def _hub(variant: str, fetch: Fetcher) -> ModelArtifacts:
    if variant != "fp32":
        raise ConfigError(f"the hub's {RERANK_REPO} has an fp32 ONNX graph only, not {variant}: "
                          f"unset BGE_M3_RERANK_VARIANT, or export the variants you want with "
                          f"`bgeserve export --model {RERANK_REPO} --out OUT` and set "
                          "BGE_M3_RERANK_MODEL_PATH=OUT", param="BGE_M3_RERANK_VARIANT")
    onnx = fetch(RERANK_REPO, RERANK_REVISION, STOCK_GRAPHS["fp32"])
    try:
        data: tuple[Path, ...] = (fetch(RERANK_REPO, RERANK_REVISION, HUB_DATA),)
    except ModelUnavailable as exc:
        # A graph under 2 GiB has its weights inside; anything else is a real failure.
        if type(exc.__cause__).__name__ not in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
            raise
        data = ()
    tokenizer = fetch(RERANK_REPO, RERANK_REVISION, "tokenizer.json")
    fetch(RERANK_REPO, RERANK_REVISION, "config.json")  # its sizes size the cost model
    return ModelArtifacts(onnx, tokenizer, Layout.LOGITS, variant, None,
                          f"hub {RERANK_REPO}@{RERANK_REVISION} (fp32)", data)
