"""Expert parallelism in the plan: ep/etp degrees folded onto each stage's ranks, expert shares,
inline and JSON forms, the schema, one-line refusals, and the expert mesh against brute force."""

import itertools

import pytest

from autotune.plan import Degrees, Plan, PlanError, check_schema, expert_groups, parse_inline
from autotune.specs.cluster import load_cluster
from autotune.specs.model import load_model

MOE = load_model("tiny-moe")  # 8 experts, top-2, expert_ffn_hidden 64


def test_expert_degrees_fold_onto_the_stage_ranks():
    d = Degrees(dp=4, pp=2, tp=2, ep=4, etp=2)
    assert d.world == 16 and d.edp == 1
    assert Degrees(dp=8, ep=4).edp == 2


def test_inline_and_json_round_trip_through_the_schema():
    p = parse_inline("dp=4,tp=2,pp=2,ep=4,etp=2,experts=3/2/2/1")
    r = p.resolve(MOE, load_cluster("local:16"), 64, 8)
    d = r.to_dict()
    assert d["degrees"]["ep"] == 4 and d["degrees"]["etp"] == 2 and d["shares"]["experts"] == [3, 2, 2, 1]
    check_schema(d)
    assert Plan.from_dict(d) == r
    assert r.degrees.inline() == "dp=4,pp=2,tp=2,ep=4,etp=2"


def test_even_expert_shares_by_default():
    r = parse_inline("dp=4,ep=4").resolve(MOE, load_cluster("local:4"), 64, 8)
    assert r.shares.experts == (2, 2, 2, 2)


def test_dense_plan_json_is_unchanged():
    r = parse_inline("dp=2,tp=2").resolve(load_model("tiny"), load_cluster("local:4"), 64, 8)
    d = r.to_dict()
    assert set(d["degrees"]) == {"dp", "pp", "cp", "hp", "tp"}
    assert set(d["shares"]) == {"layers", "tokens", "heads", "samples"}
    assert r.degrees.inline() == "dp=2,tp=2"


@pytest.mark.parametrize("inline,model,field_text", [
    ("dp=4,ep=3", "tiny-moe", "degrees.ep: ep(3)*etp(1) does not divide"),
    ("dp=4,ep=2,etp=2,tp=1", "tiny-moe", None),
    ("dp=4,etp=3", "tiny-moe", "degrees.etp"),
    ("dp=4,ep=2", "tiny", "degrees.ep: ep(2) > 1 but model 'tiny' has no experts"),
    ("dp=4,ep=4,experts=4/2/2/0", "tiny-moe", "shares.experts: every entry must be >= 1"),
    ("dp=4,ep=4,experts=3/3/3/3", "tiny-moe", "shares.experts: [3, 3, 3, 3] adds up to 12, expected 8"),
    ("dp=4,ep=2,experts=8", "tiny-moe", "shares.experts: 1 entries, expected 2"),
])
def test_expert_plan_rules_are_one_line_reasons(inline, model, field_text):
    n = 4
    go = lambda: parse_inline(inline).resolve(load_model(model), load_cluster(f"local:{n}"), 64, 8)  # noqa: E731
    if field_text is None:
        go()
        return
    with pytest.raises(PlanError) as e:
        go()
    assert field_text in str(e.value) and "\n" not in str(e.value)


def test_experts_indivisible_by_ep_is_refused_with_even_shares():
    m = load_model("qwen3-30b-a3b")  # 128 experts
    c = load_cluster("local:16")
    with pytest.raises(PlanError, match="shares.experts: moe.experts\\(128\\) is not divisible by ep\\(3\\)"):
        parse_inline("dp=12,ep=3").resolve(m, load_cluster("local:12"), 64, 12)
    parse_inline("dp=12,ep=3,experts=43/43/42").resolve(m, load_cluster("local:12"), 64, 12)
    assert c.num_devices == 16


@pytest.mark.parametrize("dp,cp,tp,pp,ep,etp", [(4, 1, 2, 2, 4, 2), (8, 1, 1, 1, 2, 2), (2, 2, 2, 2, 2, 1),
                                                (4, 1, 2, 1, 8, 1)])
def test_expert_groups_match_the_folded_mesh(dp, cp, tp, pp, ep, etp):
    d = Degrees(dp=dp, cp=cp, tp=tp, pp=pp, ep=ep, etp=etp)
    block = d.stage_ranks
    coords = {}
    for r in range(d.world):  # brute force: within a stage's block, etp innermost, then ep, then edp
        stage, local = divmod(r, block)
        coords[r] = (stage, local // (ep * etp), (local // etp) % ep, local % etp)
    for dim, axis in (("edp", 1), ("ep", 2), ("etp", 3)):
        want = {}
        for r, c in coords.items():
            want.setdefault(tuple(x for i, x in enumerate(c) if i != axis), []).append(r)
        assert sorted(expert_groups(d, dim)) == sorted(want.values())
    assert all(len(g) == ep for g in expert_groups(d, "ep"))
    assert list(itertools.chain(*expert_groups(d, "etp"))) == list(range(d.world))
