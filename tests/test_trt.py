"""TensorRT's plain parts without a GPU: provider options, engine cache, fsync, warm-up grid."""

from __future__ import annotations

import logging
from pathlib import Path

from bgeserve.runtime import trt


def test_tensorrt_options_have_fp16_caches_and_an_explicit_profile(tmp_path: Path):
    """TensorRT: fp16, engines in trt-engines/, timings in trt-timing/, min/opt/max profile."""
    opts = trt.trt_options(tmp_path, trt.trt_profile(64, 8192), max_workspace_bytes=1 << 30)
    assert opts == {
        "trt_fp16_enable": "True",
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(tmp_path / "trt-engines"),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(tmp_path / "trt-timing"),
        "trt_profile_min_shapes": "input_ids:1x1,attention_mask:1x1",
        "trt_profile_opt_shapes": "input_ids:8x512,attention_mask:8x512",
        "trt_profile_max_shapes": "input_ids:64x8192,attention_mask:64x8192",
        "trt_max_workspace_size": str(1 << 30),
    }


def test_the_trt_cache_announcement_counts_engines(tmp_path: Path, caplog):
    """Engines present → ``trt cache: found N cached engines at PATH``; other files don't count."""
    folder = tmp_path / "trt-engines"
    folder.mkdir()
    for name in ("a_sm90.engine", "b_sm90.engine", "a_sm90.profile"):
        (folder / name).write_bytes(b"x")
    with caplog.at_level(logging.INFO, "bgeserve.gpu"):
        assert trt.announce_trt_cache(folder) == 2
    assert f"trt cache: found 2 cached engines at {folder}" in caplog.text


def test_fsync_tree_syncs_every_file(tmp_path: Path):
    """Every regular file below the folder is synced (symlinks are not followed)."""
    (tmp_path / "sub").mkdir()
    for name in ("a.engine", "b.profile", "sub/c.timing"):
        (tmp_path / name).write_bytes(b"plan")
    (tmp_path / "link").symlink_to(tmp_path / "a.engine")
    assert trt.fsync_tree(tmp_path) == 3
    assert trt.fsync_tree(tmp_path / "missing") == 0


# ------------------------------------------------------------------------- warm-up shapes
def test_the_default_grid_is_batch_major():
    """Empty value → {1,2,4,8,16,32} × {128,512,2048,8192}, smallest batches first."""
    shapes = trt.parse_warmup_shapes("", 8192)
    assert len(shapes) == 24
    assert shapes[:5] == [(1, 128), (1, 512), (1, 2048), (1, 8192), (2, 128)]
    assert shapes[-1] == (32, 8192)


def test_valid_shapes_parse_in_order_without_duplicates():
    """``BxL`` tokens, any case and spacing, deduplicated, order kept."""
    assert trt.parse_warmup_shapes(" 1x128, 8X512 ,1x128,,", 8192) == [(1, 128), (8, 512)]


def test_invalid_tokens_are_skipped_with_a_warning(caplog):
    """Malformed or zero tokens are skipped and named in a warning; all invalid → default."""
    with caplog.at_level(logging.WARNING, "bgeserve.gpu"):
        assert trt.parse_warmup_shapes("1x128,banana,0x512,4x,2x256", 8192) == [(1, 128),
                                                                                 (2, 256)]
    assert "'banana'" in caplog.text and "'0x512'" in caplog.text and "'4x'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, "bgeserve.gpu"):
        assert trt.parse_warmup_shapes("nope", 8192) == list(trt.DEFAULT_WARMUP_SHAPES)
    assert "no valid shape" in caplog.text


def test_shapes_beyond_max_seq_or_max_chunk_are_dropped(caplog):
    """Longer than max_seq (or wider than the profile's batch) → dropped, with a warning."""
    with caplog.at_level(logging.WARNING, "bgeserve.gpu"):
        shapes = trt.parse_warmup_shapes("", 1024, max_batch=8)
    assert shapes == [(b, s) for b in (1, 2, 4, 8) for s in (128, 512)]
    assert "2048" in caplog.text and "BGE_M3_MAX_SEQ_LENGTH=1024" in caplog.text
    assert trt.parse_warmup_shapes("1x4096", 1024) == [(1, 1024)]  # nothing left → 1×max_seq


def test_stride_sharding_splits_the_grid_disjointly():
    """Worker k takes the shapes at i % n == k; together the shards are the grid."""
    shapes = list(trt.DEFAULT_WARMUP_SHAPES)
    shards = [trt.shard(shapes, k, 3) for k in range(3)]
    assert shards[1][:2] == [shapes[1], shapes[4]]
    assert sorted(s for sh in shards for s in sh) == sorted(shapes)
    assert trt.shard(shapes, 0, 1) == shapes
