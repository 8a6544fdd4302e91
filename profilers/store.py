"""Writing profiles into the store (``autotune/specs/profiles.py`` holds the tables and reads them):
fitting a run's raw samples (``fits_of``), saving a measured run or a layer profile, importing an
exported document. The readers are importable from here too (their old home).

This module imports no torch: the planning half reads profiles without it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from autotune.errors import InputError, WorkError
from autotune.specs.profiles import (  # noqa: F401  (the readers' old home: ``from profilers.store import ...``)
    _ENGINES,
    DOC_KIND,
    LAYER_DOC_KIND,
    LAYER_REF_PREFIX,
    LAYER_SCHEMA_VERSION,
    PIECES,
    SCHEMA_VERSION,
    STORED_PIECES,
    UNITS,
    LayerProfileRow,
    ProfileFit,
    ProfileRun,
    ProfileSample,
    _doc_error,
    _finite,
    _now,
    device_spec_from_profile,
    engine_for,
    export_profile,
    list_layer_profiles,
    list_profiles,
    load_layer_profile,
    load_profile,
    parse_layer_ref,
    parse_ref,
    profile_url,
)


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
    """Import an autotune export: a kernel profile (returns its id) or, by its ``kind``, a layer
    profile (use ``import_any`` to know which)."""
    return import_any(path, storage)[1]


def import_any(path: str | Path, storage: str) -> tuple[str, int]:
    """(``profile`` or ``layers``, new id) of an autotune export of either kind."""
    doc = read_json_file(path)
    if isinstance(doc, dict) and doc.get("kind") == LAYER_DOC_KIND:
        return "layers", import_layer_doc(doc, storage, source=str(path))
    return "profile", import_profile(doc, storage, source=str(path))


def _check_number(v: Any, where: str, source: str | None, *, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v <= 0):
        raise _doc_error(f"expected a {'positive' if positive else 'non-negative'} number, got {v!r}", source, where)
    return float(v)


def check_layer_doc(doc: Any, source: str | None = None) -> dict[str, Any]:
    """Validate a layer-profile document (measured, exported or converted from a foreign format);
    returns it normalised. Every problem is one InputError naming the field."""
    if not isinstance(doc, dict):
        raise _doc_error("expected a JSON object written by `autotune profile export layers:ID`", source)
    if doc.get("kind") != LAYER_DOC_KIND:
        raise _doc_error(f"not a layer profile (kind is {doc.get('kind')!r}, expected {LAYER_DOC_KIND!r})",
                         source, "kind")
    if doc.get("schema_version") != LAYER_SCHEMA_VERSION:
        raise _doc_error(f"unsupported schema_version {doc.get('schema_version')!r} (this build reads "
                         f"{LAYER_SCHEMA_VERSION})", source, "schema_version")
    for k in ("device_kind", "device_name", "dtype"):
        if not isinstance(doc.get(k), str) or not doc[k]:
            raise _doc_error("missing or not a string", source, k)
    model = doc.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("name"), str):
        raise _doc_error("missing or not an object with a name", source, "model")
    points = doc.get("points")
    if not isinstance(points, list) or not points:
        raise _doc_error("missing or empty list", source, "points")
    out = []
    for i, pt in enumerate(points):
        where = f"points[{i}]"
        if not isinstance(pt, dict):
            raise _doc_error("expected an object", source, where)
        if pt.get("piece") not in STORED_PIECES:
            raise _doc_error(f"piece must be one of {', '.join(STORED_PIECES)}, got {pt.get('piece')!r}", source,
                             f"{where}.piece")
        for k in ("tp", "micro_batch", "seq", "ep"):
            v = pt.get(k, 1)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise _doc_error(f"expected a positive integer, got {v!r}", source, f"{where}.{k}")
        q = dict(pt)
        q["fwd_s"] = _check_number(pt.get("fwd_s"), f"{where}.fwd_s", source)
        q["bwd_s"] = _check_number(pt.get("bwd_s"), f"{where}.bwd_s", source)
        if pt.get("activation_bytes") is not None:
            q["activation_bytes"] = _check_number(pt["activation_bytes"], f"{where}.activation_bytes", source)
        out.append(q)
    return {**doc, "points": out}


def save_layer_profile(doc: dict[str, Any], storage: str, *, label: str | None = None,
                       source: str | None = None) -> int:
    """Store a layer-profile document (validated first) in one transaction; returns its id."""
    doc = check_layer_doc(doc, source)
    row = LayerProfileRow(label=label if label is not None else doc.get("label"),
                          created_at=doc.get("created_at") or _now(), device_kind=doc["device_kind"],
                          device_name=doc["device_name"], model_name=doc["model"]["name"],
                          model=_finite(doc["model"]), dtype=doc["dtype"], origin=doc.get("origin") or "measured",
                          source=str(doc.get("source") or "")[:500], meta=_finite(doc.get("meta") or {}),
                          points=_finite(doc["points"]), schema_version=doc["schema_version"])
    eng = engine_for(storage)
    try:
        with Session(eng) as s, s.begin():
            s.add(row)
            s.flush()
            return int(row.id)
    except SQLAlchemyError as e:
        raise WorkError(f"could not store the layer profile in {storage}: {str(e).splitlines()[0]}") from None


def import_layer_doc(doc: Any, storage: str, source: str | None = None) -> int:
    """Store an exported layer profile as a new one (``origin`` imported unless it names a format)."""
    doc = check_layer_doc(doc, source)
    origin = doc.get("origin") if doc.get("origin") not in (None, "measured") else "imported"
    meta = dict(doc.get("meta") or {}, imported_from={"id": doc.get("id"), "file": source})
    return save_layer_profile({**doc, "origin": origin, "meta": meta}, storage, source=source)


def read_json_file(path: str | Path) -> Any:
    """A JSON file's content; a missing or unreadable file is one InputError naming it."""
    p = Path(path)
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError("no such file", source=str(p)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"not a readable JSON file ({e})", source=str(p)) from None
