"""The published MoE runs of benchmarks/data/published_moe.yaml: every row names a described source,
none comes from the project's held-out MoE material, and every row's layout resolves on its cluster
as published (world = the GPUs it ran on; the device is a catalogue entry), so the benchmark prices
each run as it was laid out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autotune.plan import parse_inline
from autotune.specs.catalogue import CATALOGUE
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_published_moe as B  # noqa: E402

SOURCES, ROWS = B.load()
HELD_OUT_MATERIAL = ("2504.14960", "parallel folding", "moe-modelzoo", "megatron-moe-modelzoo", "dgxc-benchmarking")


def test_at_least_twelve_rows_from_three_sources_none_held_out_material():
    assert len(ROWS) >= 12 and len({r.source for r in ROWS}) >= 3
    text = B.DATA.read_text(encoding="utf-8").lower()
    used = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not [m for m in HELD_OUT_MATERIAL if any(m in line for line in used)]
    for s in SOURCES.values():
        assert s["title"] and s["url"].startswith("https://")


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_every_row_resolves_as_published(row):
    assert row.nodes["device"] in CATALOGUE and row.where and row.tokens_per_s_per_gpu > 0
    cluster = cluster_from_dict({"name": row.id, "nodes": [row.nodes], "inter_node": {"bandwidth": row.inter_node}})
    plan = parse_inline(row.plan).resolve(load_model(row.model), cluster, row.seq_len, row.global_batch)
    assert plan.world == B.gpus(row)
    if row.model_tflops_per_gpu:  # the published pair agrees with itself: TFLOP/s per token is one model's figure
        assert 0.0 < row.model_tflops_per_gpu / row.tokens_per_s_per_gpu < 1.0
