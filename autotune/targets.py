"""Who will run a plan: autotune's own runtime or a framework, and what each can express.

The one source of each target's rules is its own code: the runtime's ``check_runtime_support`` and
each exporter's ``reasons`` (``autotune/export/<target>.py``). The search asks ``refusals`` to keep to
what ``--target`` can execute, and ``best_per_target`` to tell the user, for every target, the best
plan of a study that the target can express and what it costs against the overall best (the ratio
is what uneven shares and free composition buy).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from autotune.errors import InputError, suggest
from autotune.export import FORMATS, exporter
from autotune.export.common import ExportContext
from autotune.plan import Plan, PlanError
from autotune.study import trial_record

TARGETS = ("runtime", *(f for f in FORMATS if f != "json"))
"""``runtime`` (the default) is autotune's own runtime; the others are the export formats that run
training (``json`` is the plan itself, not a runner)."""


def kernel_costs(target: str | None) -> Any:
    """The per-kernel costs (``cost/kernels.KernelCosts``) of the runtime that will run a plan aimed at
    ``target``: each exporter's ``KERNELS`` (its own module, beside its rules); autotune's runtime for
    ``runtime`` or None."""
    from autotune.cost.kernels import RUNTIME

    if target in (None, "runtime"):
        return RUNTIME
    return exporter(check_target(target)).KERNELS


def check_target(name: str) -> str:
    if name not in TARGETS:
        raise InputError(f"unknown target {name!r}" + suggest(name, TARGETS), field="--target")
    return name


def context(model: Any, cluster: Any, seq_len: int, global_batch: int) -> ExportContext:
    return ExportContext(model=model, cluster=cluster, seq_len=seq_len, global_batch=global_batch)


def refusals(target: str, plan: Plan, ctx: ExportContext) -> list[str]:
    """Why ``target`` cannot run the resolved ``plan`` (empty: it can)."""
    if target == "runtime":
        from autotune.runtime.trial import check_runtime_support

        try:
            check_runtime_support(plan, ctx.model)
        except PlanError as e:
            return [e.message]
        return []
    return list(exporter(target).reasons(plan, ctx))


OPTION_PROBES: dict[str, dict[str, Any]] = {
    "moe_a2a_overlap": {"moe_a2a_overlap": True},
    "moe_dispatcher": {"moe_dispatcher": "flex"},
    "cuda_graph_scope": {"cuda_graph_scope": ("attn",)},
    "grad_reduce": {"grad_reduce": "bf16"},
    "moments": {"moments": "bf16", "zero_stage": 1},
}
"""A plan option and the fields of a plan that sets it (``expresses`` asks the target about that plan)."""


def expresses(target: str, option: str, ctx: ExportContext) -> bool:
    """Whether ``target`` runs plans that set ``option`` (a key of ``OPTION_PROBES``), asked of its own
    rules (``refusals``) rather than copied: every refusal of a plan option starts with the option's
    field name (``export.common.unexpressed``, the runtime's ``check_runtime_support``), so a target
    expresses the option when no refusal of a plan that sets it names it. The search space asks this
    to decide which recipe knobs a study has (``search_spaces/_recipe.py``)."""
    plan = Plan().replace(**OPTION_PROBES[option])
    return not any(r.startswith(option + ":") for r in refusals(target, plan, ctx))


def model_problems(target: str, model: Any) -> str | None:
    """Why ``target`` cannot build ``model`` at all, whatever the plan (the runtime builds every
    architecture the model spec accepts; what is left is a shape it cannot take, e.g. rotary
    embeddings over an odd head_dim). A search aimed at a target that cannot build the model would
    find nothing, so it prices plans for the model as it is and says so instead."""
    if target != "runtime":
        return None
    from autotune.runtime.trial import check_runtime_support

    try:
        check_runtime_support(Plan().replace(micro_batch_size=1), model)
    except PlanError as e:
        return e.message
    return None


def best_per_target(ranked: Iterable[tuple[Any, Plan]], ctx: ExportContext,
                    targets: tuple[str, ...] = TARGETS) -> dict[str, dict[str, Any] | None]:
    """For each target, the first plan of ``ranked`` (best first: ``study.iter_trial_plans``) that it
    accepts: its trial number, predicted tokens/s and ratio to the best plan overall; None when the
    target accepts none of them."""
    out: dict[str, dict[str, Any] | None] = {t: None for t in targets}
    best_tps = None
    for trial, plan in ranked:
        record = trial_record(trial, plan=plan)
        tps = record.tokens_per_s() or trial.value
        if best_tps is None:
            best_tps = tps
        for t in targets:
            if out[t] is None and not refusals(t, plan, ctx):
                out[t] = {"trial": trial.number, "tokens_per_s": tps, "ratio": tps / best_tps if best_tps else None,
                          "plan": record.to_dict()}
        if all(v is not None for v in out.values()):
            break
    return out


def per_target_text(found: dict[str, dict[str, Any] | None]) -> str:
    """``best_per_target`` in one line, as search and the dashboard print it. The ratio is of
    tokens/s whatever ranked the plans: in a study searched for cost a target's best is its cheapest
    plan per token, which may run on fewer devices at a fraction of the best's tokens/s."""
    parts = [f"{t} {v['ratio']:.2f}x (#{v['trial']})" if v else f"{t} none among the best plans"
             for t, v in found.items()]
    return "best plan each target can run, its tokens/s against the best's: " + ", ".join(parts)
