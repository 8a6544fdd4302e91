"""Pools (autotune/specs/pool.py): the file keys, subsets against a cluster file written by hand,
plans on a subset priced as on those devices, the objective's refusals, launch lines of a subset."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autotune.cost import estimate
from autotune.errors import InputError
from autotune.objective import make_objective
from autotune.plan import Plan, check_schema, parse_inline
from autotune.specs import load_model
from autotune.specs.cluster import cluster_from_dict, load_cluster
from autotune.specs.pool import choices, hourly, is_pool, pool_nodes, subset

GROUPS = [("H100-SXM", 2, "2.10USD/h"), ("A100-80GB", 2, "1.30USD/h"), ("V100-16GB", 1, "0.40USD/h")]


def _pool(**extra):
    return {"name": "lab", "nodes": [{"available": n, "devices_per_node": 4, "device": d, "price": p, **extra}
                                     for d, n, p in GROUPS],
            "inter_node": {"bandwidth": "200Gbit/s", "latency": "5us"},
            "overrides": [{"nodes": [1, 2], "bandwidth": "5GB/s", "latency": "20us"},
                          {"nodes": [0, 4], "bandwidth": "4GB/s", "latency": "30us"}]}


def _by_hand(counts):
    """The cluster of those nodes written as a plain file (the reference for ``subset``)."""
    keep = [(d, n) for (d, _, _), n in zip(GROUPS, counts, strict=True) if n]
    old = [i for g, n in zip(GROUPS, counts, strict=True) for i in range(g[1]) for _ in [0]]
    # pool node index -> hand-written node index, for the overrides between kept nodes
    index, new, start = {}, 0, 0
    for (_, avail, _), n in zip(GROUPS, counts, strict=True):
        for k in range(avail):
            if k < n:
                index[start + k] = new
                new += 1
        start += avail
    assert old is not None
    ov = [{"nodes": [index[a], index[b]], "bandwidth": bw, "latency": lat}
          for (a, b), bw, lat in (((1, 2), "5GB/s", "20us"), ((0, 4), "4GB/s", "30us")) if a in index and b in index]
    return cluster_from_dict({"name": "hand", "nodes": [{"count": n, "devices_per_node": 4, "device": d} for d, n in keep],
                              "inter_node": {"bandwidth": "200Gbit/s", "latency": "5us"}, "overrides": ov})


def test_pool_keys_and_plain_file_unchanged():
    pool = cluster_from_dict(_pool())
    assert is_pool(pool) and pool.num_devices == 20 and [list(r) for r in choices(pool)] == [[0, 1, 2]] * 2 + [[0, 1]]
    assert hourly(pool, (1, 0, 1)) == pytest.approx(4 * 2.10 + 4 * 0.40)
    plain = {"name": "c", "nodes": [{"count": 2, "devices_per_node": 4, "device": "H100-SXM"}]}
    c = cluster_from_dict(plain)
    assert not is_pool(c) and subset(c, None) is c and subset(c, (2,)) is c
    assert "available" not in c.to_dict()["nodes"][0] and "price" not in c.to_dict()["nodes"][0]
    # the record of a pool rebuilds it (a study's cluster)
    again = cluster_from_dict({k: v for k, v in pool.to_dict().items() if k in ("name", "nodes", "inter_node", "overrides")}
                              | {"nodes": [{k: v for k, v in n.items() if k not in ("provenance",)}
                                           for n in pool.to_dict()["nodes"]]})
    assert again.groups == pool.groups


@pytest.mark.parametrize("bad, field", [({"price": 2.1}, "nodes[0].price"), ({"price": "2.10"}, "nodes[0].price"),
                                        ({"count": 3}, "nodes[0].count")])
def test_bad_pool_keys_are_refused_naming_the_field(bad, field):
    d = _pool()
    d["nodes"][0].update(bad)
    with pytest.raises(InputError) as e:
        cluster_from_dict(d)
    assert e.value.field == field


@pytest.mark.parametrize("counts", [(2, 2, 1), (1, 2, 1), (2, 0, 1), (0, 1, 0), (1, 1, 0)])
def test_subset_is_the_cluster_of_those_nodes(counts):
    pool = cluster_from_dict(_pool())
    sub, hand = subset(pool, counts), _by_hand(counts)
    assert [(d.node, d.local, d.spec.name) for d in sub.devices] == [(d.node, d.local, d.spec.name) for d in hand.devices]
    n = sub.num_devices
    assert all(sub.link(a, b) == hand.link(a, b) for a in range(n) for b in range(n))
    assert subset(sub, counts) is sub  # idempotent
    assert len(pool_nodes(pool, counts)) == sub.num_nodes


def test_plan_on_a_subset_prices_as_on_those_devices_and_round_trips():
    pool = cluster_from_dict(_pool())
    model = load_model("llama3-8b")
    plan = parse_inline("pp=2,tp=4").replace(dtype="fp16")
    on_pool = estimate(plan.replace(uses=(2, 0, 0)), model, pool, 8192, 16)
    by_hand = estimate(plan, model, _by_hand((2, 0, 0)), 8192, 16)
    assert on_pool.predicted == by_hand.predicted and on_pool.breakdown == by_hand.breakdown
    d = on_pool.record().to_dict()
    assert d["uses"] == [2, 0, 0] and d["schema_version"] == 3
    check_schema(d)
    assert Plan.from_dict(d) == on_pool.plan
    assert "uses" not in estimate(plan, model, _by_hand((2, 0, 0)), 8192, 16).record().to_dict()
    with pytest.raises(InputError, match="uses"):
        estimate(plan.replace(uses=(3, 0, 0)), model, pool, 8192, 16)


def test_cost_objective_needs_prices_and_one_currency():
    d = _pool()
    del d["nodes"][1]["price"]
    pool = cluster_from_dict(d)
    with pytest.raises(InputError) as e:
        make_objective("cost", None, None, pool)
    assert e.value.field == "nodes[1].price" and "nodes[1].price" in e.value.message
    assert make_objective("time", None, "2s", pool).max_step_time == 2.0
    priced = cluster_from_dict(_pool())
    assert make_objective("time", "40USD/h", None, priced).budget == 40.0
    with pytest.raises(InputError, match="EUR"):
        make_objective("time", "40EUR/h", None, priced)


def test_mixed_currencies_name_every_group_and_the_file(tmp_path):
    """The refusal says which group is in which currency and where (issue 39 item 8)."""
    d = _pool()
    d["nodes"][1]["price"] = "1.20EUR/h"
    f = tmp_path / "pool.json"
    f.write_text(json.dumps(d))
    with pytest.raises(InputError) as e:
        make_objective("cost", None, None, load_cluster(str(f)))
    text = str(e.value)
    assert text.startswith(f"{f}: nodes[].price: ") and "nodes[1] " in text and "EUR" in text and "USD" in text
    assert text.endswith("write every price in one currency")


def test_cli_refuses_cost_without_prices_in_one_line(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"name": "c", "nodes": [{"count": 1, "devices_per_node": 8, "device": "H100-SXM"}]}))
    r = subprocess.run([sys.executable, "-m", "autotune", "search", "-m", "llama3-8b", "-c", str(f), "-s", "4096",
                        "-b", "8", "--storage", ":memory:", "--objective", "cost"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "nodes[0].price" in r.stderr


def test_launch_dry_run_of_a_subset_prints_only_the_used_hosts(tmp_path):
    """A plan on the pool's first H100 node and its V100 node: two lines, the pool's nodes 0 and 4."""
    pool_file = tmp_path / "pool.json"
    pool_file.write_text(json.dumps(_pool()))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"degrees": {"dp": 2, "tp": 4}, "uses": [1, 0, 1], "dtype": "fp16"}))
    hosts = tmp_path / "hosts"
    hosts.write_text("\n".join(f"host{i}" for i in range(5)) + "\n")
    r = subprocess.run([sys.executable, "-m", "autotune", "apply", "--plan", str(plan), "-m", "tiny", "-s", "64",
                        "-b", "8", "-c", str(pool_file), "--launch", "--dry-run", "--hosts", str(hosts),
                        "--remote-shell", "ssh"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    heads = [ln for ln in r.stdout.splitlines() if ln.startswith("# node")]
    assert heads == ["# node 0 (node-rank 0) on host0", "# node 4 (node-rank 1) on host4"], r.stdout
    assert "left out 4 H100-SXM" in r.stderr and "8 A100-80GB" in r.stderr


def test_estimate_names_what_a_subset_plan_leaves_out(tmp_path):
    pool_file = tmp_path / "pool.json"
    pool_file.write_text(json.dumps(_pool()))
    r = subprocess.run([sys.executable, "-m", "autotune", "estimate", "-m", "llama3-8b", "-c", str(pool_file), "-p",
                        "pp=2,tp=4,uses=2/0/0,dtype=fp16", "-s", "8192", "-b", "16", "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["plan"]["uses"] == [2, 0, 0]
    assert d["subset"]["left_out"] == [{"group": 1, "devices": 8, "device": "A100-80GB"},
                                       {"group": 2, "devices": 4, "device": "V100-16GB"}]
    by_hand = estimate(parse_inline("pp=2,tp=4").replace(dtype="fp16"), load_model("llama3-8b"),
                       _by_hand((2, 0, 0)), 8192, 16)
    assert d["predicted"]["step_time_s"] == by_hand.predicted["step_time_s"]
