"""Where ``apply`` gets its plan: the best trial of a study, or a plan file (with what it is for).

Study (docs/contracts.md, "Study"): the study's ``best_measured_trial`` when ``validate`` set one,
else the completed feasible trial with the highest value (predicted tokens/s). Feasible: every
constraint <= 0 and no ``infeasible_reason``. The model, sequence length, batch and cluster come
from the study's user attributes. ``autotune.study.open_study`` is used when it exists; otherwise
the study is opened with Optuna directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.errors import InputError
from autotune.export.common import ExportContext
from autotune.plan import Plan
from autotune.plan_record import PlanRecord, load_record
from autotune.specs.cluster import cluster_from_record, load_cluster
from autotune.specs.model import load_model, model_from_dict
from autotune.study import best_feasible, trial_record
from autotune.study import open_study as _open_study


def _check_storage(storage: str) -> None:
    """Optuna creates an empty SQLite file for a path that does not exist; refuse that instead."""
    if storage.startswith("sqlite:///"):
        path = storage[len("sqlite:///"):]
        if path and path != ":memory:" and not Path(path).exists():
            raise InputError(f"no such database file {path!r}; run `autotune search` first or pass --storage",
                             field="--storage")


def open_study(name: str, storage: str) -> Any:
    _check_storage(storage)
    return _open_study(name, storage)


def best_trial(study: Any) -> Any:
    """``best_measured_trial`` when set, else the feasible trial the study's own rule puts first
    (``study.best_feasible``: the tie-break search and dashboard use)."""
    import optuna

    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    measured = study.user_attrs.get("best_measured_trial")
    if measured is not None:
        t = by_number.get(int(measured))
        if t is not None and "plan" in t.user_attrs:
            return t
    done = [t for t in by_number.values() if t.state == optuna.trial.TrialState.COMPLETE]
    if not done:
        raise InputError(f"study {study.study_name!r} has no completed trial; run `autotune search` on it first",
                         field="--study")
    best = best_feasible(study)
    if best is None:
        raise InputError(f"study {study.study_name!r} has {len(done)} completed trials but none is feasible",
                         field="--study")
    return best


def _numbered(study: Any, number: int) -> Any:
    t = next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)
    if t is None or "plan" not in t.user_attrs:
        raise InputError(f"study {study.study_name!r} has no trial {number} with a plan", field="--trial")
    return t


def _cluster_from_record(name: str, spec: dict[str, Any] | None, digest: str, storage: str) -> Any:
    try:
        return cluster_from_record(name, spec, storage, digest)
    except InputError as e:
        raise InputError(f"cannot rebuild the study's cluster ({e.message}); pass its file with --cluster",
                         field="--cluster") from None


def from_study(name: str, storage: str, cluster_opt: str | None,
               trial: int | None = None) -> tuple[PlanRecord, ExportContext]:
    """The study's best trial, or trial ``trial`` (``--trial N``: e.g. a point of a pool search's front)."""
    study = open_study(name, storage)
    ua = study.user_attrs
    t = best_trial(study) if trial is None else _numbered(study, trial)
    record = trial_record(t, source=f"study {name} trial {t.number}")
    plan = record.plan
    if ua.get("model_spec"):
        model = model_from_dict(dict(ua["model_spec"]), source=f"study {name}")
    elif ua.get("model"):
        model = load_model(ua["model"])
    else:
        raise InputError(f"study {name!r} does not record its model (user attr model/model_spec)", field="--study")
    for key in ("seq_len", "global_batch"):
        if not isinstance(ua.get(key), int):
            raise InputError(f"study {name!r} does not record {key}", field="--study")
    digest = str(ua.get("cluster_digest") or "")
    if cluster_opt:
        cluster = load_cluster(cluster_opt, storage=storage)
    else:
        cluster = _cluster_from_record(str(ua.get("cluster") or ""), ua.get("cluster_spec"), digest, storage)
    from autotune.validate import calibration_for  # only where it was measured (precision, runtime)

    ctx = ExportContext(model=model, cluster=cluster, seq_len=ua["seq_len"], global_batch=ua["global_batch"],
                        study=name, trial=t.number, storage=storage, source=f"study {name}",
                        calibration=calibration_for(ua, plan), cluster_digest=digest or cluster.digest,
                        left_out=tuple(ua.get("left_out") or ()) if ua.get("left_out_trial") == t.number else (),
                        study_plans=_target_plans(study))
    return record, ctx


def _target_plans(study: Any) -> tuple[Plan, ...]:
    """The plan of each trial the study names as a target's best (``best_per_target``, set by the
    search), best first, each once."""
    found = study.user_attrs.get("best_per_target") or {}
    picks = sorted((v for v in found.values() if v), key=lambda v: -(v.get("tokens_per_s") or 0.0))
    numbers = list(dict.fromkeys(int(v["trial"]) for v in picks))
    if not numbers:
        return ()
    by_number = {t.number: t for t in study.get_trials(deepcopy=False) if t.number in numbers}
    return tuple(Plan.from_dict(by_number[k].user_attrs["plan"]) for k in numbers
                 if "plan" in getattr(by_number.get(k), "user_attrs", {}))


def from_plan_file(path: str, model_opt: str | None, seq_len: int | None, global_batch: int | None,
                   cluster_opt: str | None, storage: str) -> tuple[PlanRecord, ExportContext]:
    """A plan file (with its record: provenance, predicted, measured); --model/--seq-len/--global-batch
    say what it is for unless it records them (and must agree with what it records)."""
    record = load_record(path)
    plan = record.plan
    w = plan.workload
    model_name = model_opt or (w.model if w else None)
    if model_name is None:
        raise InputError("the plan does not record its model; pass --model", field="--model")
    model = load_model(model_name)
    if w is not None and w.model and w.model != model.name:
        raise InputError(f"the plan is for model {w.model!r}, not {model.name!r}", source=path, field="workload.model")
    prov = record.provenance or {}
    prov_model = prov.get("model")
    if prov_model and prov_model != model.name:
        raise InputError(f"the plan is for model {prov_model!r}, not {model.name!r}", source=path,
                         field="provenance.model")
    vals: dict[str, int] = {}
    for key, opt in (("seq_len", seq_len), ("global_batch", global_batch)):
        recorded = getattr(w, key) if w is not None else None
        if opt is not None and recorded is not None and opt != recorded:
            raise InputError(f"the plan records {key} {recorded}, not {opt}", source=path, field=f"workload.{key}")
        v = opt if opt is not None else recorded
        if v is None:
            raise InputError(f"the plan does not record {key}; pass --{key.replace('_', '-')}",
                             field=f"--{key.replace('_', '-')}")
        vals[key] = v
    assumed = False
    if cluster_opt:
        cluster = load_cluster(cluster_opt, storage=storage)
    elif w is not None and w.cluster and not w.cluster.startswith("local"):
        if Path(w.cluster).exists():
            cluster = load_cluster(w.cluster, storage=storage)
        else:
            raise InputError(f"the plan was made for cluster {w.cluster!r}; pass its file with --cluster",
                             field="--cluster")
    elif w is not None and w.cluster.startswith("local:"):
        cluster = load_cluster(w.cluster)
    else:  # a hand-written plan, or one made for `local`: this machine's workers, one per rank
        cluster, assumed = load_cluster(f"local:{plan.world}"), not (w is not None and w.cluster)
    ctx = ExportContext(model=model, cluster=cluster, seq_len=vals["seq_len"], global_batch=vals["global_batch"],
                        source=str(path), cluster_digest=cluster.digest, cluster_assumed=assumed,
                        study=prov.get("study"), trial=prov.get("trial"), storage=storage)
    return record, ctx
