"""The newcomer's journey through the CLI: `devices`, `studies`, and an `apply` that checks what it
exports (re-priced on the cluster, never a stored prediction, nothing priced without a cluster,
refusals for precision and file names) - each run the way a user runs it."""

import json

import optuna
import pytest
from helpers.cli import run_autotune

from autotune.cost import estimate
from autotune.plan import Plan
from autotune.specs.catalogue import CATALOGUE
from autotune.specs.cluster import load_cluster
from autotune.specs.model import PRESETS


def run(*args, cwd, columns="80"):
    return run_autotune(*args, cwd=cwd, env={"COLUMNS": columns}, timeout=300)


def one_line_error(r):
    return r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_devices_lists_the_catalogue_with_sources(tmp_path):
    r = run("devices", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = {d["name"]: d for d in json.loads(r.stdout)["devices"]}
    assert set(rows) == set(CATALOGUE)
    for name, d in rows.items():
        assert d["peak_flops"] == CATALOGUE[name].peak_flops and d["source"] == CATALOGUE[name].source
    table = run("devices", cwd=tmp_path)
    assert table.returncode == 0 and max(map(len, table.stdout.splitlines())) <= 80
    assert all(name in table.stdout for name in CATALOGUE)


def test_unknown_device_suggests_its_family(tmp_path):
    (tmp_path / "c.yaml").write_text("nodes:\n  - {devices_per_node: 8, device: H100}\n")
    r = run("estimate", "-m", "tiny", "-c", "c.yaml", "-p", "dp=8", "-s", "128", "-b", "8", cwd=tmp_path)
    assert one_line_error(r)
    named = r.stderr.split("did you mean ")[1].rstrip("?\n").split(", ")
    assert set(named) == {n for n in CATALOGUE if n.startswith("H100")}


def test_a_unitless_number_in_a_cluster_file_is_refused(tmp_path):
    (tmp_path / "c.yaml").write_text("nodes:\n  - {devices_per_node: 8, device: H100-SXM}\n"
                                     "inter_node: {bandwidth: 25GB/s, latency: 3}\n")
    r = run("estimate", "-m", "tiny", "-c", "c.yaml", "-p", "dp=8", "-s", "128", "-b", "8", cwd=tmp_path)
    assert one_line_error(r) and "inter_node.latency" in r.stderr and "us" in r.stderr


def test_an_inline_device_is_priced_and_labelled_user(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "nodes:\n  - count: 1\n    devices_per_node: 4\n    device:\n      name: B200\n"
        "      peak_flops: {bf16: 2250TFLOP/s}\n      memory: 192GB\n      memory_bandwidth: 8TB/s\n")
    r = run("estimate", "-m", "llama3-8b", "-c", "c.yaml", "-p", "dp=4", "-s", "4096", "-b", "8", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "B200: user" in r.stdout


@pytest.fixture()
def stale_plan(tmp_path):
    """A plan made for local:4 whose `predicted` was hand-edited, as in the issue."""
    model, cluster = PRESETS["tiny"], load_cluster("local:4")
    plan = Plan.from_dict({"degrees": {"dp": 2, "pp": 2}, "dtype": "bf16"}).resolve(model, cluster, 128, 8)
    d = plan.to_dict()
    d["predicted"] = {"step_time_s": 0.001, "tokens_per_s": 1e9, "feasible": True}
    (tmp_path / "plan.json").write_text(json.dumps(d))
    return plan, model, cluster


def test_apply_reprices_on_the_cluster_and_never_echoes_the_stored_prediction(tmp_path, stale_plan):
    plan, model, cluster = stale_plan
    r = run("apply", "--plan", "plan.json", "-c", "local:4", "-f", "json", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    ref = estimate(plan, model, cluster, 128, 8)
    assert out["plan"]["predicted"]["step_time_s"] == pytest.approx(ref.predicted["step_time_s"])
    assert out["plan"]["predicted"]["tokens_per_s"] != 1e9


def test_apply_without_a_cluster_prints_no_prediction(tmp_path):
    (tmp_path / "hand.json").write_text(json.dumps({"schema_version": 2, "degrees": {"dp": 2},
                                                    "predicted": {"step_time_s": 0.001, "tokens_per_s": 1e9}}))
    r = run("apply", "--plan", "hand.json", "-m", "tiny", "-s", "128", "-b", "8", "-f", "deepspeed", "-o", "ds.json",
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "not priced" in r.stderr and "predicted" not in r.stderr and "1e+09" not in r.stderr
    r = run("apply", "--plan", "hand.json", "-m", "tiny", "-s", "128", "-b", "8", "--json", cwd=tmp_path)
    assert json.loads(r.stdout)["plan"]["predicted"] is None


def test_apply_refuses_a_precision_the_cluster_cannot_run(tmp_path, stale_plan):
    (tmp_path / "v100.yaml").write_text("nodes:\n  - {devices_per_node: 4, device: V100-16GB}\n")
    r = run("apply", "--plan", "plan.json", "-c", "v100.yaml", "-f", "megatron", "-o", "m.sh", cwd=tmp_path)
    assert one_line_error(r) and "bf16" in r.stderr
    assert not (tmp_path / "m.sh").exists()


def test_apply_refuses_a_file_that_says_another_format_unless_forced(tmp_path, stale_plan):
    r = run("apply", "--plan", "plan.json", "-f", "torchtitan", "-o", "best.json", cwd=tmp_path)
    assert one_line_error(r) and ".toml" in r.stderr and not (tmp_path / "best.json").exists()
    before = (tmp_path / "plan.json").read_text()
    r = run("apply", "--plan", "plan.json", "-f", "deepspeed", "-o", "plan.json", cwd=tmp_path)
    assert one_line_error(r) and "holds an autotune plan" in r.stderr
    assert (tmp_path / "plan.json").read_text() == before
    r = run("apply", "--plan", "plan.json", "-f", "deepspeed", "-o", "plan.json", "--force", cwd=tmp_path)
    assert r.returncode == 0, r.stderr and "train_batch_size" in (tmp_path / "plan.json").read_text()


def test_studies_lists_workload_and_best_plan(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    for name, tps in (("first", 100.0), ("second", 300.0)):
        s = optuna.create_study(study_name=name, storage=url, direction="maximize")
        for k, v in {"model": "tiny", "cluster": "local:2", "seq_len": 128, "global_batch": 8}.items():
            s.set_user_attr(k, v)
        plan = Plan.from_dict({"degrees": {"dp": 2}}).resolve(PRESETS["tiny"], load_cluster("local:2"), 128, 8)
        s.add_trial(optuna.trial.create_trial(value=tps, params={}, distributions={},
                                              user_attrs={"plan": plan.to_dict()}))
    r = run("studies", "--storage", url, "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = {s["name"]: s for s in json.loads(r.stdout)["studies"]}
    assert rows["second"]["best_tokens_per_s"] == 300.0 and rows["first"]["model"] == "tiny"
    assert rows["first"]["best_plan"]["degrees"]["dp"] == 2
    table = run("studies", "--storage", url, cwd=tmp_path)
    assert "second" in table.stdout and "dp=2" in table.stdout and max(map(len, table.stdout.splitlines())) <= 80
    missing = run("studies", "--storage", f"sqlite:///{tmp_path / 'nope.db'}", cwd=tmp_path)
    assert one_line_error(missing)
