"""Two memos of a search's report against their references: ``study.plan_key`` of a plan dict whose
placement the search encoded once (search/bulk.EncodedList) is the text ``json.dumps`` writes for the
same plan read back from JSON, and ``export.common.node_blocks`` memoised per placement answers what
its computation answers, with lists the caller owns."""

from __future__ import annotations

import json

import optuna
from _search_helpers import toy_estimate

from autotune.export import common as C
from autotune.plan import Placement, Plan
from autotune.search import SearchOptions, search
from autotune.search.bulk import EncodedList
from autotune.specs import load_cluster, load_model
from autotune.study import open_study, plan_key


def _reference(plan_dict) -> str:
    plain = json.loads(json.dumps(plan_dict))  # as any process reads it back from the storage
    d = {k: v for k, v in plain.items() if k not in ("predicted", "measured", "provenance", "workload")}
    return json.dumps(d, sort_keys=True)


def test_plan_key_of_a_search_s_plans_is_the_plain_json_key():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    search(load_model("tiny"), load_cluster("local:8"), 256, 16, study_name="keys", storage=":memory:",
           options=SearchOptions(trials=10, seed=2), estimator=toy_estimate)
    plans = [t.user_attrs["plan"] for t in open_study("keys", ":memory:").get_trials() if "plan" in t.user_attrs]
    spliced = [p for p in plans if type(p.get("placement")) is EncodedList]
    assert len(spliced) > 10  # the memo's path is the one tested
    for p in plans:
        assert plan_key(p) == _reference(p)
    assert len({plan_key(p) for p in spliced}) > 1


def test_node_blocks_memo_answers_as_computed_and_hands_out_copies():
    good = tuple(Placement(rank=r, node=r // 4, device=3 - r % 4) for r in range(8))
    bad = tuple(Placement(rank=r, node=r % 2, device=r // 2) for r in range(8))
    for pl in (good, bad, good):
        got = C.node_blocks(Plan(placement=pl))
        assert got == C._node_blocks(pl)
    blocks, why = C.node_blocks(Plan(placement=good))
    assert why is None and blocks == [(0, [3, 2, 1, 0]), (1, [3, 2, 1, 0])]
    blocks[0][1].append(99)  # the caller's own lists: the memo is untouched
    assert C.node_blocks(Plan(placement=good))[0][0] == (0, [3, 2, 1, 0])
    assert "contiguous" in C.node_blocks(Plan(placement=bad))[1]
