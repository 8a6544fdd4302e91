"""Precision is part of the plan (issue 13 point 1): ``--dtype`` on the commands, ``auto`` = bf16
where every device has it, else fp16; bf16 on a cluster with V100s is refused up front in one line
(exit 2), and the fp16 plan that ``search`` returns there is priced by ``estimate`` in fp16."""

import json

import pytest
from helpers.cli import run_autotune

from autotune.cost import estimate
from autotune.plan import Plan
from autotune.specs import load_cluster, load_model


def run(*args):
    return run_autotune(*args, timeout=600)


@pytest.fixture(scope="module")
def a100_v100(tmp_path_factory):
    """The classic mixed cluster of Metis, AMP and Sailor: 8 A100-40GB + 8 V100."""
    p = tmp_path_factory.mktemp("c") / "a100-v100.yaml"
    p.write_text("name: a100-v100\nnodes:\n  - {count: 1, devices_per_node: 8, device: A100-40GB}\n"
                 "  - {count: 1, devices_per_node: 8, device: V100}\ninter_node: {bandwidth: 25GB/s}\n")
    return str(p)


def test_bf16_on_v100_is_refused_up_front_in_one_line(a100_v100, tmp_path):
    r = run("search", "-m", "llama2-7b", "-c", a100_v100, "-s", "2048", "-b", "16", "--dtype", "bf16",
            "--trials", "5", "--storage", f"sqlite:///{tmp_path}/s.db")
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "bf16 is not supported by V100" in lines[0] and "--dtype fp16" in lines[0], r.stderr
    assert r.stdout == "" and not (tmp_path / "s.db").exists()  # nothing searched, nothing stored


def test_auto_searches_fp16_on_v100_and_estimate_prices_it(a100_v100, tmp_path):
    r = run("search", "-m", "llama2-7b", "-c", a100_v100, "-s", "2048", "-b", "16", "--trials", "20",
            "--storage", f"sqlite:///{tmp_path}/s.db", "--json")
    assert r.returncode == 0, r.stderr
    best = json.loads(r.stdout)["best"]
    assert best["dtype"] == "fp16" and best["predicted"]["feasible"], best["predicted"]
    plan_file = tmp_path / "best.json"
    plan_file.write_text(json.dumps(best))
    e = run("estimate", "-m", "llama2-7b", "-c", a100_v100, "-p", str(plan_file), "-s", "2048", "-b", "16",
            "--dtype", "fp16", "--json")
    assert e.returncode == 0, e.stderr
    out = json.loads(e.stdout)
    assert out["plan"]["dtype"] == "fp16"
    ref = estimate(Plan.from_dict(best), load_model("llama2-7b"), load_cluster(a100_v100), 2048, 16)
    assert out["predicted"]["step_time_s"] == pytest.approx(ref.predicted["step_time_s"])
    # the plan states fp16: --dtype auto keeps it, an explicit bf16 is refused on this cluster
    assert json.loads(run("estimate", "-m", "llama2-7b", "-c", a100_v100, "-p", str(plan_file), "-s", "2048",
                          "-b", "16", "--json").stdout)["plan"]["dtype"] == "fp16"
    bad = run("estimate", "-m", "llama2-7b", "-c", a100_v100, "-p", str(plan_file), "-s", "2048", "-b", "16",
              "--dtype", "bf16")
    assert bad.returncode == 2 and "bf16 is not supported by V100" in bad.stderr


def test_inline_plan_takes_the_clusters_precision(a100_v100):
    r = run("estimate", "-m", "llama2-7b", "-c", a100_v100, "-p", "dp=16", "-s", "2048", "-b", "16", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["plan"]["dtype"] == "fp16"
    r = run("estimate", "-m", "llama2-7b", "-c", a100_v100, "-p", "dp=16", "-s", "2048", "-b", "16", "--dtype",
            "fp32", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["plan"]["dtype"] == "fp32"
    r = run("estimate", "-m", "llama2-7b", "-c", a100_v100, "-p", "dp=16", "-s", "2048", "-b", "16", "--dtype",
            "bf61")
    assert r.returncode == 2 and "did you mean bf16" in r.stderr
