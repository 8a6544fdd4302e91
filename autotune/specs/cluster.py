"""Cluster files: groups of identical nodes, their devices and the links between them.

Keys (every key with its unit and meaning: docs/files.md)::

    name: mixed-h100-a100
    nodes:
      - {count: 2, devices_per_node: 8, device: H100-SXM, intra_node: {bandwidth: "450GB/s", latency: "3us"}}
      - {count: 2, devices_per_node: 8, device: profile:3}
    inter_node: {bandwidth: "25GB/s", latency: "10us"}     # per device, per direction
    overrides:                                              # optional, by global node index
      - {nodes: [0, 2], bandwidth: "12.5GB/s", latency: "20us"}

A node group may also name per-layer profiles measured on its device (``layer_profile: layers:3``
or a list; ``autotune profile --layers`` / ``profile import --format``), set ``framework_reserve`` (bytes the framework holds per device: CUDA
context, NCCL buffers; default the catalogue's ``FRAMEWORK_RESERVE``) and ``attention`` (``fused`` or
``materialized``: how the target runtime runs attention, which decides the activation memory).

Device ``i`` of the flattened cluster is device ``i % devices_per_node`` of node ``i // ...`` in
node order; the Plan's placement maps mesh ranks onto these indices.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.errors import InputError
from autotune.specs import fields as F
from autotune.specs.catalogue import ATTENTION_IMPLS, CATALOGUE, DeviceSpec, device_from_catalogue, local_cpu
from autotune.specs.user_device import device_from_mapping, device_to_mapping
from autotune.units import parse_bandwidth, parse_bytes, parse_time

NODE_KEYS = ("count", "devices_per_node", "device", "intra_node", "framework_reserve", "attention", "layer_profile",
             "available", "price")
"""The keys of a node group (what a study record keeps of a cluster to rebuild it)."""
DEFAULT_INTER_BANDWIDTH = 12.5e9  # 100 Gbit/s Ethernet per device when a file gives none
DEFAULT_INTER_LATENCY = 10e-6


@dataclass(frozen=True, kw_only=True)
class Link:
    """Alpha-beta link: time(bytes) = latency + bytes / bandwidth."""

    bandwidth: float
    """Bytes/s per direction."""
    latency: float = 0.0
    """Seconds per message."""
    kind: str = "intra"
    """``intra`` (inside a node), ``inter`` (between nodes) or ``override``."""

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    def to_dict(self) -> dict[str, str]:
        """With units, as a cluster file writes them (``repr`` keeps every bit of the float)."""
        return {"bandwidth": f"{self.bandwidth!r}B/s", "latency": f"{self.latency!r}s"}


@dataclass(frozen=True, kw_only=True)
class NodeGroup:
    """``count`` identical nodes with ``devices_per_node`` devices of one type each."""

    count: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: Link
    minimum: int | None = None
    """A pool group (``available`` in the file): the least nodes a plan must use; ``count`` is then
    how many are available. None: a plain group, every node used (autotune/specs/pool.py)."""
    price: float | None = None
    """Per device and hour, in ``currency`` (``price: "2.10USD/h"``); None: not given."""
    currency: str = ""


@dataclass(frozen=True, kw_only=True)
class Device:
    """One device of the flattened cluster."""

    index: int
    node: int
    local: int
    group: int
    spec: DeviceSpec


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    name: str
    groups: tuple[NodeGroup, ...]
    inter_node: Link
    overrides: tuple[tuple[int, int, Link], ...] = ()
    source: str = ""
    digest: str = ""
    """sha256 of the file it was read from (provenance in exported plans)."""
    devices: tuple[Device, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.groups:
            raise InputError("a cluster needs at least one node group", field="nodes")
        devs: list[Device] = []
        node = 0
        for gi, g in enumerate(self.groups):
            for _ in range(g.count):
                for local in range(g.devices_per_node):
                    devs.append(Device(index=len(devs), node=node, local=local, group=gi, spec=g.device))
                node += 1
        object.__setattr__(self, "devices", tuple(devs))
        n = self.num_nodes
        for a, b, _ in self.overrides:
            if not (0 <= a < n and 0 <= b < n):
                raise InputError(f"node index out of range 0..{n - 1}: {[a, b]}", field="overrides")

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def num_nodes(self) -> int:
        return sum(g.count for g in self.groups)

    def node_group(self, node: int) -> NodeGroup:
        for g in self.groups:
            if node < g.count:
                return g
            node -= g.count
        raise IndexError(node)

    def device_types(self) -> list[DeviceSpec]:
        seen: dict[str, DeviceSpec] = {}
        for g in self.groups:
            seen.setdefault(g.device.name, g.device)
        return list(seen.values())

    def link(self, a: int, b: int) -> Link:
        """The link between devices ``a`` and ``b`` (by flattened index)."""
        da, db = self.devices[a], self.devices[b]
        for x, y, link in self.overrides:
            if {x, y} == {da.node, db.node}:
                return link
        if da.node == db.node:
            return self.node_group(da.node).intra_node
        return self.inter_node

    def slowest_link(self, devices: list[int]) -> Link:
        """The bottleneck of a group: a ring or all-to-all runs at its slowest pair's speed."""
        if len(devices) < 2:
            return Link(bandwidth=float("inf"), latency=0.0, kind="self")
        worst: Link | None = None
        for i, a in enumerate(devices):
            for b in devices[i + 1:]:
                link = self.link(a, b)
                if worst is None or link.bandwidth < worst.bandwidth or (
                        link.bandwidth == worst.bandwidth and link.latency > worst.latency):
                    worst = link
        assert worst is not None
        return worst

    def total_peak_flops(self, dtype: str) -> float:
        return sum(d.spec.flops(dtype) for d in self.devices)

    def to_dict(self) -> dict[str, Any]:
        """The cluster as a cluster file would write it (units on every figure, inline devices as
        their mapping), so a study's record rebuilds through ``cluster_from_dict`` like a file."""
        return {
            "name": self.name,
            "nodes": [
                {"count": g.count, "devices_per_node": g.devices_per_node,
                 "device": device_to_mapping(g.device) if g.device.provenance == "user" else g.device.name,
                 "provenance": g.device.provenance, "intra_node": g.intra_node.to_dict(), **_group_terms(g.device),
                 **_pool_terms(g)}
                for g in self.groups
            ],
            "inter_node": self.inter_node.to_dict(),
            "overrides": [{"nodes": [a, b], **lk.to_dict()} for a, b, lk in self.overrides],
            "num_devices": self.num_devices,
            "digest": self.digest,
        }


def _pool_terms(g: NodeGroup) -> dict[str, Any]:
    """A pool group's keys as the file writes them (absent for a plain group: its record is unchanged)."""
    out: dict[str, Any] = {}
    if g.minimum is not None:
        out["count"], out["available"] = g.minimum, g.count
    if g.price is not None:
        out["price"] = f"{g.price!r}{g.currency}/h"
    return out


def _group_terms(dev: DeviceSpec) -> dict[str, Any]:
    """The node-group keys that changed the device (read back by ``_runtime_overrides``)."""
    out: dict[str, Any] = {}
    if dev.framework_reserve_bytes is not None:
        out["framework_reserve"] = f"{dev.framework_reserve_bytes!r}B"
    if dev.attention_impl:
        out["attention"] = dev.attention_impl
    if dev.layer_profiles:
        out["layer_profile"] = [f"layers:{lp.get('id')}" for lp in dev.layer_profiles]
    return out


def cluster_from_record(name: str, spec: dict[str, Any] | None, storage: str | None = None,
                        digest: str = "") -> ClusterSpec:
    """The one way to rebuild a study's cluster from what it recorded (``ClusterSpec.to_dict``):
    ``local``/``local:N`` and this machine's GPUs (``local-H100-SXM[:N]``) by name, anything else from
    its spec, read as a cluster file (the keys ``to_dict`` adds beside the file's are dropped)."""
    if name == "local" or name.startswith("local:"):
        return load_cluster(name)
    if name.startswith("local-"):
        return load_cluster(f"local:{name.rsplit(':', 1)[1]}" if ":" in name else "local")
    if not spec or not spec.get("nodes"):
        raise InputError(f"the study records cluster {name!r} without its spec; pass its file with --cluster",
                         field="--cluster")
    d = {"name": spec.get("name", name),
         "nodes": [{k: n[k] for k in NODE_KEYS if k in n} for n in spec["nodes"]],
         "inter_node": spec.get("inter_node"), "overrides": spec.get("overrides") or []}
    return cluster_from_dict(d, source=f"study cluster {name}", storage=storage,
                             digest=digest or str(spec.get("digest") or ""))


ProfileResolver = Callable[[str, str | None], DeviceSpec]


def _default_profile_resolver(ref: str, storage: str | None) -> DeviceSpec:
    """``profile:ID`` -> a measured DeviceSpec from the profile store (autotune/specs/profiles.py)."""
    from autotune.specs.profiles import device_spec_from_profile  # sqlalchemy: only when a profile is named
    return device_spec_from_profile(ref.split(":", 1)[1], storage)


def _link(d: Any, field: str, default_bw: float | None, default_lat: float, kind: str) -> Link:
    if d is None:
        if default_bw is None:
            raise InputError("missing required field", field=field)
        return Link(bandwidth=default_bw, latency=default_lat, kind=kind)
    if not isinstance(d, dict):
        raise InputError(f"expected a mapping with bandwidth and latency, got {d!r}", field=field)
    F.reject_unknown(d, {"bandwidth", "latency"}, field)
    if "bandwidth" in d and d["bandwidth"] is not None:
        bw = parse_bandwidth(d["bandwidth"], field=f"{field}.bandwidth")
    elif default_bw is not None:
        bw = default_bw
    else:
        raise InputError("missing required field", field=f"{field}.bandwidth")
    lat = parse_time(d["latency"], field=f"{field}.latency") if d.get("latency") is not None else default_lat
    return Link(bandwidth=bw, latency=lat, kind=kind)


def _layer_profiles(refs: Any, where: str, storage: str | None) -> tuple[dict[str, Any], ...]:
    """``layers:ID`` (or a list of them) -> the stored layer-profile documents."""
    refs = refs if isinstance(refs, list) else [refs]
    out = []
    for i, ref in enumerate(refs):
        if not isinstance(ref, str) or not ref.startswith("layers:"):
            raise InputError(f"expected layers:ID (see `autotune profile list`), got {ref!r}", field=where)
        from autotune.defaults import DEFAULT_STORAGE
        from autotune.specs.profiles import load_layer_profile

        try:
            out.append(load_layer_profile(ref, storage or DEFAULT_STORAGE))
        except InputError as e:
            raise InputError(e.message, field=where if len(refs) == 1 else f"{where}[{i}]") from None
    return tuple(out)


def _runtime_overrides(dev: DeviceSpec, nd: dict[str, Any], where: str, storage: str | None = None) -> DeviceSpec:
    """The node group's ``framework_reserve`` and ``attention`` replace the device's defaults; its
    ``layer_profile`` attaches measured per-layer profiles."""
    changes: dict[str, Any] = {}
    if nd.get("layer_profile") is not None:
        changes["layer_profiles"] = _layer_profiles(nd["layer_profile"], f"{where}.layer_profile", storage)
    if nd.get("framework_reserve") is not None:
        changes["framework_reserve_bytes"] = parse_bytes(nd["framework_reserve"], field=f"{where}.framework_reserve",
                                                        allow_zero=True)
    if nd.get("attention") is not None:
        changes["attention_impl"] = F.get_str(nd, "attention", f"{where}.attention", choices=ATTENTION_IMPLS)
    return dataclasses.replace(dev, **changes) if changes else dev


def cluster_from_dict(d: dict[str, Any], source: str | None = None, storage: str | None = None,
                      resolve_profile: ProfileResolver | None = None, digest: str = "") -> ClusterSpec:
    resolve_profile = resolve_profile or _default_profile_resolver
    try:
        F.reject_unknown(d, {"name", "nodes", "inter_node", "overrides"}, None)
        nodes = d.get("nodes")
        if not isinstance(nodes, list) or not nodes:
            raise InputError("a cluster needs a non-empty list of node groups", field="nodes")
        groups = []
        for i, nd in enumerate(nodes):
            where = f"nodes[{i}]"
            if not isinstance(nd, dict):
                raise InputError(f"expected a mapping, got {nd!r}", field=where)
            F.reject_unknown(nd, set(NODE_KEYS), where)
            from autotune.specs.pool import pool_terms

            written = None if nd.get("count") is None else F.get_int(nd, "count", f"{where}.count",
                                                                       minimum=0 if nd.get("available") else 1)
            count, least, price, currency = pool_terms(nd, where, written)
            dpn = F.get_int(nd, "devices_per_node", f"{where}.devices_per_node")
            raw_dev = F.get(nd, "device", f"{where}.device")
            if isinstance(raw_dev, dict):  # described inline (autotune/specs/user_device.py)
                dev = device_from_mapping(raw_dev, f"{where}.device")
            elif (dev_name := F.get_str(nd, "device", f"{where}.device")).startswith("profile:"):
                try:
                    dev = resolve_profile(dev_name, storage)
                except InputError as e:
                    raise InputError(e.message, field=f"{where}.device") from None
            else:
                dev = device_from_catalogue(dev_name, field=f"{where}.device")
            dev = _runtime_overrides(dev, nd, where, storage)
            intra = _link(nd.get("intra_node"), f"{where}.intra_node", dev.intra_node_bandwidth,
                          dev.intra_node_latency, "intra")
            groups.append(NodeGroup(count=count, devices_per_node=dpn, device=dev, intra_node=intra, minimum=least,
                                    price=price, currency=currency))
        inter_default = min(g.device.nic_bandwidth for g in groups)
        inter = _link(d.get("inter_node"), "inter_node", inter_default, DEFAULT_INTER_LATENCY, "inter")
        overrides = []
        for i, o in enumerate(d.get("overrides") or []):
            where = f"overrides[{i}]"
            if not isinstance(o, dict):
                raise InputError(f"expected a mapping, got {o!r}", field=where)
            pair = o.get("nodes")
            if (not isinstance(pair, list) or len(pair) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)):
                raise InputError("nodes must be a list of two node indices", field=f"{where}.nodes")
            link = _link({k: v for k, v in o.items() if k != "nodes"}, where, None, 0.0, "override")
            overrides.append((pair[0], pair[1], link))
        name = F.get_str(d, "name", "name", default=Path(source).stem if source else "cluster")
        try:
            return ClusterSpec(name=name, groups=tuple(groups), inter_node=inter, overrides=tuple(overrides),
                               source=source or "", digest=digest)
        except InputError as e:
            raise e.within(source=source) from None
    except InputError as e:
        raise e.within(source=source) from None


def _local_gpus() -> list[tuple[str, float]]:
    """(name, memory bytes) per visible NVIDIA GPU, via nvidia-smi so planning never imports torch."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, _, mem = line.partition(",")
        try:
            gpus.append((name.strip(), float(mem) * 2**20))
        except ValueError:
            continue
    return gpus


def _match_gpu(name: str) -> DeviceSpec | None:
    """'NVIDIA H100 80GB HBM3' -> H100-SXM; best effort on the catalogue names."""
    n = name.upper().replace(" ", "")
    table = [("H100PCIE", "H100-PCIe"), ("H100", "H100-SXM"), ("H200", "H200"), ("H20", "H20"),
             ("A100-SXM4-40GB", "A100-40GB"), ("A100-PCIE-40GB", "A100-40GB"), ("A100", "A100-80GB"),
             ("L40S", "L40S"), ("L4", "L4"), ("A10", "A10"), ("4090", "RTX-4090"), ("V100", "V100")]
    for key, cat in table:
        if key in n:
            return CATALOGUE[cat]
    return None


def local_cluster(devices: int | None = None) -> ClusterSpec:
    """This machine as it is: its GPUs when nvidia-smi sees any, else the CPU split into workers.

    On CPU each worker is one process of the runtime; the default is one worker per core (at
    least 2, so that every parallelism can be exercised), ``local:N`` asks for N.
    """
    gpus = _local_gpus()
    if gpus and (devices is None or devices <= len(gpus)):
        n = devices or len(gpus)
        spec = _match_gpu(gpus[0][0])
        if spec is None:
            raise InputError(f"local GPU {gpus[0][0]!r} is not in the catalogue; run `autotune profile` "
                             "and use a cluster file with device: profile:ID", field="cluster")
        name = "local-" + spec.name
        group = NodeGroup(count=1, devices_per_node=n, device=spec,
                          intra_node=Link(bandwidth=spec.intra_node_bandwidth, latency=spec.intra_node_latency))
    else:
        n = devices or max(2, os.cpu_count() or 1)
        spec = local_cpu(n)
        name = "local"
        group = NodeGroup(count=1, devices_per_node=n, device=spec,
                          intra_node=Link(bandwidth=spec.intra_node_bandwidth, latency=spec.intra_node_latency))
    return ClusterSpec(name=name if devices is None else f"{name}:{n}", groups=(group,),
                       inter_node=Link(bandwidth=spec.nic_bandwidth, latency=DEFAULT_INTER_LATENCY, kind="inter"),
                       source="local")


def load_cluster(name_or_path: str | Path = "local", storage: str | None = None,
                 resolve_profile: ProfileResolver | None = None) -> ClusterSpec:
    """``local``, ``local:N`` or a YAML/JSON cluster file."""
    s = str(name_or_path)
    if s == "local" or s.startswith("local:"):
        n = None
        if ":" in s:
            try:
                n = int(s.split(":", 1)[1])
            except ValueError:
                n = 0
            if n < 1:
                raise InputError(f"bad local cluster {s!r}; write local or local:N with N >= 1", field="cluster")
        return local_cluster(n)
    p = Path(s)
    data = F.read_mapping(p, "cluster")
    digest = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
    return cluster_from_dict(data, source=s, storage=storage, resolve_profile=resolve_profile, digest=digest)
