"""The one list of parallel dimensions (autotune/dims.py) against what reads it: Degrees' fields,
world and JSON, the mesh's groups against each rank's group collected one by one (Plan.group_ranks),
the ZeRO shard group, the runtime's gradient group rule, the search knobs and the exporters'
"can express" rule."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from autotune import dims
from autotune.export import common as EC
from autotune.plan import DIMS, Degrees, Plan, Shares, parse_inline
from search_spaces import default as DS

MESHES = [Degrees(**dict(zip(dims.MESH_ORDER, v, strict=True)))
          for v in itertools.product((1, 2), (1, 3), (1, 2), (1, 2), (1, 2)) if math.prod(v) <= 24]


def test_every_declared_dimension_is_a_degree_with_default_one():
    assert tuple(f.name for f in dataclasses.fields(Degrees)) == dims.WRITTEN
    assert set(DIMS) == {n for n in dims.NAMES if not dims.dimension(n).folds}
    assert Degrees() == Degrees(**{n: 1 for n in dims.NAMES})
    assert dims.WRITTEN[0] == dims.WRITTEN_FIRST and dims.MESH_ORDER == dims.mesh_names("attention")
    for d in dims.DIMENSIONS:  # every share a dimension carries is a Shares field
        assert d.share is None or d.share in {f.name for f in dataclasses.fields(Shares)}


@pytest.mark.parametrize("deg", MESHES, ids=lambda d: d.inline())
def test_groups_and_strides_equal_each_ranks_group(deg):
    plan = Plan(degrees=deg)
    assert deg.world == math.prod(getattr(deg, n) for n in dims.NAMES if not dims.dimension(n).folds)
    for name in dims.MESH_ORDER:
        by_rank = sorted({tuple(plan.group_ranks(name, r)) for r in range(deg.world)})
        assert [tuple(g) for g in dims.groups(deg, name)] == by_rank
        g = dims.groups(deg, name)[0]
        if len(g) > 1:
            assert g[1] - g[0] == dims.stride(deg, name)
    for r in range(deg.world):  # coordinates invert the rank formula
        assert plan.rank_of(**dims.coords(deg, r)) == r


@pytest.mark.parametrize("deg", MESHES, ids=lambda d: d.inline())
def test_shard_group_is_the_ranks_sharing_every_other_coordinate(deg):
    """ZeRO's group (dims.SHARED_BY) and the runtime's gradient group (dims.DENSE_REDUCE): the ranks
    whose coordinates differ only along those dimensions, found by brute force."""
    for names in (dims.SHARED_BY, dims.DENSE_REDUCE):
        for r in range(deg.world):
            c = dims.coords(deg, r)
            brute = [q for q in range(deg.world)
                     if all(dims.coords(deg, q)[n] == c[n] for n in dims.MESH_ORDER if n not in names)]
            assert dims.ranks_along(deg, names, r) == brute
        assert len(dims.ranks_along(deg, dims.SHARED_BY, 0)) == dims.shard_size(deg)


def test_inline_json_and_product_read_as_before():
    deg = parse_inline("tp=2,pp=3,hp=2").degrees
    assert deg.inline() == "pp=3,hp=2,tp=2" and Degrees().inline() == "dp=1"
    assert list(deg.to_dict()) == [n for n in dims.WRITTEN if not dims.dimension(n).folds]  # folded 1s left out
    assert deg.product_text() == "dp(1)*pp(3)*cp(1)*hp(2)*tp(2)"
    assert Plan.from_dict(Plan(degrees=deg).to_dict()).degrees == deg


def test_search_knobs_are_the_declared_degrees():
    """Every dimension that multiplies the world but the remainder (dp) is a knob, and a point's
    degrees are the knobs' values."""
    assert {f"{n}_exp" for n in DS.DEGREE_KNOBS} == {
        f"{d.name}_exp" for d in dims.DIMENSIONS if not d.folds and d.name != DS.REMAINDER}
    assert DS.PLACEMENTS[1:] == dims.MESH_ORDER[:-1]


def test_a_target_refuses_every_dimension_it_does_not_list():
    plan = parse_inline("dp=2,cp=2,hp=2,tp=2")
    got = EC.unexpressed(plan, "x", ("dp",), {"hp": "its own words"})
    assert got == ["cp(2): x has no " + dims.dimension("cp").doc, "hp(2): its own words",
                   "tp(2): x has no " + dims.dimension("tp").doc]
    assert EC.unexpressed(plan, "x", dims.NAMES) == []
    moe = parse_inline("dp=4,ep=2")  # a folding dimension is refused the same way
    assert EC.unexpressed(moe, "x", DIMS) == ["ep(2): x has no " + dims.dimension("ep").doc]
