"""The profile store: SQLAlchemy 2 tables in the storage URL (default ``sqlite:///results/autotune.db``).

Tables (prefixed so they sit beside Optuna's in the same file):

- ``autotune_profile_runs``: one row per profile: label, device kind and name, ranks, hosts,
  hardware fingerprint, software versions, emulated slowdowns, timings, where it came from
  (``measured`` here or ``imported`` from a file).
- ``autotune_profile_samples``: every measured point (rank, kind, parameters, median, spread,
  unstable flag, raw repeat times, derived metrics).
- ``autotune_profile_fits``: the fits per rank (compute) and for the whole run (links), in the
  shape docs/contracts.md "Profiles" documents.

A profile is written in a single transaction after all ranks have finished (``save_profile``), so
a failed run leaves the database as it was; imports likewise. Export/import use a JSON document
with ``schema_version`` and ``units``. ``device_spec_from_profile`` turns a stored profile into a
``DeviceSpec`` (provenance ``measured``) for cluster files that say ``device: profile:ID``.

This module imports no torch: the planning half reads profiles without it.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Integer, String, create_engine, select
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship

from autotune.errors import InputError, WorkError

SCHEMA_VERSION = 1
DOC_KIND = "autotune-profile"
UNITS = {
    "time": "s (fields ending _s)",
    "size": "bytes (fields named bytes or ending _bytes)",
    "bandwidth": "bytes/s (fields ending _bytes_per_s; p2p_bandwidth matrix too)",
    "latency": "s (p2p_latency matrix)",
    "flops": "FLOP per call (work of gemm/attention samples, flops)",
    "throughput": "FLOP/s (fields ending flops_per_s; second element of gemm points)",
}


class Base(DeclarativeBase):
    pass


class ProfileRun(Base):
    __tablename__ = "autotune_profile_runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    label: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[str] = mapped_column(String(40))
    device_kind: Mapped[str] = mapped_column(String(20))
    device_name: Mapped[str] = mapped_column(String(200))
    nproc: Mapped[int] = mapped_column(Integer)
    quick: Mapped[bool] = mapped_column(Boolean, default=False)
    hosts: Mapped[list] = mapped_column(JSON)
    fingerprint: Mapped[dict] = mapped_column(JSON)
    versions: Mapped[dict] = mapped_column(JSON)
    emulated: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    """{rank: factor} when some rank emulated a slower device, else null."""
    measure_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    wall_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    unstable: Mapped[int] = mapped_column(Integer, default=0)
    origin: Mapped[str] = mapped_column(String(20), default="measured")
    """``measured`` (here) or ``imported``."""
    imported_from: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    schema_version: Mapped[int] = mapped_column(Integer, default=SCHEMA_VERSION)
    samples: Mapped[list[ProfileSample]] = relationship(back_populates="run", cascade="all, delete-orphan")
    fits: Mapped[list[ProfileFit]] = relationship(back_populates="run", cascade="all, delete-orphan")


class ProfileSample(Base):
    __tablename__ = "autotune_profile_samples"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("autotune_profile_runs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(40))
    params: Mapped[dict] = mapped_column(JSON)
    work: Mapped[float] = mapped_column(Float)
    median_s: Mapped[float] = mapped_column(Float)
    spread: Mapped[float] = mapped_column(Float)
    unstable: Mapped[bool] = mapped_column(Boolean)
    timing: Mapped[dict] = mapped_column(JSON)
    metrics: Mapped[dict] = mapped_column(JSON)
    run: Mapped[ProfileRun] = relationship(back_populates="samples")


class ProfileFit(Base):
    __tablename__ = "autotune_profile_fits"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("autotune_profile_runs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """The rank for ``compute`` fits; null for ``links`` (a property of the whole run)."""
    kind: Mapped[str] = mapped_column(String(20))
    data: Mapped[dict] = mapped_column(JSON)
    run: Mapped[ProfileRun] = relationship(back_populates="fits")


_ENGINES: dict[str, Any] = {}


def engine_for(storage: str):
    """An engine for ``storage`` with the tables created; bad URLs are input errors on --storage."""
    if storage in _ENGINES:
        return _ENGINES[storage]
    if "://" not in storage:
        raise InputError(f"profiles need an SQLAlchemy URL such as sqlite:///results/autotune.db, got {storage!r}",
                         field="--storage")
    if storage.startswith("sqlite:///") and not storage.startswith("sqlite:///:memory:"):
        path = Path(storage[len("sqlite:///"):])
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        eng = create_engine(storage)
        Base.metadata.create_all(eng)
    except (ArgumentError, SQLAlchemyError, ImportError, ValueError) as e:
        raise InputError(f"cannot open storage {storage!r}: {str(e).splitlines()[0]}", field="--storage") from None
    _ENGINES[storage] = eng
    return eng


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


def fits_of(result: dict[str, Any]) -> tuple[dict[int, dict], dict]:
    """Compute fits per rank and the links fit of a worker result (profilers.worker)."""
    from profilers.compute import fit_compute
    from profilers.links import fit_links

    per_rank = {}
    for r in result["ranks"]:
        f = fit_compute(r["compute"], r.get("unsupported"))
        f["rank"] = r["rank"]
        f["device_name"] = r["device_name"]
        f["emulated_slowdown"] = r["emulated_slowdown"]
        # Where the rank's threads ran is part of what was measured (profilers.placement).
        f["placement"] = r.get("placement") or {"threads": r.get("threads"), "pinned_cores": r.get("pinned_cores"),
                                                "comm_threads": r.get("comm_threads")}
        per_rank[r["rank"]] = f
    link_samples = [dict(s, rank=r["rank"]) for r in result["ranks"] for s in r["links"]]
    return per_rank, fit_links(link_samples, result["hosts"])


def _sample_rows(result: dict[str, Any]) -> list[ProfileSample]:
    rows = []
    for r in result["ranks"]:
        for s in r["compute"] + r["links"]:
            t = s["timing"]
            rows.append(ProfileSample(rank=r["rank"], kind=s["kind"], params=_finite(s["params"]),
                                      work=float(s["work"]), median_s=t["median_s"], spread=t["spread"],
                                      unstable=bool(t["unstable"]), timing=_finite(t),
                                      metrics=_finite(s["metrics"])))
    return rows


def save_profile(result: dict[str, Any], storage: str, *, label: str | None = None, nproc: int | None = None,
                 wall_s: float | None = None, origin: str = "measured",
                 imported_from: dict | None = None) -> int:
    """Store a whole worker result (samples and fits) in one transaction; returns the new id."""
    per_rank, links = fits_of(result)
    samples = _sample_rows(result)
    run = ProfileRun(label=label, created_at=result.get("created_at") or _now(), device_kind=result["device"],
                     device_name=result["ranks"][0]["device_name"], nproc=nproc or result["world"],
                     quick=bool(result.get("quick")), hosts=result["hosts"],
                     fingerprint=_finite(result.get("fingerprint") or {}), versions=_finite(result.get("versions") or {}),
                     emulated=result.get("emulated") or None, measure_s=result.get("measure_s"), wall_s=wall_s,
                     unstable=sum(1 for s in samples if s.unstable), origin=origin, imported_from=imported_from,
                     schema_version=SCHEMA_VERSION)
    run.samples = samples
    run.fits = ([ProfileFit(rank=r, kind="compute", data=_finite(f)) for r, f in sorted(per_rank.items())]
                + [ProfileFit(rank=None, kind="links", data=_finite(links))])
    eng = engine_for(storage)
    try:
        with Session(eng) as s, s.begin():
            s.add(run)
            s.flush()
            return int(run.id)
    except SQLAlchemyError as e:
        raise WorkError(f"could not store the profile in {storage}: {str(e).splitlines()[0]}") from None


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
    with Session(engine_for(storage)) as s:
        return [_run_dict(r) for r in s.scalars(select(ProfileRun).order_by(ProfileRun.id)).all()]


def load_profile(ref: str | int, storage: str) -> dict[str, Any]:
    """The export document of a profile: run, samples, fits, units, schema_version."""
    pid, _ = parse_ref(ref)
    with Session(engine_for(storage)) as s:
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


def import_profile(doc: Any, storage: str, source: str | None = None) -> int:
    """Store an exported document as a new profile (new id; ``imported_from`` keeps the old one)."""
    if not isinstance(doc, dict):
        raise _doc_error("expected a JSON object exported by `autotune profile export`", source)
    if doc.get("kind") != DOC_KIND:
        raise _doc_error(f"not an autotune profile (kind is {doc.get('kind')!r}, expected {DOC_KIND!r})",
                         source, "kind")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise _doc_error(f"unsupported schema_version {doc.get('schema_version')!r} (this build reads "
                         f"{SCHEMA_VERSION})", source, "schema_version")
    run, samples = doc.get("run"), doc.get("samples")
    if not isinstance(run, dict):
        raise _doc_error("missing or not an object", source, "run")
    if not isinstance(samples, list):
        raise _doc_error("missing or not a list", source, "samples")
    need = {"device_kind": str, "device_name": str, "nproc": int, "hosts": list}
    for k, typ in need.items():
        if not isinstance(run.get(k), typ):
            raise _doc_error(f"missing or not a {typ.__name__}", source, f"run.{k}")
    nproc = run["nproc"]
    if nproc < 1 or len(run["hosts"]) != nproc:
        raise _doc_error(f"hosts has {len(run['hosts'])} entries for nproc {nproc}", source, "run.hosts")
    old_fits = ((doc.get("fits") or {}).get("compute") or {}) if isinstance(doc.get("fits"), dict) else {}
    ranks: dict[int, dict] = {r: {"rank": r, "device_name": run["device_name"], "compute": [], "links": [],
                                  "emulated_slowdown": (run.get("emulated") or {}).get(str(r)),
                                  # fits are recomputed from the samples; why a dtype was not measured
                                  # is not in any sample, so it comes from the exported fits
                                  "unsupported": _unsupported_of(old_fits.get(str(r))),
                                  "placement": (old_fits.get(str(r)) or {}).get("placement")
                                  if isinstance(old_fits.get(str(r)), dict) else None}
                              for r in range(nproc)}
    for i, smp in enumerate(samples):
        where = f"samples[{i}]"
        if not isinstance(smp, dict):
            raise _doc_error("expected an object", source, where)
        for k in ("rank", "kind", "params", "work", "timing", "metrics"):
            if k not in smp:
                raise _doc_error("missing field", source, f"{where}.{k}")
        if not isinstance(smp["rank"], int) or smp["rank"] not in ranks:
            raise _doc_error(f"rank {smp['rank']!r} outside 0..{nproc - 1}", source, f"{where}.rank")
        t = smp["timing"]
        if not isinstance(t, dict) or not all(isinstance(t.get(k), (int, float)) for k in ("median_s", "spread")):
            raise _doc_error("timing needs numeric median_s and spread", source, f"{where}.timing")
        t.setdefault("unstable", False)
        if not isinstance(smp["work"], (int, float)) or not isinstance(smp["params"], dict):
            raise _doc_error("work must be a number and params an object", source, where)
        entry = {k: smp[k] for k in ("kind", "params", "work", "timing", "metrics")}
        bucket = "links" if smp["kind"] in ("p2p", "collective") else "compute"
        ranks[smp["rank"]][bucket].append(entry)
    result = {"device": run["device_kind"], "world": nproc, "quick": bool(run.get("quick")), "hosts": run["hosts"],
              "ranks": [ranks[r] for r in range(nproc)], "fingerprint": run.get("fingerprint") or {},
              "versions": run.get("versions") or {}, "emulated": run.get("emulated"),
              "measure_s": run.get("measure_s"), "created_at": run.get("created_at")}
    try:
        return save_profile(result, storage, label=run.get("label"), nproc=nproc, wall_s=run.get("wall_s"),
                            origin="imported", imported_from={"id": run.get("id"), "file": source,
                                                              "origin": run.get("origin")})
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise _doc_error(f"samples do not fit together ({type(e).__name__}: {e})", source, "samples") from None


def _unsupported_of(fit: Any) -> dict[str, str]:
    u = fit.get("gemm_unsupported") if isinstance(fit, dict) else None
    return {str(k): str(v) for k, v in u.items()} if isinstance(u, dict) else {}


def import_file(path: str | Path, storage: str) -> int:
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError("no such file", source=str(p)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"not a readable JSON file ({e})", source=str(p)) from None
    return import_profile(doc, storage, source=str(p))


def device_spec_from_profile(ref: str | int, storage: str | None = None):
    """``profile:ID`` (or ``ID:RANK``) -> a measured ``DeviceSpec``.

    Rank 0's device unless a rank is given (with ``--emulate-slowdown`` ranks differ). Figures:
    ``peak_flops[dtype]`` = fitted large-GEMM rate (so ``achievable_fraction`` is 1.0: the peak is
    already what is achieved), memory = capacity per rank on its host, memory bandwidth = copy
    bandwidth, intra-node bandwidth/latency = the ``intra`` alpha-beta fit of the p2p pairs. The
    fits themselves go into ``DeviceSpec.profile`` (docs/contracts.md "Profiles").
    """
    from autotune.commands.common import DEFAULT_STORAGE
    from autotune.specs.catalogue import GB, DeviceSpec, local_cpu

    storage = storage or DEFAULT_STORAGE
    pid, rank = parse_ref(ref)
    with Session(engine_for(storage)) as s:
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
               # the rank's measured per-call costs (profilers.overheads); the cost model falls back
               # to its defaults for any key absent here
               "overheads": fit.get("overheads") or {}}
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
