"""`search --target T` returns a plan that `apply --format T` exports without refusal, for every
framework target (the exporters' own rules are what the search keeps to); the study and the search's
JSON name, per target, the best plan it can run; ties go to the simpler plan."""

import json
import os
import subprocess
import sys

import optuna
import pytest

from autotune.export import export
from autotune.export.source import from_study
from autotune.plan import Plan
from autotune.search import SearchOptions, search
from autotune.specs import load_cluster, load_model
from autotune.study import best_feasible
from autotune.targets import TARGETS, refusals

MODEL, CLUSTER, SEQ, BATCH = load_model("tiny"), load_cluster("local:4"), 256, 8


@pytest.mark.parametrize("target", [t for t in TARGETS if t != "runtime"])
def test_search_for_a_target_returns_what_its_export_accepts(tmp_path, target):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    res = search(MODEL, CLUSTER, SEQ, BATCH, study_name="s", storage=url,
                 options=SearchOptions(trials=15, target=target, polish=False))
    for p in res.top:
        assert refusals(target, p.plan, _ctx()) == []
    record, ctx = from_study("s", url, None)
    out = export(record.plan.resolve(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch), ctx, target)
    assert out.text
    stored = optuna.load_study(study_name="s", storage=url).user_attrs["best_per_target"]
    # the search kept to the target, so its best (up to the 1% tie-break) is the target's best
    assert stored[target]["ratio"] == pytest.approx(1.0)
    assert stored[target]["tokens_per_s"] == pytest.approx(res.best.predicted["tokens_per_s"], rel=0.011)
    assert set(stored) == set(TARGETS)


def _ctx():
    from autotune.targets import context

    return context(MODEL, CLUSTER, SEQ, BATCH)


def test_cli_target_and_the_megatron_export_of_its_best(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_DEBUG"}
    r = subprocess.run([sys.executable, "-m", "autotune", "search", "-m", "tiny", "-c", "local:4", "-s", "256", "-b",
                        "8", "--trials", "15", "--target", "megatron", "--json"], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["targets"]) == set(TARGETS) and out["targets"]["megatron"]["ratio"] == pytest.approx(1.0)
    a = subprocess.run([sys.executable, "-m", "autotune", "apply", "--study", out["study"], "-f", "megatron", "-o",
                        "m.sh"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert a.returncode == 0, a.stderr
    bad = subprocess.run([sys.executable, "-m", "autotune", "search", "-m", "tiny", "-c", "local:4", "-s", "256", "-b",
                          "8", "--target", "megatorn"], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert bad.returncode == 2 and "did you mean megatron" in bad.stderr


def test_ties_go_to_the_lower_zero_stage(tmp_path):
    url = f"sqlite:///{tmp_path / 't.db'}"
    s = optuna.create_study(study_name="t", storage=url, direction="maximize")
    for zero, tps in ((2, 100.4), (1, 100.0), (0, 98.0)):
        plan = Plan.from_dict({"degrees": {"dp": 4}, "zero_stage": zero}).resolve(MODEL, CLUSTER, SEQ, BATCH)
        s.add_trial(optuna.trial.create_trial(value=tps, params={}, distributions={},
                                              user_attrs={"plan": plan.to_dict()}))
    best = best_feasible(s)
    assert Plan.from_dict(best.user_attrs["plan"]).zero_stage == 1  # 100.0 ties 100.4 (1%), 98 does not


def test_apply_prices_as_the_format_it_writes(tmp_path, capsys):
    """`search --target megatron` then `apply --format megatron` prints the price `estimate --target
    megatron` gives the same plan (the search's), not autotune's own runtime's (issue 39 item 4)."""
    from helpers.cli import cli

    (tmp_path / "h100.yaml").write_text("name: h100x8\nnodes:\n  - {count: 1, devices_per_node: 8, device: H100-SXM}\n")
    url = f"sqlite:///{tmp_path / 'k.db'}"
    cl = str(tmp_path / "h100.yaml")
    res = search(MODEL, load_cluster(cl), 1024, 32, study_name="k", storage=url,
                 options=SearchOptions(trials=15, target="megatron", polish=False))
    code, out, err = cli(capsys, "apply", "--study", "k", "--storage", url, "-f", "megatron", "--json")
    assert code == 0, err
    applied = json.loads(out)["plan"]
    (tmp_path / "p.json").write_text(json.dumps(applied))
    by_target = {}
    for target in ("megatron", "runtime"):
        code, out, err = cli(capsys, "estimate", "-m", "tiny", "-c", cl, "-s", "1024", "-b", "32", "-p",
                             str(tmp_path / "p.json"), "--target", target, "--json")
        assert code == 0, err
        by_target[target] = json.loads(out)["predicted"]["step_time_s"]
    # the two runtimes price this plan apart, so agreeing with one of them is a real check
    assert abs(by_target["runtime"] / by_target["megatron"] - 1) > 0.02
    assert applied["predicted"]["step_time_s"] == pytest.approx(by_target["megatron"], rel=0.01)
    assert applied["predicted"]["step_time_s"] == pytest.approx(res.best.predicted["step_time_s"], rel=0.01)
