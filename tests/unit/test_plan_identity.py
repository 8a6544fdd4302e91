"""One plan, one layout (issue 39 item 7): a per-stage plan whose stages share one tp is the mesh of
its degrees, so the search lists it once; the best even-split plan is an even split of one mesh,
with the remainder where ``even_split`` puts it, never a per-stage plan of different degrees."""

from types import SimpleNamespace

from autotune import stages as ST
from autotune.plan import Degrees, Plan, Shares, even_split, stored_plan_is_even
from autotune.search.report import best_layouts
from autotune.specs import load_cluster, load_model

M, C = load_model("tiny"), load_cluster("local:4")


def staged(*st, cluster=C):
    return Plan(stages=tuple(ST.Stage(layers=n, replicas=tuple(ST.Replica(tp=len(d), devices=tuple(d)) for d in reps))
                             for n, reps in st)).resolve(M, cluster, 128, 8)


def test_stages_of_one_tp_are_the_mesh_they_describe():
    mesh = Plan(degrees=Degrees(dp=4)).resolve(M, C, 128, 8)
    as_stages = staged((4, [[0], [1], [2], [3]]))  # stages 4L(tp1x4)
    assert ST.inline(as_stages.stages) == "4L(tp1x4)"
    assert as_stages.layout() == mesh.layout()
    rows = [(SimpleNamespace(user_attrs={"plan": p.to_dict()}), p) for p in (as_stages, mesh)]
    assert len(best_layouts(rows, 5)) == 1
    mixed = staged((2, [[0, 1]]), (2, [[2], [3]][:1]), cluster=load_cluster("local:3"))
    assert mixed.layout() != Plan(degrees=mixed.degrees).layout()  # per-stage degrees stay a layout of their own


def test_the_even_split_is_the_one_resolve_fills():
    c3 = load_cluster("local:3")
    filled = Plan(degrees=Degrees(pp=3)).resolve(M, c3, 128, 8)
    assert list(filled.shares.layers) == even_split(4, 3) and filled.is_even()
    chosen = Plan(degrees=Degrees(pp=3), shares=Shares(layers=(1, 1, 2))).resolve(M, c3, 128, 8)
    assert not chosen.is_even()  # 1/1/2 is a choice the search made, not the split
    for p in (filled, chosen):
        assert stored_plan_is_even(p.to_dict()) == p.is_even()


def test_a_per_stage_plan_of_different_degrees_is_no_even_split():
    mixed = staged((2, [[0, 1]]), (2, [[2], [3]][:1]), cluster=load_cluster("local:3"))
    assert list(mixed.shares.layers) == [2, 2]
    assert not mixed.is_even() and not stored_plan_is_even(mixed.to_dict())
    uniform = staged((2, [[0], [1]]), (2, [[2], [3]]))
    assert uniform.is_even() and stored_plan_is_even(uniform.to_dict())
