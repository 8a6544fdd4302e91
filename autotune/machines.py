"""Which machines a validation launches on, and whether they are the study's cluster.

A real trial proves a prediction only on the devices the prediction was made for: a study searched
for 2 x H100 and "validated" on CPU workers measures another machine, and a calibration fitted on it
would rescale the H100 model by the CPU's speed. ``validate`` (and ``tune``, through it) therefore
compares the study's cluster with the machines it is about to launch on and refuses a mismatch
(``ClusterMismatch``, an InputError: exit 2, one line naming what differs, nothing written).

What is compared, node by node:

* the number of nodes (a local launch is one node; a validation across hosts gathers one
  ``Machine`` per host, autotune.runtime.control, and passes them all to ``check_machines``);
* the device type of every node: its kind (cpu, cuda, rocm) and model: the catalogue name of a GPU
  (``H100-SXM``: the local GPU's name is matched to the catalogue as ``local`` does), the device
  name a profile recorded (``profile:ID``: the GPU name, or the CPU model on CPU), and nothing more
  for ``local``'s derived CPU (``CPU``: whatever CPU runs it; search on a profile to pin one);
* the device count per node for accelerators. CPU "devices" are worker processes the launcher
  starts as the plan asks (``local:N``), so their count is not a property of the machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.errors import InputError


@dataclass(frozen=True)
class DeviceType:
    kind: str
    """``cpu``, ``cuda`` or ``rocm``."""
    model: str = ""
    """Catalogue name (GPU), the device name a profile recorded, or "" (local CPU: any)."""

    def label(self) -> str:
        return f"{self.model or 'CPU'} ({self.kind})" if self.kind != "cpu" else (
            f"CPU {self.model}" if self.model else "CPU workers")


@dataclass(frozen=True)
class Machine:
    """One node a validation launches on: its devices, in local order."""

    host: str
    devices: tuple[DeviceType, ...]
    cpu_model: str = ""

    def describe(self) -> str:
        if not self.devices:
            return f"{self.host}: no device"
        if len(set(self.devices)) == 1:
            return _node_text(self.devices[0], len(self.devices))
        return ", ".join(d.label() for d in self.devices)


class ClusterMismatch(InputError):
    """The machines of the launch are not the study's cluster."""


def _catalogue_name_of_gpu(name: str) -> str:
    from autotune.specs.cluster import _match_gpu

    spec = _match_gpu(name)
    return spec.name if spec is not None else name


def this_machine(device: str = "auto") -> Machine:
    """The node a local launch runs on, seen as the runtime will use it (``device`` as ``trial``)."""
    import socket

    import torch

    from profilers.worker import fingerprint

    cpu = fingerprint("cpu").get("cpu_model") or ""
    if device != "cpu" and torch.cuda.is_available():
        kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        gpus = tuple(DeviceType(kind, _catalogue_name_of_gpu(torch.cuda.get_device_name(i)))
                     for i in range(torch.cuda.device_count()))
        return Machine(socket.gethostname(), gpus, cpu)
    return Machine(socket.gethostname(), (DeviceType("cpu", cpu),), cpu)


def _profile_device(name: str, storage: str | None) -> DeviceType:
    from profilers.store import load_profile

    ref = name.split(":", 1)[1]
    try:
        run = load_profile(ref, storage)["run"]
    except InputError as e:
        raise ClusterMismatch(f"the study's device {name} is a profile this storage does not hold ({e.message}): "
                              "cannot tell whether this machine is that device", field="--study") from None
    kind = run["device_kind"]
    model = run["device_name"] if kind == "cpu" else _catalogue_name_of_gpu(run["device_name"])
    return DeviceType(kind, model)


def study_nodes(user_attrs: dict[str, Any], cluster: Any, storage: str | None) -> list[tuple[DeviceType, int]]:
    """(device type, devices) of every node of the study's cluster, from what the study *recorded*
    (``cluster_spec``): rebuilding ``local`` on this machine would describe this machine instead."""
    from autotune.specs.catalogue import CATALOGUE

    spec = user_attrs.get("cluster_spec") or {}
    groups = spec.get("nodes") or [{"count": g.count, "devices_per_node": g.devices_per_node, "device": g.device.name}
                                   for g in cluster.groups]
    rebuilt = {g.device.name: g.device for g in cluster.groups}
    out: list[tuple[DeviceType, int]] = []
    for g in groups:
        name = str(g["device"])
        if name.startswith("profile:"):
            dtype = _profile_device(name, storage)
        elif name == "CPU":
            dtype = DeviceType("cpu")
        elif name in CATALOGUE:
            dtype = DeviceType(CATALOGUE[name].kind, name)
        elif name in rebuilt:  # a device the cluster file describes itself
            dtype = DeviceType(rebuilt[name].kind, name)
        else:
            raise ClusterMismatch(f"the study's device {name!r} is neither in the catalogue nor a profile: "
                                  "cannot tell whether this machine is that device", field="--study")
        out += [(dtype, int(g["devices_per_node"]))] * int(g["count"])
    return out


def _same_type(want: DeviceType, have: DeviceType) -> bool:
    if want.kind != have.kind:
        return False
    return not want.model or want.model == have.model


def _node_text(t: DeviceType, count: int) -> str:
    return f"{count} x {t.label()}" if t.kind != "cpu" else t.label()


def mismatch(nodes: list[tuple[DeviceType, int]], machines: list[Machine]) -> str | None:
    """What differs between the study's nodes and the machines of the launch (None: they match)."""
    if len(nodes) != len(machines):
        want = "; ".join(_node_text(t, n) for t, n in nodes)
        return (f"the study's cluster has {len(nodes)} node(s) ({want}), this launch runs on "
                f"{len(machines)} ({'; '.join(m.describe() for m in machines)})")
    for i, ((want, count), m) in enumerate(zip(nodes, machines, strict=True)):
        where = f" node {i}" if len(nodes) > 1 else ""
        if not m.devices or any(not _same_type(want, d) for d in m.devices):
            return f"the study's cluster{where} has {_node_text(want, count)}, this launch uses {m.describe()}"
        if want.kind != "cpu" and len(m.devices) != count:
            return (f"the study's cluster{where} has {_node_text(want, count)}, this machine has "
                    f"{m.describe()}")
    return None


def check_machines(user_attrs: dict[str, Any], cluster: Any, storage: str | None, machines: list[Machine],
                   study_name: str) -> None:
    """Raise ``ClusterMismatch`` (one line) unless ``machines`` are the study's cluster."""
    nodes = study_nodes(user_attrs, cluster, storage)
    why = mismatch(nodes, machines)
    if why is not None:
        cpu_study = all(t.kind == "cpu" for t, _ in nodes)
        gpu_launch = any(d.kind != "cpu" for m in machines for d in m.devices)
        hint = ("--device cpu runs on this machine's CPU workers" if cpu_study and gpu_launch else
                f"run `autotune validate --study {study_name} --node-rank K` on each of its {len(nodes)} hosts "
                "(MASTER_ADDR: node-rank 0's host), or --hosts FILE from one of them"
                if len(nodes) > 1 and len(machines) == 1 else
                "run validate on the study's cluster (or search this machine's own cluster)")
        raise ClusterMismatch(f"study {study_name!r} cannot be validated here: {why}; {hint}", field="--study")


def runtime_version() -> str:
    """What ran the trials, for keying calibrations: the runtime's and torch's versions."""
    import torch

    from autotune import __version__

    return f"autotune {__version__}, torch {torch.__version__}"
