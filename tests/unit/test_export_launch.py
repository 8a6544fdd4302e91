"""torchrun commands: rank blocks per node (node-rank k holds ranks [k*n, (k+1)*n)), CUDA_VISIBLE_DEVICES
from the placement, refusal of placements torchrun cannot realise; and the printed lines themselves:
bash reads them, torchrun's own argument parser takes what bash makes of them, the variables expand,
and a dry run writes nothing."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from helpers.cli import cli

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
    (cmd,) = L.commands(plan, ctx, tmp_path / "out")
    a = cmd.argv
    assert "--standalone" in a and a[a.index("--nproc-per-node") + 1] == "4"
    assert a[a.index("-m") + 1] == "autotune.runtime.launcher" and "--trial" in a and "--out" in a
    assert cmd.env == {}


def test_multi_node_ranks_and_visible_devices(tmp_path):
    cl = gpu_cluster(tmp_path)
    ctx = ExportContext(model=PRESETS["small"], cluster=cl, seq_len=256, global_batch=16)
    # mesh ranks 0-3 on node 1 (devices reversed), ranks 4-7 on node 0
    pl = [Placement(rank=r, node=1, device=3 - r) for r in range(4)] + [
        Placement(rank=r, node=0, device=r - 4) for r in range(4, 8)]
    plan = Plan(degrees=Degrees(pp=2, dp=2, tp=2), placement=tuple(pl)).resolve(ctx.model, cl, 256, 16)
    cmds = L.commands(plan, ctx, "out")
    assert [(c.node, c.node_rank) for c in cmds] == [(1, 0), (0, 1)]
    assert cmds[0].env["CUDA_VISIBLE_DEVICES"] == "3,2,1,0" and cmds[1].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    for k, c in enumerate(cmds):
        a = c.argv
        assert a[a.index("--nnodes") + 1] == "2" and a[a.index("--node-rank") + 1] == str(k)
        assert a[a.index("--rdzv-backend") + 1] == "c10d" and a[a.index("--rdzv-endpoint") + 1] == L.ENDPOINT
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
        L.commands(plan, ctx, "out")


def test_exported_configs_name_the_node_order_launch_uses(tmp_path):
    from autotune.export import export

    cl = gpu_cluster(tmp_path)
    ctx = ExportContext(model=PRESETS["small"], cluster=cl, seq_len=256, global_batch=16)
    pl = [Placement(rank=r, node=1, device=r) for r in range(4)] + [
        Placement(rank=r, node=0, device=r - 4) for r in range(4, 8)]
    plan = Plan(degrees=Degrees(pp=2, dp=4), zero_stage=1, placement=tuple(pl)).resolve(ctx.model, cl, 256, 16)
    text = export(plan, ctx, "megatron").text
    cmds = L.commands(plan, ctx, "out")
    for c in cmds:
        assert (f"node-rank {c.node_rank} on cluster node {c.node} with "
                f"CUDA_VISIBLE_DEVICES={c.env['CUDA_VISIBLE_DEVICES']}") in text
    ds = json.loads(export(plan, ctx, "deepspeed").text)
    assert [n["node"] for n in ds["autotune"]["nodes"]] == [c.node for c in cmds] == [1, 0]


# ---- the printed lines run ----------------------------------------------------------------------


def dry_run_lines(capsys, tmp_path, cluster: dict, plan: dict) -> list[str]:
    (tmp_path / "c.json").write_text(json.dumps(cluster))
    (tmp_path / "p.json").write_text(json.dumps(plan))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, out, err = cli(capsys, "apply", "-p", str(tmp_path / "p.json"), "-m", "tiny", "-s", "32", "-b", "4",
                         "-c", str(tmp_path / "c.json"), "--launch", "--dry-run", "--steps", "3", "--json")
    assert code == 0, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, "the dry run wrote files"
    return json.loads(out)["commands"]


def as_bash_runs_it(line: str, tmp_path, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """What torchrun would receive: the line run by bash with a ``torchrun`` that reports its argv
    and the environment variables the line set."""
    fake = tmp_path / "bin" / "torchrun"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "print(json.dumps({'argv': sys.argv[1:], 'cvd': os.environ.get('CUDA_VISIBLE_DEVICES')}))\n")
    fake.chmod(0o755)
    syntax = subprocess.run(["bash", "-n", "-c", line], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    r = subprocess.run(["bash", "-c", line], capture_output=True, text=True, cwd=tmp_path,
                       env={"PATH": f"{fake.parent}:{os.environ['PATH']}", **env})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    return got["argv"], {"CUDA_VISIBLE_DEVICES": got["cvd"]}


def test_pasted_lines_parse_with_torchrun_and_expand_the_rendezvous_host(capsys, tmp_path):
    from torch.distributed.run import get_args_parser

    cluster = {"name": "two", "nodes": [{"count": 2, "devices_per_node": 2, "device": "CPU"}]}
    lines = dry_run_lines(capsys, tmp_path, cluster, {"degrees": {"dp": 2, "pp": 2}, "dtype": "fp32"})
    assert len(lines) == 2 and all("'$MASTER_ADDR'" not in x for x in lines)
    payloads = []
    for k, line in enumerate(lines):
        argv, _ = as_bash_runs_it(line, tmp_path, {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29777"})
        args = get_args_parser().parse_args(argv)
        assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("2", "2", "c10d")
        assert args.rdzv_endpoint == "10.1.2.3:29777" and args.rdzv_id and args.module
        assert args.training_script == "autotune.runtime.launcher"
        entry = args.training_script_args
        assert entry[entry.index("--node-rank") + 1] == str(k)
        payloads.append(json.loads(entry[entry.index("--trial") + 1]))
    assert payloads[0] == payloads[1] and payloads[0]["steps"] == 3 and payloads[0]["model"]["name"] == "tiny"
    # without MASTER_ADDR the line stops with a message instead of running torchrun on a wrong host
    r = subprocess.run(["bash", "-c", lines[0]], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "set MASTER_ADDR" in r.stderr


def test_single_node_line_parses_and_keeps_visible_devices(capsys, tmp_path):
    from torch.distributed.run import get_args_parser

    (line,) = dry_run_lines(capsys, tmp_path, {"name": "one", "nodes": [{"count": 1, "devices_per_node": 2,
                                                                         "device": "CPU"}]},
                            {"degrees": {"dp": 2}, "dtype": "fp32"})
    argv, env = as_bash_runs_it(line, tmp_path, {})
    args = get_args_parser().parse_args(argv)
    assert args.standalone and args.nproc_per_node == "2" and args.training_script == "autotune.runtime.launcher"
    f = tmp_path / "one.yaml"
    f.write_text(yaml.safe_dump({"name": "one", "nodes": [{"count": 1, "devices_per_node": 4, "device": "H100-SXM"}]}))
    cl = load_cluster(str(f))
    ctx = ExportContext(model=PRESETS["small"], cluster=cl, seq_len=256, global_batch=16)
    pl = [Placement(rank=r, node=0, device=3 - r) for r in range(4)]
    plan = Plan(degrees=Degrees(dp=4), placement=tuple(pl)).resolve(ctx.model, cl, 256, 16)
    (cmd,) = L.commands(plan, ctx, "out")
    _, env = as_bash_runs_it(cmd.shell(), tmp_path, {})
    assert env["CUDA_VISIBLE_DEVICES"] == "3,2,1,0"
