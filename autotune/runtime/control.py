"""A validation across hosts: node-rank 0 leads, every other node runs its part of each trial.

Each host runs ``autotune validate --study S --node-rank K`` with ``MASTER_ADDR``/``MASTER_PORT``
naming node-rank 0's host (or node-rank 0 starts them all: ``--hosts FILE``, autotune.hostfile).
Node-rank 0 owns the study: it reads the plans, writes the measured figures and the calibration.
It hosts a ``torch.distributed.TCPStore`` at ``MASTER_PORT + 1`` (the rendezvous of each trial's
torchrun agents uses ``MASTER_PORT``) through which the other nodes, which need no access to the
storage, take their orders. Keys:

* ``hello`` (node 0): the study's name, its node count and the device option;
* ``join/K`` (a counter: two hosts that both say node-rank K are refused), ``machine/K`` (what node
  K is, autotune.machines.Machine): node 0 compares every node with the study's cluster before
  anything runs; a mismatch ends every node with the same one line, exit 2;
* ``beat/K``: a counter each other node adds to twice a second; one that stops moving for
  ``DEAD_AFTER_S`` is a node that is gone;
* ``trial/I``: trial I, as every node's torchrun line (``apply --launch``'s lines,
  autotune.export.launch.commands: the same trial JSON a one-host validate launches);
  ``result/I/K``: node K's ranks' reports (``runtime.worker.train``), their failure, or an error;
* ``end``: the validation is over (with the error that ended it, if one did); ``bye/K``: node K read it.

Node 0 makes each trial's ``TrialResult`` from every rank's report with the same function as a
one-host trial (``runtime.trial.result_from_reports``); a failed rank on any node is the trial's
failure (the earliest one), recorded in the study as on one host. A node that is gone (no
heartbeat, or its remote shell ended) is not a property of the plan: node 0 stops the validation
with one line naming that node, records nothing of the trial in flight (the trials finished
before it keep their measurements, which the next validate reuses) and fits no calibration; the
other nodes end with the same line. A node whose node 0 is gone ends the same way.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from autotune.errors import AutotuneError, InputError, WorkError
from autotune.machines import DeviceType, Machine, this_machine

BEAT_S = 0.5
DEAD_AFTER_S = 10.0
"""A node whose heartbeat has not moved for this long is gone (a busy node still beats: its own thread)."""
JOIN_TIMEOUT_S = 300.0
"""How long node 0 waits for the other nodes to join, and they for node 0."""
BYE_S = 10.0
RESULT_GRACE_S = 120.0
"""How long, beyond the trial's own timeout, node 0 waits for another node's result."""


def control_port(master_port: int) -> int:
    return master_port + 1


def _store(addr: str, port: int, *, leader: bool, timeout_s: float):
    from torch.distributed import TCPStore

    return TCPStore(addr, port, is_master=leader, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def machine_to_json(m: Machine) -> str:
    return json.dumps(dataclasses.asdict(m))


def machine_from_json(text: str | bytes) -> Machine:
    d = json.loads(text)
    return Machine(d["host"], tuple(DeviceType(**x) for x in d["devices"]), d.get("cpu_model", ""))


def _node_command(node: int, node_rank: int):
    from autotune.export.launch import NodeCommand

    return NodeCommand(node=node, node_rank=node_rank, argv=[])


def _run_part(line: str, node: int, node_rank: int, trial: dict[str, Any], poll) -> dict[str, Any]:
    """Run this node's line of a published trial; its ranks' reports, their failure, or an error."""
    from autotune.export import launch as L

    cmd = _node_command(node, node_rank)
    out = Path(trial["out"])
    try:
        res, proc = L.run_node(cmd, out, world=trial["world"], nodes=len(trial["lines"]),
                               timeout_s=trial["timeout_s"], line=line, poll=poll)
    except WorkError as e:
        return {"error": e.args[0] if e.args else str(e)}
    finally:  # this node's rank files, read (or useless) by now; node 0 removes the folder on its host
        for r in L.node_ranks(cmd, trial["world"], len(trial["lines"])):
            for f in (out / f"result-{r}.pt", out / f"failure-{r}.pt"):
                f.unlink(missing_ok=True)
    if res.failure is not None:
        return {"failure": {**res.failure, "node": node, "text": L.failure_text(cmd, res.failure, proc)},
                "time": res.extra.get("time", time.time())}
    return {"reports": res.results}


class Beat:
    """Node K's heartbeat: a thread adding to ``beat/K`` through a connection of its own. ``lost``
    says why it stopped (node 0's store went away)."""

    def __init__(self, addr: str, port: int, node_rank: int):
        self.lost: str | None = None
        self._stop = threading.Event()
        self._store = _store(addr, port, leader=False, timeout_s=30)
        self._key = f"beat/{node_rank}"
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(self._key, 1)
            except Exception as e:  # noqa: BLE001 - any store failure means node 0 is unreachable: said in `lost`
                self.lost = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                return
            self._stop.wait(BEAT_S)

    def stop(self) -> None:
        self._stop.set()


class Leader:
    """Node-rank 0 of a validation across ``nodes`` hosts (see the module docstring). Used as a
    context manager: leaving it publishes ``end`` (with the error that ended it, if any)."""

    def __init__(self, study: str, cluster: Any, *, addr: str, port: int, device: str,
                 hosts: list[str] | None = None, remote: list[Any] | None = None,
                 join_timeout_s: float = JOIN_TIMEOUT_S):
        self.study, self.cluster, self.device = study, cluster, device
        self.nodes = cluster.num_nodes
        self.addr, self.port = addr, control_port(port)
        self.hosts = hosts
        self.remote = remote or []
        """``--hosts``: the other nodes' ``autotune validate ... --node-rank K`` lines (ShellLine)."""
        self.join_timeout_s = join_timeout_s
        self.run_tag = uuid.uuid4().hex[:8]
        self.trials = 0
        self._beats: dict[int, tuple[int, float]] = {}
        self._checked_at = 0.0
        self.gone: set[int] = set()
        """Node-ranks found gone: nobody there to read ``end``."""
        try:
            self.store = _store("0.0.0.0", self.port, leader=True, timeout_s=30)
        except Exception as e:  # noqa: BLE001 - torch raises several kinds for a port it cannot bind
            raise WorkError(f"node-rank 0 cannot listen on port {self.port} (MASTER_PORT + 1) for the other "
                            f"nodes: {str(e).strip().splitlines()[0] if str(e).strip() else e}") from None
        self.store.set("hello", json.dumps({"study": study, "nodes": self.nodes, "device": device}))

    def __enter__(self) -> Leader:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if exc is None:
            self.close(None, 0)
        elif isinstance(exc, AutotuneError):
            self.close(exc.args[0] if exc.args else str(exc), exc.exit_code)
        else:
            self.close(f"node-rank 0 stopped ({type(exc).__name__})", 1)

    def name(self, k: int) -> str:
        return f"node-rank {k}" + (f" ({self.hosts[k]})" if self.hosts else "")

    # -- joining ------------------------------------------------------------------------------------
    def machines(self) -> list[Machine]:
        """This node and every other node's machine, in node-rank order, once all have joined."""
        here = this_machine(self.device)
        end = time.monotonic() + self.join_timeout_s
        while True:
            self._check_remote()
            for k in range(1, self.nodes):
                if self.store.add(f"join/{k}", 0) > 1:
                    raise InputError(f"two hosts joined as node-rank {k}: give each host its own --node-rank",
                                     field="--node-rank")
            missing = [k for k in range(1, self.nodes) if not self.store.check([f"machine/{k}"])]
            if not missing:
                break
            if time.monotonic() > end:
                raise WorkError(f"{', '.join(self.name(k) for k in missing)} did not join within "
                                f"{self.join_timeout_s:g} s: run `autotune validate --study {self.study} "
                                f"--node-rank K` on each host with MASTER_ADDR={self.addr_text()} (or use --hosts)")
            time.sleep(0.1)
        now = time.monotonic()
        self._beats = {k: (-1, now) for k in range(1, self.nodes)}
        return [here, *(machine_from_json(self.store.get(f"machine/{k}")) for k in range(1, self.nodes))]

    def addr_text(self) -> str:
        return os.environ.get("MASTER_ADDR") or self.addr

    # -- liveness -----------------------------------------------------------------------------------
    def _check_remote(self) -> None:
        for k, p in enumerate(self.remote, 1):
            if p.exitcode is not None:
                out = p.finish()
                last = (out.stderr or out.stdout or "").strip().splitlines()[-1:] or ["no output"]
                self.gone.add(k)
                raise WorkError(f"{self.name(k)} is gone: its line exited with code {out.returncode} (last output: "
                                f"{last[0]})")

    def check_alive(self, force: bool = False) -> None:
        """Raise (one line, naming the node) when another node is gone."""
        now = time.monotonic()
        if not force and now - self._checked_at < BEAT_S:
            return
        self._checked_at = now
        self._check_remote()
        for k, (seen, since) in list(self._beats.items()):
            beat = self.store.add(f"beat/{k}", 0)
            if beat != seen:
                self._beats[k] = (beat, now)
            elif now - since > DEAD_AFTER_S:
                self.gone.add(k)
                raise WorkError(f"{self.name(k)} is gone (no heartbeat for {DEAD_AFTER_S:g} s); the trial in flight "
                                "is not recorded")

    # -- trials -------------------------------------------------------------------------------------
    def prepare(self, plan: Any, model: Any, seq_len: int, global_batch: int, *, device: str = "auto") -> None:
        """What validate asks before choosing a plan: can the runtime run it across these nodes?"""
        self._commands(plan, model, seq_len, global_batch, out="-", steps=1, warmup=0, seed=0, timeout_s=1.0,
                       data=None)

    def _commands(self, plan, model, seq_len, global_batch, *, out, steps, warmup, seed, timeout_s, data):
        from autotune.export import launch as L
        from autotune.export.common import ExportContext
        from autotune.runtime.trial import check_runtime_support

        resolved = plan.resolve(model, self.cluster, seq_len, global_batch)  # placement on the study's nodes
        check_runtime_support(resolved, model)
        ctx = ExportContext(model=model, cluster=self.cluster, seq_len=seq_len, global_batch=global_batch)
        cmds = L.commands(resolved, ctx, out, steps=steps, warmup=warmup, seed=seed, timeout_s=timeout_s,
                          run_id=f"autotune-validate-{self.run_tag}-{self.trials}", data=data)
        return resolved, cmds

    def run_trial(self, plan: Any, model: Any, seq_len: int, global_batch: int, *, steps: int, warmup: int,
                  seed: int, timeout_s: float, device: str = "auto", data: str | None = None,
                  data_dtype: str = "auto") -> Any:
        """validate's runner: the trial on every node, one TrialResult from all ranks."""
        from autotune import machine_load
        from autotune.export import launch as L
        from autotune.plan_record import PlanRecord
        from autotune.runtime.data import prepare_data
        from autotune.runtime.trial import TrialResult, _device_kind, result_from_reports

        desc = prepare_data(data, model.vocab, seq_len, global_batch, warmup + steps, dtype=data_dtype)
        i = self.trials
        out = Path("results") / "validate" / f"{self.run_tag}-{i}"
        resolved, cmds = self._commands(plan, model, seq_len, global_batch, out=out, steps=steps, warmup=warmup,
                                        seed=seed, timeout_s=timeout_s, data=desc)
        self.trials += 1
        self.check_alive(force=True)
        self.store.set(f"trial/{i}", json.dumps({"lines": [c.shell() for c in cmds], "nodes": [c.node for c in cmds],
                                                 "world": resolved.world, "out": str(out), "timeout_s": timeout_s}))
        # this host's load while the trial ran, as a one-host trial records it (validate compares it with the profile's)
        with machine_load.watch() as load:
            t0 = time.perf_counter()
            try:
                res, proc = L.run_node(cmds[0], out, world=resolved.world, nodes=len(cmds), timeout_s=timeout_s,
                                       poll=self.check_alive)
                wall = time.perf_counter() - t0
                failures: list[tuple[float, dict[str, Any]]] = []
                reports = list(res.results or [])
                if res.failure is not None:
                    failures.append((res.extra.get("time", time.time()), res.failure))
                end = time.monotonic() + timeout_s + RESULT_GRACE_S
                for k in range(1, len(cmds)):
                    while not self.store.check([f"result/{i}/{k}"]):
                        self.check_alive()
                        if time.monotonic() > end:
                            raise WorkError(f"{self.name(k)} sent no result of trial {i} within "
                                            f"{timeout_s + RESULT_GRACE_S:g} s")
                        time.sleep(0.1)
                    msg = json.loads(self.store.get(f"result/{i}/{k}"))
                    if "error" in msg:  # its torchrun could not be run or watched: the node, not the plan
                        raise WorkError(f"{self.name(k)}: {msg['error']}")
                    if "failure" in msg:
                        failures.append((msg["time"], {x: msg["failure"][x] for x in ("kind", "rank", "message")}))
                    else:
                        reports += msg["reports"]
            finally:
                shutil.rmtree(out, ignore_errors=True)
        if failures:
            return TrialResult(plan=PlanRecord(resolved).to_dict(), measured=None, losses=[], failure=min(failures,
                               key=lambda f: f[0])[1])
        result = result_from_reports(resolved, reports, global_batch=global_batch, seq_len=seq_len, steps=steps,
                                     warmup=warmup, seed=seed, device=_device_kind(device), emulate=None,
                                     data=desc, wall_s=wall)
        if result.measured is not None:
            result.measured["load"] = load
        return result

    # -- the end ------------------------------------------------------------------------------------
    def close(self, error: str | None, code: int) -> None:
        """Tell every node the validation is over; wait (briefly) until they have read it."""
        from autotune.runtime.launcher import stop_all

        try:
            self.store.set("end", json.dumps({"error": error, "code": code}))
            end = time.monotonic() + BYE_S
            waiting = [k for k in range(1, self.nodes) if k not in self.gone and self.store.check([f"machine/{k}"])]
            while time.monotonic() < end and not all(self.store.check([f"bye/{k}"]) for k in waiting):
                time.sleep(0.1)
            deadline = time.monotonic() + BYE_S
            for p in self.remote:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:
            stop_all(self.remote)
            for p in self.remote:
                p.finish()
            del self.store


def follow(study: str, node_rank: int, *, addr: str, port: int, say) -> dict[str, Any]:
    """Node-rank K (> 0) of a validation across hosts: join node 0, run this node's part of every
    trial it publishes, until it says the end. Raises the error that ended the validation."""
    cport = control_port(port)
    try:
        store = _store(addr, cport, leader=False, timeout_s=JOIN_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - torch raises several kinds for a store it cannot reach
        raise WorkError(f"node-rank 0 did not answer at {addr}:{cport} within {JOIN_TIMEOUT_S:g} s ({e}); start "
                        f"`autotune validate --study {study} --node-rank 0` on {addr}") from None
    hello = json.loads(store.get("hello"))
    if hello["study"] != study:
        raise InputError(f"node-rank 0 validates study {hello['study']!r}, not {study!r}", field="--study")
    if not 0 < node_rank < hello["nodes"]:
        raise InputError(f"study {study!r} runs on {hello['nodes']} node(s): node-rank 1..{hello['nodes'] - 1} "
                         "join node-rank 0", field="--node-rank")
    if store.add(f"join/{node_rank}", 1) > 1:
        raise InputError(f"another host already joined as node-rank {node_rank}", field="--node-rank")
    store.set(f"machine/{node_rank}", machine_to_json(this_machine(hello["device"])))
    beat = Beat(addr, cport, node_rank)

    def leader_alive() -> None:
        if beat.lost is not None:
            raise WorkError(f"node-rank 0 ({addr}) is gone: {beat.lost}")

    ran = 0
    try:
        i = 0
        while True:
            try:
                has_trial, has_end = store.check([f"trial/{i}"]), store.check(["end"])
            except Exception as e:  # noqa: BLE001 - the store is node 0's: it is gone
                raise WorkError(f"node-rank 0 ({addr}) is gone: {str(e).strip().splitlines()[0]}") from None
            if has_trial:
                trial = json.loads(store.get(f"trial/{i}"))
                if node_rank < len(trial["lines"]):
                    say(f"trial {i}: running node-rank {node_rank}'s ranks")
                    msg = _run_part(trial["lines"][node_rank], trial["nodes"][node_rank], node_rank, trial,
                                    leader_alive)
                    leader_alive()
                    store.set(f"result/{i}/{node_rank}", json.dumps(msg))
                    ran += 1
                i += 1
                continue
            if has_end:
                end = json.loads(store.get("end"))
                store.set(f"bye/{node_rank}", "1")
                if end["error"]:
                    raise (InputError(end["error"]) if end["code"] == 2 else WorkError(end["error"]))
                return {"node_rank": node_rank, "trials_run": ran, "study": study}
            leader_alive()
            time.sleep(0.2)
    finally:
        beat.stop()


def master_from_env() -> tuple[str, int]:
    """``--node-rank K``: where node-rank 0 is (``MASTER_ADDR``, ``MASTER_PORT`` default 29500)."""
    from autotune.hostfile import DEFAULT_PORT

    addr = os.environ.get("MASTER_ADDR")
    if not addr:
        raise InputError("set MASTER_ADDR to node-rank 0's host (and MASTER_PORT, default "
                         f"{DEFAULT_PORT}) on every host", field="--node-rank")
    port = os.environ.get("MASTER_PORT") or str(DEFAULT_PORT)
    if not port.isdigit() or not 0 < int(port) < 65534:
        raise InputError(f"must be a port number, got {port!r}", field="MASTER_PORT")
    return addr, int(port)


def lead(study: str, storage: str, options: Any, *, hosts_file: str | None = None, shell: str | None = None,
         progress=None) -> dict[str, Any]:
    """``validate --node-rank 0`` (the other hosts run ``--node-rank K`` themselves) or ``validate
    --hosts FILE`` (this host starts them through the remote shell): the validation, led from here."""
    from autotune import hostfile
    from autotune.export.launch import ShellLine
    from autotune.study import open_study, study_workload
    from autotune.validate import validate

    _, cluster, _, _ = study_workload(open_study(study, storage), storage)
    per_node = [cluster.node_group(k).devices_per_node for k in range(cluster.num_nodes)]
    remote_lines: list[str] = []
    names = None
    if hosts_file is not None:
        hosts = hostfile.read_hosts(hosts_file)
        hostfile.check_hosts(hosts, per_node, f"study {study!r}", hosts_file)
        words = hostfile.remote_shell(shell)
        addr, port = hostfile.rendezvous(hosts)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)  # node 0's torchrun lines
        import shlex

        cmd = f"autotune validate --study {shlex.quote(study)} --node-rank"
        remote_lines = hostfile.node_lines(hosts, [f"{cmd} {k}" for k in range(len(hosts))], words, addr, port)[1:]
        names = [h.name for h in hosts]
    else:
        addr, port = master_from_env()
    with Leader(study, cluster, addr=addr, port=port, device=options.device, hosts=names) as leader:
        env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
        for line in remote_lines:
            leader.remote.append(ShellLine(line, env))
        machines = leader.machines()
        return validate(study, storage, options=options, progress=progress, machines=machines,
                        runner=leader.run_trial, prepare=leader.prepare)
