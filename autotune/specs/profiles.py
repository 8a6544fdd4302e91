"""The profile store's tables and readers: SQLAlchemy 2 tables in the storage URL (default ``sqlite:///results/autotune.db``).

Tables (prefixed so they sit beside Optuna's in the same file):

- ``autotune_profile_runs``: one row per profile: label, device kind and name, ranks, hosts,
  hardware fingerprint, software versions, emulated slowdowns, timings, where it came from
  (``measured`` here or ``imported`` from a file).
- ``autotune_profile_samples``: every measured point (rank, kind, parameters, median, spread,
  unstable flag, raw repeat times, derived metrics).
- ``autotune_profile_fits``: the fits per rank (compute) and for the whole run (links), in the
  shape docs/contracts.md "Profiles" documents.
- ``autotune_layer_profiles``: per-layer profiles (``profilers/layers.py``, or imported from
  Sailor / Metis / Galvatron files by ``profilers/foreign/``): one row per (device, model, dtype)
  with its points (piece, tp, micro-batch, sequence -> forward/backward seconds and activation
  bytes) in a JSON column and its own ``schema_version`` (``LAYER_SCHEMA_VERSION``); referred to as
  ``layers:ID``.

A profile is written in a single transaction after all ranks have finished (``save_profile``), so
a failed run leaves the database as it was; imports likewise. Export/import use a JSON document
with ``schema_version`` and ``units``. ``device_spec_from_profile`` turns a stored profile into a
``DeviceSpec`` (provenance ``measured``) for cluster files that say ``device: profile:ID``.

This module holds the stored measurements and reads them: the cost model and the cluster files read
a profile through it as plain data, never through a profiler. Writing a profile (fitting the raw
samples, importing a document) is the profilers' side: ``profilers/store.py``. It imports no torch:
the planning half reads profiles without it.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.errors import InputError
from autotune.specs.profile_schema import SCHEMA_VERSION

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from autotune.specs.profile_tables import LayerProfileRow, ProfileRun


DOC_KIND = "autotune-profile"


UNITS = {
    "time": "s (fields ending _s)",
    "size": "bytes (fields named bytes or ending _bytes)",
    "bandwidth": "bytes/s (fields ending _bytes_per_s; p2p_bandwidth matrix too)",
    "latency": "s (p2p_latency matrix)",
    "flops": "FLOP per call (work of gemm/attention samples, flops)",
    "throughput": "FLOP/s (fields ending flops_per_s; second element of gemm points)",
}


PIECES = ("embed", "block", "head")
"""The pieces of every model's layer profile (an MoE model's ``block`` is its first dense layer)."""


MOE_PIECE = "moe"
"""An MoE model's MoE block, one point per EP degree it was timed at (``ep``)."""


STORED_PIECES = (*PIECES, MOE_PIECE)


LAYER_DOC_KIND = "autotune-layer-profile"


LAYER_SCHEMA_VERSION = 1


LAYER_UNITS = {"time": "s per call of the piece (fwd_s, bwd_s, fwd_bwd_s)",
               "memory": "bytes (activation_bytes: saved for backward per call; param_bytes: the shard's)",
               "micro_batch": "samples", "seq": "tokens", "tp": "shards the piece's weights are split into",
               "ep": "expert-parallel ranks the moe piece's experts are split over (it times one)"}


_TABLES = ("Base", "ProfileRun", "ProfileSample", "ProfileFit", "LayerProfileRow")
"""The SQLAlchemy tables (``autotune/specs/profile_tables.py``), read from here when first asked for."""


def __getattr__(name: str) -> Any:
    """The tables by their old names, imported on first use (PEP 562): the cost model imports this
    module for its constants on every search, and the tables' SQLAlchemy ORM is needed only where a
    profile is read or written."""
    if name in _TABLES:
        from autotune.specs import profile_tables

        return getattr(profile_tables, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_ENGINES: dict[str, Any] = {}


def profile_url(storage: str) -> str:
    """Where the profiles of a storage live, so that every ``--storage`` a study takes holds profiles
    too: the same database for an SQLAlchemy URL; for an Optuna journal file (``x.log``, which holds
    studies only) the SQLite file ``x.log.profiles.db`` beside it; for ``:memory:`` an SQLite database
    of this process."""
    if storage == ":memory:":
        return "sqlite://"
    if storage.endswith(".log") and "://" not in storage:
        return f"sqlite:///{storage}.profiles.db"
    return storage


def absolute_sqlite(url: str) -> str:
    """``url`` with a relative SQLite file made absolute against today's working directory (other
    URLs unchanged): SQLAlchemy opens a relative file against whatever directory is current when a
    connection is made, and an engine cached under the relative URL kept answering from the first
    directory's database after a ``chdir`` (the study storages and this module's engines both)."""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        return url
    path, sep, query = url[len(prefix):].partition("?")
    if not path or path == ":memory:" or os.path.isabs(path):
        return url
    return prefix + os.path.abspath(path) + sep + query


def engine_for(storage: str):
    """An engine for ``storage`` with the tables created; bad URLs are input errors on --storage."""
    from sqlalchemy import create_engine
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError
    from sqlalchemy.pool import StaticPool

    url = absolute_sqlite(profile_url(storage))
    if url in _ENGINES:
        return _ENGINES[url]
    if "://" not in url:
        raise InputError(f"profiles need an SQLAlchemy URL such as sqlite:///results/autotune.db, a journal "
                         f"file ending in .log or :memory:, got {storage!r}", field="--storage")
    if url.startswith("sqlite:///") and not url.startswith("sqlite:///:memory:"):
        path = Path(url[len("sqlite:///"):])
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # one shared connection for a database that lives in this process (sqlite://)
        eng = create_engine(url, poolclass=StaticPool, connect_args={"check_same_thread": False}) \
            if url == "sqlite://" else create_engine(url)
        _create_tables(eng)
    except (ArgumentError, SQLAlchemyError, ImportError, ValueError) as e:
        raise InputError(f"cannot open storage {storage!r}: {str(e).splitlines()[0]}", field="--storage") from None
    _ENGINES[url] = eng  # keyed by the absolute file (absolute_sqlite)
    return eng


def _session(storage: str) -> Session:
    """A session on the profile store of ``storage`` (SQLAlchemy's ORM imported here, not with the module)."""
    from sqlalchemy.orm import Session

    return Session(engine_for(storage))


def _create_tables(eng: Any, attempts: int = 3) -> None:
    """``create_all``, safe when another process creates the same tables at the same moment: the
    agents of a profile across hosts open one fresh storage together, and ``create_all``'s check then
    create is not atomic (``table autotune_profile_samples already exists`` failed such a profile).
    A table that another process created in between is what we wanted: check again."""
    from sqlalchemy.exc import SQLAlchemyError

    from autotune.specs.profile_tables import Base

    for left in range(attempts - 1, -1, -1):
        try:
            Base.metadata.create_all(eng)
            return
        except SQLAlchemyError as e:
            if left == 0 or "already exists" not in str(e):
                raise


def _finite(x: Any) -> Any:
    """JSON columns cannot hold inf/nan: store them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def parse_ref(ref: str | int) -> tuple[int, int | None]:
    """``"3"`` -> (3, None); ``"3:1"`` -> (3, 1) (rank 1's device of profile 3)."""
    text = str(ref).strip()
    head, _, rank = text.partition(":")
    try:
        pid = int(head)
        r = int(rank) if rank else None
    except ValueError:
        raise InputError(f"bad profile id {text!r}; write ID or ID:RANK (see `autotune profile list`)",
                         field="id") from None
    if pid < 1 or (r is not None and r < 0):
        raise InputError(f"bad profile id {text!r}; ids start at 1, ranks at 0", field="id")
    return pid, r


def _get_run(s: Session, pid: int, storage: str) -> ProfileRun:
    from sqlalchemy import select

    from autotune.specs.profile_tables import ProfileRun

    run = s.get(ProfileRun, pid)
    if run is None:
        known = [str(i) for i in s.scalars(select(ProfileRun.id).order_by(ProfileRun.id)).all()]
        hint = f"known ids: {', '.join(known[-10:])}" if known else "the store has no profiles yet; run `autotune profile`"
        raise InputError(f"no profile {pid} in {storage} ({hint})", field="id")
    return run


def _run_dict(run: ProfileRun) -> dict[str, Any]:
    return {"id": run.id, "label": run.label, "created_at": run.created_at, "device_kind": run.device_kind,
            "device_name": run.device_name, "nproc": run.nproc, "quick": run.quick, "hosts": run.hosts,
            "fingerprint": run.fingerprint, "versions": run.versions, "emulated": run.emulated,
            "measure_s": run.measure_s, "wall_s": run.wall_s, "unstable": run.unstable, "origin": run.origin,
            "imported_from": run.imported_from}


def list_profiles(storage: str) -> list[dict[str, Any]]:
    from sqlalchemy import select

    from autotune.specs.profile_tables import ProfileRun

    with _session(storage) as s:
        return [_run_dict(r) for r in s.scalars(select(ProfileRun).order_by(ProfileRun.id)).all()]


def load_profile(ref: str | int, storage: str) -> dict[str, Any]:
    """The export document of a profile: run, samples, fits, units, schema_version."""
    pid, _ = parse_ref(ref)
    with _session(storage) as s:
        run = _get_run(s, pid, storage)
        return {
            "schema_version": SCHEMA_VERSION, "kind": DOC_KIND, "units": UNITS, "run": _run_dict(run),
            "samples": [{"rank": x.rank, "kind": x.kind, "params": x.params, "work": x.work, "timing": x.timing,
                         "metrics": x.metrics} for x in sorted(run.samples, key=lambda x: x.id)],
            "fits": {"compute": {str(f.rank): f.data for f in run.fits if f.kind == "compute"},
                     "links": next((f.data for f in run.fits if f.kind == "links"), {})},
        }


export_profile = load_profile


def _doc_error(msg: str, source: str | None, field: str | None = None) -> InputError:
    return InputError(msg, source=source, field=field)


def device_spec_from_profile(ref: str | int, storage: str | None = None):
    """``profile:ID`` (or ``ID:RANK``) -> a measured ``DeviceSpec``.

    Rank 0's device unless a rank is given (with ``--emulate-slowdown`` ranks differ). Figures:
    ``peak_flops[dtype]`` = fitted large-GEMM rate (so ``achievable_fraction`` is 1.0: the peak is
    already what is achieved), memory = capacity per rank on its host, memory bandwidth = copy
    bandwidth, intra-node bandwidth/latency = the ``intra`` alpha-beta fit of the p2p pairs. The
    fits themselves go into ``DeviceSpec.profile`` (docs/contracts.md "Profiles").
    """
    from autotune.defaults import DEFAULT_STORAGE
    from autotune.specs.catalogue import GB, DeviceSpec, local_cpu

    storage = storage or DEFAULT_STORAGE
    pid, rank = parse_ref(ref)
    with _session(storage) as s:
        run = _get_run(s, pid, storage)
        compute = {f.rank: f.data for f in run.fits if f.kind == "compute"}
        links = next((f.data for f in run.fits if f.kind == "links"), {}) or {}
        info = _run_dict(run)
    r = 0 if rank is None else rank
    if r not in compute:
        raise InputError(f"profile {pid} has ranks 0..{len(compute) - 1}, not {r}", field="id")
    fit = compute[r]
    peak = {}
    for dt, g in (fit.get("gemm") or {}).items():
        rate = g.get("peak_flops_per_s")
        best = g.get("best_flops_per_s") or 0.0
        peak[dt] = float(rate) if rate and math.isfinite(rate) and rate < 4 * best else float(best)
    if info["device_kind"] == "cpu" and "fp32" in peak:
        peak["fp32-strict"] = peak["fp32"]  # no tensor cores: strict fp32 is the measured fp32
    mem = fit.get("memory") or {}
    per_host = max(1, info["hosts"].count(info["hosts"][r]) if r < len(info["hosts"]) else 1)
    capacity = float(mem.get("capacity_bytes") or 0.0)
    if info["device_kind"] == "cpu":
        capacity /= per_host  # the host's RAM is split between its ranks, as local_cpu(n) does
    fallback = local_cpu(max(1, info["nproc"])) if info["device_kind"] == "cpu" else None
    intra = (links.get("alpha_beta") or {}).get("intra") or {}
    inter = (links.get("alpha_beta") or {}).get("inter") or {}
    intra_bw = intra.get("beta_bytes_per_s") or (fallback.intra_node_bandwidth if fallback else 32 * GB)
    intra_lat = intra.get("alpha_s") or _min_offdiag(links.get("p2p_latency")) or 3e-6
    nic = inter.get("beta_bytes_per_s") or (fallback.nic_bandwidth if fallback else 25 * GB)
    emu = fit.get("emulated_slowdown")
    src = (f"autotune profile {pid}" + (f" ({info['label']})" if info["label"] else "") + f", rank {r} on "
           f"{info['hosts'][r] if r < len(info['hosts']) else '?'}: {info['device_name']}, {info['created_at']}"
           + (", imported" if info["origin"] == "imported" else "")
           + (f", EMULATED {emu:g}x slower device" if emu else ""))
    profile = {"id": pid, "rank": r, "emulated_slowdown": emu, "gemm": fit.get("gemm") or {},
               "gemm_unsupported": fit.get("gemm_unsupported") or {},
               "attention": fit.get("attention") or {}, "memory": mem, "links": links,
               "attention_trial": fit.get("attention_trial") or {},
               # CPU: the SDPA price by kernel tiles (cost/cpu_attention.py)
               "attention_cpu": fit.get("attention_cpu") or {},
               # the rank's measured per-call costs (profilers.overheads); the cost model falls back
               # to its defaults for any key absent here
               "overheads": fit.get("overheads") or {},
               # the runtime's block and head at a reference shape (profilers/block_ref.py); the load
               # the machine was under while it was measured (autotune/machine_load.py)
               "block_ref": fit.get("block_ref") or {}, "load": (info["fingerprint"] or {}).get("load")}
    return DeviceSpec(name=f"profile:{pid}" + (f":{rank}" if rank is not None else ""), kind=info["device_kind"],
                      peak_flops=peak, memory_bytes=capacity or (fallback.memory_bytes if fallback else 0.0),
                      memory_bandwidth=float(mem.get("bandwidth_bytes_per_s") or 0.0) or 1.0 * GB,
                      intra_node_bandwidth=float(intra_bw), intra_node_latency=float(intra_lat),
                      interconnect="loopback (gloo)" if info["device_kind"] == "cpu" else "measured",
                      nic_bandwidth=float(nic), achievable_fraction=1.0, provenance="measured", source=src,
                      profile=profile)


def _min_offdiag(m: Any) -> float | None:
    vals = [v for row in (m or []) for v in row if isinstance(v, (int, float)) and v > 0]
    return min(vals) if vals else None


# ---- per-layer profiles -------------------------------------------------------------------------
LAYER_REF_PREFIX = "layers:"


def parse_layer_ref(ref: str | int) -> int:
    """``"layers:3"`` or ``"3"`` -> 3."""
    text = str(ref).strip()
    if text.startswith(LAYER_REF_PREFIX):
        text = text[len(LAYER_REF_PREFIX):]
    try:
        lid = int(text)
    except ValueError:
        lid = 0
    if lid < 1:
        raise InputError(f"bad layer profile id {ref!r}; write layers:ID (see `autotune profile list`)", field="id")
    return lid


def _layer_doc(row: LayerProfileRow) -> dict[str, Any]:
    return {"kind": LAYER_DOC_KIND, "schema_version": row.schema_version, "units": LAYER_UNITS, "id": row.id,
            "label": row.label, "created_at": row.created_at, "device_kind": row.device_kind,
            "device_name": row.device_name, "model": row.model, "dtype": row.dtype, "origin": row.origin,
            "source": row.source, "meta": row.meta, "points": row.points}


def load_layer_profile(ref: str | int, storage: str) -> dict[str, Any]:
    """The export document of layer profile ``layers:ID``."""
    from sqlalchemy import select

    from autotune.specs.profile_tables import LayerProfileRow

    lid = parse_layer_ref(ref)
    with _session(storage) as s:
        row = s.get(LayerProfileRow, lid)
        if row is None:
            known = [str(i) for i in s.scalars(select(LayerProfileRow.id).order_by(LayerProfileRow.id)).all()]
            hint = (f"known: {', '.join('layers:' + k for k in known[-10:])}" if known
                    else "the store has no layer profiles yet; run `autotune profile --layers MODEL`")
            raise InputError(f"no layer profile {lid} in {storage} ({hint})", field="id")
        return _layer_doc(row)


def list_layer_profiles(storage: str) -> list[dict[str, Any]]:
    from sqlalchemy import select

    from autotune.specs.profile_tables import LayerProfileRow

    with _session(storage) as s:
        rows = s.scalars(select(LayerProfileRow).order_by(LayerProfileRow.id)).all()
        return [{k: v for k, v in _layer_doc(r).items() if k not in ("points", "units")} | {"points": len(r.points)}
                for r in rows]
