"""``Schedule``: what one pipeline schedule says about itself, once, for everyone who reads it.

A schedule is one class with a handful of methods (in the spirit of Optuna's samplers). Everything
else asks it instead of comparing names:

* plan validation (``autotune/plan.py``): ``check_shape`` (pipeline size, virtual stages),
  ``check_microbatches`` (counts per replica: ``min_microbatches``, ``microbatch_multiple``) and
  ``check_plan`` (anything else, on the resolved plan); ``for_plan`` configures a schedule with plan
  fields of its own (HelixPipe's folds);
* the search space (``search_spaces/default.py``): ``virtual_stage_choices`` and the two counts;
* placement: ``stage_rank`` (which pipeline rank holds model chunk ``j``; the chunks are numbered
  in model order, ``0 .. pp * virtual_stages - 1``) and ``stages_of_rank`` (derived from it);
* the order of operations per rank: ``op_order`` gives ``Op(kind, stage, microbatch)`` with the
  kinds of ``torch.distributed.pipelining`` (F forward, B full backward, I input-gradient backward,
  W weight-gradient backward); the data flow between them is the chain of model chunks (F of chunk
  j after F of j - 1, the gradient of j after that of j + 1, W after I), sent between the ranks
  ``stage_rank`` names, so the sends and receives are implied by the order and the placement;
* memory: ``in_flight`` (micro-batches whose activations a rank holds at once), derived from the
  order: a micro-batch is held from its F until the backward that frees it (B, or W when the
  backward is split: the weight gradient still needs the stored inputs of each linear);
* the cost model's simulation (``autotune/cost/pipeline.py``) runs ``op_order`` over the chain;
  a schedule whose data flow is not a chain (``chain = False``: HelixPipe) is priced by a cost
  module of its own (``autotune/cost/helixpipe.py``); the schedule never imports the cost model;
* the runtime (``autotune/runtime/pipeline.py``): ``build_runtime`` returns the object whose
  ``step`` runs one training step over this rank's ``PipelineStage`` objects;
* export: ``targets`` maps an export target to the framework's own name for the schedule;
  ``refusal(target)`` says why another target cannot express it.

A new schedule is one module in ``autotune/schedules/`` with one subclass; the package imports every
module in it, and ``__init_subclass__`` registers each class by its ``name``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any, ClassVar, NamedTuple

F, B, I, W = 0, 1, 2, 3  # noqa: E741 - torch.distributed.pipelining's letters
"""Operation kinds: forward, full backward, input-gradient backward, weight-gradient backward."""
KIND_LETTERS = ("F", "B", "I", "W")
EXPORT_TARGETS = ("megatron", "torchtitan", "deepspeed", "accelerate")

_REGISTRY: dict[str, type[Schedule]] = {}


class Op(NamedTuple):
    """One operation of one rank: ``kind`` (F, B, I, W) of model chunk ``stage`` on ``microbatch``."""

    kind: int
    stage: int
    microbatch: int


def ops_of(kinds: Iterable[int], stages: Iterable[int], microbatches: Iterable[int]) -> list[Op]:
    """``[Op(k, s, i) for k, s, i in zip(...)]`` built without a Python call per operation (what
    ``Op(...)`` costs: a search builds orders of up to a thousand micro-batches per pipeline shape)."""
    return list(map(tuple.__new__, repeat(Op), zip(kinds, stages, microbatches, strict=True)))


class Schedule:
    """Base class of every pipeline schedule; subclasses set the class attributes and ``op_order``."""

    name: ClassVar[str] = ""
    """The plan's ``schedule`` value (the registry key)."""
    summary: ClassVar[str] = ""
    """One line for help texts and the docs: what it is and where it comes from."""
    chain: ClassVar[bool] = True
    """Whether its data flow is the chain of model chunks ``stage_rank`` places (the default
    simulation and ``in_flight`` read ``op_order`` as such); HelixPipe's is not."""
    fold_choices: ClassVar[tuple[int, ...]] = (1,)
    """Fold counts it runs (``Plan.helix_folds``): micro-batches run in groups of pp * F, each
    operation back to back for the F folds (HelixPipe: 1 or 2); 1 for the others."""
    places_attention: ClassVar[bool] = False
    """Whether it runs each attention apart from its layer and takes ``Plan.helix_attention``
    (attentions per pipeline rank; HelixPipe)."""
    splits_backward: ClassVar[bool] = False
    """Whether backward runs as I then W (zero-bubble) rather than one B."""
    torch_class: ClassVar[str | None] = None
    """Class name in ``torch.distributed.pipelining`` the runtime runs (None: ``build_runtime`` is
    overridden)."""
    multi_stage: ClassVar[bool] = False
    """Whether the torch class takes the list of this rank's stages (PipelineScheduleMulti) rather
    than the one stage."""
    targets: ClassVar[dict[str, str]] = {}
    """Export target -> the framework's name (or switch) for this schedule; a target not here refuses."""
    refusals: ClassVar[dict[str, str]] = {}
    """Export target -> why it cannot run this schedule (the default reason is generic)."""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.name:
            if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
                raise ValueError(f"two schedules are named {cls.name!r}: {_REGISTRY[cls.name]} and {cls}")
            _REGISTRY[cls.name] = cls

    # ---- options ------------------------------------------------------------------------------
    def for_plan(self, plan: Any) -> Schedule:
        """This schedule as ``plan`` configures it. A schedule that reads plan fields of its own
        (HelixPipe's ``helix_folds``) returns an instance carrying them; the default has none."""
        return self

    def options(self) -> tuple[Any, ...]:
        """What distinguishes two configured instances (part of every cache key)."""
        return ()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.options() == self.options()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.options()))

    # ---- shape and validation -----------------------------------------------------------------
    def virtual_stage_choices(self, pp: int) -> tuple[int, ...]:
        """Model chunks per pipeline rank the schedule runs (the search samples among them)."""
        return (1,)

    def check_shape(self, pp: int, virtual_stages: int) -> list[str]:
        """Problems with the pipeline size and virtual stages, each ``field: reason``."""
        choices = self.virtual_stage_choices(pp)
        if virtual_stages not in choices and len(choices) == 1:
            n = choices[0]
            return [f"virtual_stages: {self.name} runs {'one stage' if n == 1 else f'{n} stages'} per rank, "
                    f"got virtual_stages({virtual_stages})"]
        return []

    def min_microbatches(self, pp: int, virtual_stages: int) -> int:
        """Fewest micro-batches per replica per step."""
        return 1

    def microbatch_multiple(self, pp: int, virtual_stages: int) -> int:
        """Micro-batches per replica must be a multiple of this."""
        return 1

    def check_microbatches(self, pp: int, virtual_stages: int, counts: Sequence[int]) -> list[str]:
        """Problems with the micro-batch count of each DP replica."""
        out = []
        least = self.min_microbatches(pp, virtual_stages)
        if pp > 1 and min(counts) < least:
            out.append(f"num_microbatches: {self.name} needs at least {_times_pp(least, pp)} micro-batches per "
                       f"replica, a replica has {min(counts)}")
        k = self.microbatch_multiple(pp, virtual_stages)
        if pp > 1 and k > 1 and any(c % k for c in counts):
            out.append(f"num_microbatches: {self.name} needs micro-batches per replica divisible by "
                       f"{_times_pp(k, pp)}, got {list(counts)}")
        return out

    def check_plan(self, plan: Any, model: Any) -> list[str]:
        """Rules of the schedule's own beyond shape and micro-batch counts, on the resolved plan
        (what its runtime does not compose with, model divisibility, ...); none by default."""
        return []

    # ---- placement ----------------------------------------------------------------------------
    def stage_rank(self, stage: int, pp: int, virtual_stages: int) -> int:
        """Pipeline rank holding model chunk ``stage`` (looped placement: ``stage % pp``)."""
        return stage % pp

    def stages_of_rank(self, rank: int, pp: int, virtual_stages: int) -> tuple[int, ...]:
        """Model chunks on pipeline rank ``rank``, in model order (the runtime's local order)."""
        return tuple(j for j in range(pp * virtual_stages) if self.stage_rank(j, pp, virtual_stages) == rank)

    # ---- order and memory ---------------------------------------------------------------------
    def op_order(self, pp: int, virtual_stages: int, m: int, rank: int) -> tuple[Op, ...]:
        """Operations of pipeline rank ``rank`` in the order it runs them, ``m`` micro-batches."""
        raise NotImplementedError

    def in_flight(self, pp: int, virtual_stages: int, m: int, rank: int,
                  layers: tuple[int, ...]) -> tuple[int, int]:
        """(most layer-micro-batches whose activations ``rank`` holds at once, most micro-batches of
        the last model chunk in flight there: its logits), from ``op_order``. ``layers[c]``: layers of
        the c-th chunk of ``stages_of_rank(rank)``."""
        local = {j: c for c, j in enumerate(self.stages_of_rank(rank, pp, virtual_stages))}
        last = pp * virtual_stages - 1
        frees = W if self.splits_backward else B
        held = peak = held_last = peak_last = 0
        for op in self.op_order(pp, virtual_stages, m, rank):
            if op.kind == F:
                held += layers[local[op.stage]]
                peak = max(peak, held)
                if op.stage == last:
                    held_last += 1
                    peak_last = max(peak_last, held_last)
            elif op.kind == frees:
                held -= layers[local[op.stage]]
                if op.stage == last:
                    held_last -= 1
        return peak, peak_last

    # ---- runtime ------------------------------------------------------------------------------
    def build_runtime(self, stages: list[Any], n_microbatches: int, loss_fn: Callable[..., Any]) -> Any:
        """The schedule object over this rank's ``PipelineStage`` objects (in ``stages_of_rank``
        order); its ``step(*inputs, target=, losses=)`` runs one step. Losses are summed, not
        averaged (``scale_grads=False``): the runtime's loss is already divided by the global count."""
        import torch.distributed.pipelining as tp

        cls = getattr(tp, self.torch_class)
        arg = stages if self.multi_stage else stages[0]
        return cls(arg, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)

    # ---- export -------------------------------------------------------------------------------
    def refusal(self, target: str) -> str | None:
        """None when ``target`` can express this schedule, else why not."""
        if target in self.targets:
            return None
        return self.refusals.get(target, f"{target} has no {self.name} schedule")

    def __repr__(self) -> str:
        opts = self.options()
        return f"<schedule {self.name}{' ' + repr(opts) if opts else ''}>"


def _times_pp(n: int, pp: int) -> str:
    """``pp(4)`` / ``2*pp(4)`` when ``n`` is a multiple of pp, else the number: messages name the rule."""
    if n % pp == 0:
        k = n // pp
        return f"pp({pp})" if k == 1 else f"{k}*pp({pp})"
    return str(n)


def registry() -> dict[str, type[Schedule]]:
    return _REGISTRY
