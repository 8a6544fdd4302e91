"""The Plan's HelixPipe field: ``helix_folds`` round-trips and is refused where it means nothing."""

from __future__ import annotations

import pytest

from autotune.plan import HELIX_FOLDS, Plan, PlanError, check_schema, parse_inline
from autotune.specs import ModelSpec, local_cluster

SPEC = ModelSpec(name="helix-plan", layers=8, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=128)


def test_helix_folds_round_trips_through_json_and_schema():
    plan = Plan.from_dict({"degrees": {"pp": 2}})
    assert plan.helix_folds == 1
    d = plan.replace(helix_folds=2).to_dict()
    check_schema(d)
    assert Plan.from_dict(d).helix_folds == 2
    assert parse_inline("pp=2,folds=2").helix_folds == 2


def test_fold_counts_outside_the_known_ones_are_refused():
    with pytest.raises(PlanError, match="helix_folds"):  # the JSON reader refuses what is not positive
        Plan.from_dict({"degrees": {"pp": 2}, "helix_folds": 0})
    assert 3 not in HELIX_FOLDS
    with pytest.raises(PlanError, match="helix_folds: must be one of"):
        Plan.from_dict({"degrees": {"pp": 2}, "helix_folds": 3}).resolve(SPEC, local_cluster(2), 16, 8)


def test_folds_on_a_schedule_that_does_not_fold_are_refused():
    with pytest.raises(PlanError, match="only helixpipe folds"):
        Plan.from_dict({"degrees": {"pp": 2}, "helix_folds": 2}).resolve(SPEC, local_cluster(2), 16, 8)
