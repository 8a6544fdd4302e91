"""Options shared by several commands (declared once as ``Annotated`` aliases) and output helpers.

``--json`` commands print exactly one JSON object on stdout through ``emit_json``; everything for
people (tables, progress) goes through ``console`` / ``err_console``.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Annotated, Any

import typer

from autotune.consoles import console, err_console  # noqa: F401  (every command prints through them)
from autotune.defaults import DEFAULT_STORAGE  # noqa: F401  (the commands' --storage default)
from autotune.runtime.emulation import parse_emulation  # noqa: F401  (--emulate-slowdown's parser)

WideOpt = Annotated[bool, typer.Option("--wide", help="Show every table column, however wide the table gets.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else there.")]
StorageOpt = Annotated[str, typer.Option("--storage", help="SQLAlchemy/Optuna storage URL (PostgreSQL for many "
                                                          "workers, or a journal file path ending in .log).")]
ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Model preset name (see `autotune models`) or a "
                                                            "YAML/JSON model file.")]
ClusterOpt = Annotated[str, typer.Option("--cluster", "-c", help="Cluster file (YAML/JSON), `local` (this machine) "
                                                                "or `local:N` (N local workers).")]
SeqLenOpt = Annotated[int, typer.Option("--seq-len", "-s", help="Sequence length in tokens.", min=1)]
GlobalBatchOpt = Annotated[int, typer.Option("--global-batch", "-b", help="Global batch in sequences.", min=1)]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed.")]
PlanOpt = Annotated[str, typer.Option("--plan", "-p", help="Plan JSON file, or inline degrees such as "
                                                          "`dp=2,pp=2,tp=2` (with optional mbs=, schedule=, ..., and uneven "
                                                          "shares such as layers=13/19); keys in docs/files.md.")]
DtypeOpt = Annotated[str, typer.Option(
    "--dtype", help="Training precision: auto (bf16 where every device of the cluster has it, else fp16; "
                    "a plan that states its precision keeps it), bf16, fp16, fp32 (TF32 where there is) or "
                    "fp32-strict. bf16/fp16 are mixed "
                    "precision: fp32 master weights and AdamW states, gradients reduced in fp32, dynamic "
                    "loss scaling for fp16. fp8 (delayed scaling), fp8-current, fp8-blockwise and fp8-mx (MXFP8, "
                    "Blackwell) run the linear layers' GEMMs in FP8 and the rest in bf16: priced and exported, "
                    "never chosen by auto, not run by autotune's own runtime.")]
DataOpt = Annotated[str | None, typer.Option(
    "--data", help="Token file to train on: a flat uint16/uint32 array (nanoGPT's train.bin) or a Megatron "
                   "indexed dataset (PREFIX.bin + PREFIX.idx). Default: a learnable synthetic stream.")]
DataDtypeOpt = Annotated[str, typer.Option(
    "--data-dtype", help="Token dtype of a flat --data file: auto (uint16 for vocabularies up to 65,536, "
                         "else uint32), uint16 or uint32.")]
EodOpt = Annotated[int | None, typer.Option(
    "--eod", help="With --data (a flat token file): the end-of-document token id; the file's documents, "
                  "packed in data order into --seq-len windows, are the workload (attention masked at their "
                  "boundaries unless --no-doc-mask).", min=0)]
LengthsOpt = Annotated[str | None, typer.Option(
    "--lengths", help="A histogram of document lengths (`length,count` a line): the workload is windows packed "
                      "from documents of these lengths (trials draw synthetic tokens for them).")]
DocMaskOpt = Annotated[bool | None, typer.Option(
    "--doc-mask/--no-doc-mask", help="Stop attention at document boundaries (default: on when --eod or "
                                     "--lengths gives documents; off keeps every window one causal sequence).")]
HostsOpt = Annotated[str | None, typer.Option(
    "--hosts", help="Hostfile (DeepSpeed/MPI: `HOSTNAME slots=N` a line, # comments): run across these hosts, "
                    "the first being this one (node-rank 0); the others are started through the remote shell.")]
RemoteShellOpt = Annotated[str | None, typer.Option(
    "--remote-shell", help="With --hosts: how to run a command on another host, called as `SHELL HOST "
                           "COMMAND` (default: $AUTOTUNE_REMOTE_SHELL, else ssh), e.g. 'ssh -p 2222'.")]
NodeRankOpt = Annotated[int | None, typer.Option(
    "--node-rank", help="Across hosts: this host's node-rank K (0 leads and stores; run the same command with "
                        "each K on its host, MASTER_ADDR/MASTER_PORT naming node-rank 0's host).", min=0)]
EmulateOpt = Annotated[list[str] | None, typer.Option(
    "--emulate-slowdown", help="RANK=FACTOR: make that rank behave as a device FACTOR times slower "
                               "(emulated heterogeneity; labelled as emulated everywhere). Repeatable.")]


def _clean(obj: Any) -> Any:
    """JSON has no inf/nan: write them as null so every consumer can parse the output."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(_clean(obj), indent=2, default=str) + "\n")
    sys.stdout.flush()


def documents_line(entry: dict[str, Any], flops: dict[str, Any] | None = None) -> str:
    """The terminal's line on a plan priced over documents (a breakdown's ``documents`` entry, or a
    search's): the distribution, that attention stops at their boundaries, and what MFU counts."""
    from autotune.documents import describe

    line = f"documents: {describe(entry)}; attention masked at their boundaries"
    if entry.get("balance"):
        line += f", windows dealt to replicas by {entry['balance']}"
    keys = entry.get("masked_keys_per_query")
    if flops and keys and flops.get("unmasked_model_per_step"):
        line += (f"; a query attends {keys:,.0f} keys on average ({entry['unmasked_keys_per_query']:,.0f} in whole "
                 f"causal windows), so MFU counts "
                 f"{flops['model_per_step']:.3g} model FLOPs per step, not {flops['unmasked_model_per_step']:.3g}")
    if entry.get("how"):
        line += f"; step: {entry['how']}"
    return line
