"""torchrun commands: rank blocks per node as torchrun assigns them (node-rank k holds ranks
[k*n, (k+1)*n)), CUDA_VISIBLE_DEVICES from the placement, refusal of placements torchrun cannot realise."""

import json

import pytest
import yaml

from autotune.errors import InputError
from autotune.export import launch as L
from autotune.export.common import ExportContext
from autotune.plan import Degrees, Placement, Plan
from autotune.specs.cluster import load_cluster
from autotune.specs.model import PRESETS


def gpu_cluster(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"name": "two", "nodes": [{"count": 2, "devices_per_node": 4, "device": "H100-SXM"}]}))
    return load_cluster(str(f))


def test_single_node_local(tmp_path):
    cl = load_cluster("local:4")
    ctx = ExportContext(model=PRESETS["tiny"], cluster=cl, seq_len=32, global_batch=4)
    plan = Plan(degrees=Degrees(dp=2, tp=2)).resolve(ctx.model, cl, 32, 4)
    (cmd,) = L.commands(plan, ctx, tmp_path / "job.pt", tmp_path / "out")
    a = cmd.argv
    assert "--standalone" in a and a[a.index("--nproc-per-node") + 1] == "4"
    assert a[a.index("-m") + 1] == "autotune.runtime.worker" and "--job" in a and "--out" in a
    assert cmd.env == {}


def test_multi_node_ranks_and_visible_devices(tmp_path):
    cl = gpu_cluster(tmp_path)
    ctx = ExportContext(model=PRESETS["small"], cluster=cl, seq_len=256, global_batch=16)
    # mesh ranks 0-3 on node 1 (devices reversed), ranks 4-7 on node 0
    pl = [Placement(rank=r, node=1, device=3 - r) for r in range(4)] + [
        Placement(rank=r, node=0, device=r - 4) for r in range(4, 8)]
    plan = Plan(degrees=Degrees(pp=2, dp=2, tp=2), placement=tuple(pl)).resolve(ctx.model, cl, 256, 16)
    cmds = L.commands(plan, ctx, "job.pt", "out", master_addr="host0")
    assert [(c.node, c.node_rank) for c in cmds] == [(1, 0), (0, 1)]
    assert cmds[0].env["CUDA_VISIBLE_DEVICES"] == "3,2,1,0" and cmds[1].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    for k, c in enumerate(cmds):
        a = c.argv
        assert a[a.index("--nnodes") + 1] == "2" and a[a.index("--node-rank") + 1] == str(k)
        assert a[a.index("--master-addr") + 1] == "host0"
        # torchrun's rank of local rank j is node_rank * nproc + j: the device placed for that mesh rank
        devs = c.env["CUDA_VISIBLE_DEVICES"].split(",")
        for j, dev in enumerate(devs):
            p = plan.placement[k * 4 + j]
            assert (p.node, p.device) == (c.node, int(dev))


def test_interleaved_nodes_are_refused(tmp_path):
    cl = gpu_cluster(tmp_path)
    ctx = ExportContext(model=PRESETS["small"], cluster=cl, seq_len=256, global_batch=16)
    pl = [Placement(rank=r, node=r % 2, device=r // 2) for r in range(8)]
    plan = Plan(degrees=Degrees(dp=8), placement=tuple(pl)).resolve(ctx.model, cl, 256, 16)
    with pytest.raises(InputError, match="contiguous"):
        L.commands(plan, ctx, "job.pt", "out")


def test_exported_configs_name_the_node_order_launch_uses(tmp_path):
    from autotune.export import export

    cl = gpu_cluster(tmp_path)
    ctx = ExportContext(model=PRESETS["small"], cluster=cl, seq_len=256, global_batch=16)
    pl = [Placement(rank=r, node=1, device=r) for r in range(4)] + [
        Placement(rank=r, node=0, device=r - 4) for r in range(4, 8)]
    plan = Plan(degrees=Degrees(pp=2, dp=4), zero_stage=1, placement=tuple(pl)).resolve(ctx.model, cl, 256, 16)
    text = export(plan, ctx, "megatron").text
    cmds = L.commands(plan, ctx, "job.pt", "out", master_addr="h")
    for c in cmds:
        assert (f"node-rank {c.node_rank} on cluster node {c.node} with "
                f"CUDA_VISIBLE_DEVICES={c.env['CUDA_VISIBLE_DEVICES']}") in text
    ds = json.loads(export(plan, ctx, "deepspeed").text)
    assert [n["node"] for n in ds["autotune"]["nodes"]] == [c.node for c in cmds] == [1, 0]
