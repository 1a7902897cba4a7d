"""Which model files to open, in which graph layout: local directories and pinned hub downloads.

Three layouts reach the engine (see docs/architecture.md): a ``bgeserve export`` (heads inside
the graph), BAAI/bge-m3's own ONNX graph, and Xenova/bge-m3's fp16/int8 graphs (both of the
latter with the heads read from ``sparse_linear.pt`` / ``colbert_linear.pt`` by ``ptload``).
``resolve()`` finds the files, downloading from the hub at pinned commits when no local
directory is given, and translates every failure into ``ModelUnavailable`` saying what to do.
Downloads go through ``hubfetch`` (huggingface_hub 0.24 to 2.x), which imports ``huggingface_hub``
only when a download is needed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from bgeserve.errors import ConfigError, ModelUnavailable
from bgeserve.model.cachedir import validate_cache_dir
from bgeserve.model.hubfetch import Fetcher
from bgeserve.model.layout import Layout, graph_layout
from bgeserve.model.onnxmeta import external_locations
from bgeserve.model.ptload import HeadWeights, load_heads

log = logging.getLogger("bgeserve.model")

__all__ = [
    "HUB_SOURCES",
    "HeadWeights",
    "Layout",
    "ModelArtifacts",
    "export_variants",
    "resolve",
    "validate_cache_dir",
]


@dataclass(frozen=True)
class HubSource:
    """One variant's graph on the hub: repo pinned at a commit, and the files taken from it."""

    layout: Layout
    repo_id: str
    revision: str
    onnx: str
    external_data: tuple[str, ...] = ()  # downloaded beside the graph, where ONNX Runtime looks
    tokenizer: str = "tokenizer.json"


BAAI_REPO, BAAI_REVISION = "BAAI/bge-m3", "5617a9f61b028005a4858fdac845db406aefb181"
XENOVA_REPO, XENOVA_REVISION = "Xenova/bge-m3", "4de13258303883538bd53b696b452bf8099f0858"
HEAD_FILES = ("sparse_linear.pt", "colbert_linear.pt")  # from BAAI_REPO @ BAAI_REVISION
HUB_SOURCES: dict[str, HubSource] = {
    "fp32": HubSource(
        Layout.BAAI,
        BAAI_REPO,
        BAAI_REVISION,
        "onnx/model.onnx",
        ("onnx/model.onnx_data", "onnx/Constant_7_attr__value"),
    ),
    "fp16": HubSource(Layout.HIDDEN, XENOVA_REPO, XENOVA_REVISION, "onnx/model_fp16.onnx"),
    "int8": HubSource(Layout.HIDDEN, XENOVA_REPO, XENOVA_REVISION, "onnx/model_quantized.onnx"),
}
# Variants only `bgeserve export` makes (OpenVINO IRs run by runtime/openvino.py: bf16, and
# ov-int8, NNCF's int8 quantization of it).
EXPORT_ONLY_VARIANTS = ("bf16", "ov-int8")
RUNTIMES = ("onnxruntime", "openvino")
_MANIFEST_FORMAT = "bgeserve-export"
# Sibling files that are never a graph's external data (tokenizer files, configs, weights).
_NOT_DATA_SUFFIXES = {
    ".json",
    ".txt",
    ".md",
    ".model",
    ".py",
    ".pt",
    ".bin",
    ".safetensors",
    ".onnx",
}


@dataclass(frozen=True)
class ModelArtifacts:
    """Everything the engine opens: graph, tokenizer, layout and (unless in-graph) head weights."""

    onnx_path: Path  # not symlink-resolved: external data is looked up beside this path
    tokenizer_path: Path
    layout: Layout
    variant: str
    heads: HeadWeights | None  # None for Layout.BGESERVE (heads are in the graph)
    source: str  # human-readable, for logs and /health
    external_data: tuple[Path, ...] = ()
    # Which runtime reads the graph: "onnxruntime" (an .onnx file), or "openvino" (the bf16
    # and ov-int8 variants of an export: OpenVINO IRs, ``onnx_path`` is its model.xml).
    runtime: str = "onnxruntime"

    def identity(self) -> str:
        """Cheap identity of the graph files (name, size, mtime_ns) for the probe fingerprint."""
        parts = []
        for path in (self.onnx_path, *self.external_data):
            try:
                stat = path.stat()
            except OSError as exc:
                raise ModelUnavailable(f"model file {path} is gone: {exc.strerror}") from exc
            parts.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
        return ";".join(parts)


def resolve(
    *,
    model_path: Path | None,
    variant: str,
    cache_dir: Path,
    offline: bool = False,
    endpoint: str | None = None,
    progress: bool = True,
    reranker: bool = False,
    hub_cache: Path | None = None,
    report: Callable[[str, int, int | None], None] | None = None,
) -> ModelArtifacts:
    """Find (downloading if needed) the files for ``variant``: from ``model_path`` or the hub.

    For a hub model the cache directory (bgeserve's own) is validated first, before any
    network call (a local model needs none). Hub files
    go to the Hugging Face cache ``hub_cache`` (None: huggingface_hub's default, honouring
    HF_HUB_CACHE / HF_HOME); files an earlier bgeserve downloaded into ``cache_dir`` are used
    from there. ``offline`` uses only what is already cached; ``endpoint`` overrides the hub
    URL (None: huggingface_hub's default); ``progress`` draws huggingface_hub's bars and
    ``report`` gets (file, bytes done, bytes total) while a file downloads. ``reranker``: the
    export at ``model_path`` must be a reranker's (else bge-m3's).
    """
    variable = "BGE_M3_RERANK_VARIANT" if reranker else "BGE_M3_MODEL"  # what sets variant
    if variant not in (*HUB_SOURCES, *EXPORT_ONLY_VARIANTS):
        raise ConfigError(
            f"unknown model variant {variant!r}: choose one of "
            f"{', '.join((*HUB_SOURCES, *EXPORT_ONLY_VARIANTS))}",
            param=variable,
        )
    # A local model downloads nothing, or only missing head files (a failure then names the
    # cache): its cache directory need not be writable (the service warns if it is not).
    legacy = validate_cache_dir(cache_dir) if model_path is None else Path(cache_dir).expanduser()
    fetch = Fetcher(hub_cache, offline, endpoint, progress, legacy_cache=legacy, report=report)
    if model_path is not None:
        found = _resolve_local(Path(model_path).expanduser(), variant, fetch, variable)
        if found.layout.reranker != reranker:
            what = "a reranker (bge-reranker-v2-m3)" if found.layout.reranker else "bge-m3"
            raise ModelUnavailable(
                f"{model_path} holds {what}'s export: point "
                f"{'BGE_M3_RERANK_MODEL_PATH' if found.layout.reranker else 'BGE_M3_MODEL_PATH'}"
                " at it (in Python: "
                f"{'bgeserve.Reranker' if found.layout.reranker else 'bgeserve.Engine'})",
                param="BGE_M3_RERANK_MODEL_PATH" if reranker else "BGE_M3_MODEL_PATH")
        return found
    if variant in EXPORT_ONLY_VARIANTS:
        raise ModelUnavailable(
            f"the {variant} variant exists only in a `bgeserve export` (the hub has no such "
            "graph): run `bgeserve export --model BAAI/bge-m3 --out DIR` and set "
            "BGE_M3_MODEL_PATH=DIR",
            param="BGE_M3_MODEL",
        )
    source = HUB_SOURCES[variant]
    onnx = fetch(source.repo_id, source.revision, source.onnx)
    data = _hub_data(fetch, source, onnx)
    tokenizer = fetch(source.repo_id, source.revision, source.tokenizer)
    heads = load_heads(*(fetch(BAAI_REPO, BAAI_REVISION, name) for name in HEAD_FILES))
    description = f"hub {source.repo_id}@{source.revision} ({variant})"
    if source.repo_id != BAAI_REPO:
        description += f", heads from {BAAI_REPO}@{BAAI_REVISION}"
    return ModelArtifacts(onnx, tokenizer, source.layout, variant, heads, description, data)


def _hub_data(fetch: Fetcher, source: HubSource, graph: Path) -> tuple[Path, ...]:
    """``source.external_data`` from the hub (or its cache). One it cannot give is skipped
    where the graph reads no tensor from it: a Hugging Face cache filled by hand with BAAI's
    graph exported again (its weights in one file, or inline) lacks ``Constant_7_attr__value``,
    and was refused for a file nothing reads."""
    found = []
    folder = PurePosixPath(source.onnx).parent
    for name in source.external_data:
        try:
            found.append(fetch(source.repo_id, source.revision, name))
        except ModelUnavailable:
            if _reads(graph, str(PurePosixPath(name).relative_to(folder))) is not False:
                raise
            log.info("%s is not in %s@%s, and %s reads no tensor from it", name,
                     source.repo_id, source.revision, source.onnx)
    return tuple(found)


def _reads(graph: Path, location: str) -> bool | None:
    """Whether the ONNX graph at ``graph`` keeps tensors in ``location`` (beside it); None
    when it cannot be read as a graph (the missing file's own error is the one to say)."""
    try:
        import onnx

        return location in external_locations(onnx.load(str(graph), load_external_data=False))
    except Exception:  # noqa: BLE001 - any failure to parse: not a graph to judge by
        return None


def check_model_dir(root: Path | None) -> None:
    """ModelUnavailable unless ``root`` (BGE_M3_MODEL_PATH; None: the hub's) is a directory."""
    if root is not None and not Path(root).is_dir():
        raise ModelUnavailable(
            f"model directory {root} (BGE_M3_MODEL_PATH) does not exist or is not a "
            "directory",
            param="BGE_M3_MODEL_PATH",
        )


def _resolve_local(root: Path, variant: str, fetch: Fetcher,
                   variable: str = "BGE_M3_MODEL") -> ModelArtifacts:
    check_model_dir(root)
    manifest = _read_manifest(root / "manifest.json")
    if manifest is not None and manifest.get("format") == _MANIFEST_FORMAT:
        return _resolve_export(root, manifest, variant, variable)

    graphs = {v: root / s.onnx for v, s in HUB_SOURCES.items() if (root / s.onnx).is_file()}
    if variant in graphs:
        onnx = graphs[variant]
        # The graph's own outputs decide: BAAI's and Xenova's snapshots and an optimum export
        # all name their fp32 graph onnx/model.onnx.
        layout = graph_layout(onnx)
        if layout is Layout.BGESERVE:
            raise ModelUnavailable(
                f"{onnx} has bgeserve's in-graph heads but {root} has no manifest.json: point "
                "BGE_M3_MODEL_PATH at the whole `bgeserve export` directory",
                param="BGE_M3_MODEL_PATH")
        if layout.reranker:
            raise ModelUnavailable(
                f"{onnx} is a reranker's graph (one relevance logit per row): point "
                "BGE_M3_RERANK_MODEL_PATH at it, and BGE_M3_MODEL_PATH at bge-m3",
                param="BGE_M3_MODEL_PATH")
        kind = {Layout.BAAI: "BAAI/bge-m3", Layout.HIDDEN: "hidden-state"}[layout]
        tokenizer = next(
            (p for p in (root / "tokenizer.json", onnx.parent / "tokenizer.json") if p.is_file()),
            None,
        )
        if tokenizer is None:
            raise ModelUnavailable(
                f"{root} has {onnx.name} but no tokenizer.json", param="BGE_M3_MODEL_PATH"
            )
        heads, heads_note = _local_heads(root, fetch)
        description = f"local {kind} snapshot {root} ({variant}){heads_note}"
        return ModelArtifacts(
            onnx, tokenizer, layout, variant, heads, description, _external_data(onnx)
        )

    pytorch = (root / "config.json").is_file() and any(
        (root / name).is_file() for name in ("model.safetensors", "pytorch_model.bin")
    )
    export = f"run `bgeserve export --model {root} --out OUT` and point BGE_M3_MODEL_PATH at OUT"
    if graphs:
        have = ", ".join(f"{v} ({HUB_SOURCES[v].onnx})" for v in graphs)
        preparable = variant in ("int8", *EXPORT_ONLY_VARIANTS) and "fp32" in graphs
        wanted = (HUB_SOURCES[variant].onnx if variant in HUB_SOURCES
                  else "no snapshot has it: bgeserve makes it")  # bf16, ov-int8
        raise ModelUnavailable(
            f"{root} has no {variant} graph ({wanted}); it has {have}: set "
            f"BGE_M3_MODEL (the library's variant=) to one of those"
            + (f", or make {variant} from it with `bgeserve prepare --variant {variant} --out "
               f"OUT` (BGE_M3_MODEL_PATH={root}; a server does it on its first start) and point "
               "the model path at OUT" if preparable else "")
            + (f", or {export}" if pytorch else ""),
            param="BGE_M3_MODEL",
        )
    if pytorch:
        raise ModelUnavailable(
            f"{root} holds PyTorch weights but no ONNX graph: {export}", param="BGE_M3_MODEL_PATH"
        )
    raise ModelUnavailable(
        f"{root} is not a model directory bgeserve can use: looked for manifest.json (a "
        "`bgeserve export` output), onnx/model.onnx (BAAI/bge-m3, fp32), onnx/model_fp16.onnx "
        "or onnx/model_quantized.onnx (Xenova/bge-m3, fp16/int8)",
        param="BGE_M3_MODEL_PATH",
    )


def _read_manifest(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelUnavailable(f"cannot read {path}: {exc}", param="BGE_M3_MODEL_PATH") from exc
    return data if isinstance(data, dict) else None


def _resolve_export(root: Path, manifest: dict[str, Any], variant: str,
                    variable: str = "BGE_M3_MODEL") -> ModelArtifacts:
    """``variant`` of the export at ``root``; ``variable``: the setting that chose it (the
    reranker's is BGE_M3_RERANK_VARIANT), named where the export lacks it."""
    variants = manifest.get("variants")
    if manifest.get("schema") != 1 or not isinstance(variants, dict):
        raise ModelUnavailable(
            f"{root}/manifest.json has schema {manifest.get('schema')!r}, this bgeserve reads "
            "schema 1: re-export the model with this version of `bgeserve export`",
            param="BGE_M3_MODEL_PATH",
        )
    entry = variants.get(variant)
    if not isinstance(entry, dict):
        if variant in EXPORT_ONLY_VARIANTS:
            hint = ("(written where openvino, and for ov-int8 nncf, are installed: bgeserve "
                    "installs both on x86-64)")
        else:
            hint = ""
        source = manifest.get("source")
        model = source.get("model") if isinstance(source, dict) else None
        raise ModelUnavailable(
            f"export {root} has variants {', '.join(sorted(variants)) or 'none'} but not {variant}: "
            f"set {variable} (the library's variant=) to one of those, or add it with "
            f"`bgeserve export --model "
            f"{model if isinstance(model, str) else 'MODEL'} --out {root} --variant {variant}`"
            + (f" {hint}" if hint else ""),
            param=variable,
        )
    runtime = entry.get("runtime", "onnxruntime")
    if runtime not in RUNTIMES:
        raise ModelUnavailable(
            f"{root}/manifest.json: variant {variant} needs runtime {runtime!r}, which this "
            f"bgeserve does not have (it has {', '.join(RUNTIMES)}): upgrade bgeserve",
            param="BGE_M3_MODEL",
        )
    onnx = _inside(root, entry.get("path"), f"variants.{variant}.path")
    size = onnx.stat().st_size
    if isinstance(entry.get("bytes"), int) and entry["bytes"] != size:
        raise ModelUnavailable(
            f"{onnx} is {size} bytes but manifest.json says {entry['bytes']}: the export is "
            "incomplete or was modified; re-export it",
            param="BGE_M3_MODEL_PATH",
        )
    tokenizer = _inside(root, manifest.get("tokenizer", "tokenizer.json"), "tokenizer")
    if runtime == "openvino":
        weights = onnx.with_suffix(".bin")
        if not weights.is_file():
            raise ModelUnavailable(f"{weights} (the weights of {onnx.name}) is missing: "
                                   "re-export the model", param="BGE_M3_MODEL_PATH")
        data: tuple[Path, ...] = (weights,)
    else:
        data = _external_data(onnx)
    return ModelArtifacts(
        onnx,
        tokenizer,
        Layout.SCORE if manifest.get("kind") == "reranker" else Layout.BGESERVE,
        variant,
        None,
        f"local export {root} ({variant}, {runtime})",
        data,
        runtime,
    )


def export_variants(root: Path | None) -> dict[str, dict[str, Any]]:
    """The variants a local ``bgeserve export`` at ``root`` holds, with their manifest entries
    (including the ``agreement`` with fp32 measured at export); {} for anything else."""
    if root is None:
        return {}
    try:
        manifest = _read_manifest(Path(root).expanduser() / "manifest.json")
    except ModelUnavailable:
        return {}
    if manifest is None or manifest.get("format") != _MANIFEST_FORMAT:
        return {}
    variants = manifest.get("variants")
    if not isinstance(variants, dict):
        return {}
    return {k: v for k, v in variants.items() if isinstance(v, dict)}


def _inside(root: Path, relative: object, field: str) -> Path:
    """``root / relative`` for a manifest path that must name an existing file inside ``root``."""
    path = root / relative if isinstance(relative, str) and relative else None
    if path is None or not path.resolve().is_relative_to(root.resolve()):
        raise ModelUnavailable(
            f"{root}/manifest.json: {field} = {relative!r} is not a path inside the export",
            param="BGE_M3_MODEL_PATH",
        )
    if not path.is_file():
        raise ModelUnavailable(f"{path} (manifest {field}) is missing", param="BGE_M3_MODEL_PATH")
    return path


def _local_heads(root: Path, fetch: Fetcher) -> tuple[HeadWeights, str]:
    """Heads from ``root`` when both files are there, else from BAAI/bge-m3 via the cache."""
    local = [root / name for name in HEAD_FILES]
    if all(path.is_file() for path in local):
        return load_heads(*local), ""
    try:
        paths = [fetch(BAAI_REPO, BAAI_REVISION, name) for name in HEAD_FILES]
    except ModelUnavailable as exc:
        raise ModelUnavailable(
            f"{root} has no {' / '.join(HEAD_FILES)} (copy them from {BAAI_REPO} into it), and "
            + exc.message,
            param="BGE_M3_MODEL_PATH",
        ) from exc
    return load_heads(*paths), f", heads from {BAAI_REPO}@{BAAI_REVISION}"


def _external_data(onnx: Path) -> tuple[Path, ...]:
    """Files beside ``onnx`` that may hold its external tensors (not other graphs' data)."""
    siblings = [p for p in onnx.parent.iterdir() if p.is_file() and not p.name.startswith(".")]
    others = {p.name[: -len(".onnx")] for p in siblings if p.suffix == ".onnx" and p != onnx}
    return tuple(
        sorted(
            p
            for p in siblings
            if p.suffix not in _NOT_DATA_SUFFIXES
            and not any(p.name.startswith((f"{o}.", f"{o}_data")) for o in others)
        )
    )
