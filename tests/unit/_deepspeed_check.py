"""Run DeepSpeed's own config parser over exported configs (a separate process: DeepSpeed picks an
accelerator and patches torch on import, which the other tests should not inherit).

stdin: JSON list of {"config": ds_config, "world": N, "layers": L}; stdout: one JSON list, per config
either {"error": text} or what DeepSpeed read: batch sizes, ZeRO stage, bf16, and the uniform
partition ``deepspeed.runtime.utils.partition_uniform(L, pipeline stages)``.
"""

import json
import sys

from deepspeed import comm as dscomm
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.utils import partition_uniform

dscomm.get_rank = lambda *a, **k: 0  # no process group here: the parser only asks for this rank's number


class DataParallelOnly:
    """The ``mpu`` DeepSpeed asks for the data-parallel size (world / (pp x tp x sp), its rule)."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


def read(item: dict) -> dict:
    cfg, world = item["config"], item["world"]
    pp = cfg.get("pipeline", {}).get("stages", 1)
    tp = cfg.get("tensor_parallel", {}).get("autotp_size", 1)
    sp = cfg.get("sequence_parallel_size", 1)
    try:
        c = DeepSpeedConfig({k: v for k, v in cfg.items() if k != "autotune"}, mpu=DataParallelOnly(world // (pp * tp * sp)))
    except Exception as e:  # noqa: BLE001 - what DeepSpeed says is the result
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
    return {"train_batch_size": c.train_batch_size, "micro": c.train_micro_batch_size_per_gpu,
            "gas": c.gradient_accumulation_steps, "zero": c.zero_optimization_stage,
            "bf16": bool(c.bfloat16_config.enabled), "dp": world // (pp * tp * sp),
            "parts": partition_uniform(item["layers"], pp) if pp > 1 else None}


if __name__ == "__main__":
    print(json.dumps([read(i) for i in json.load(sys.stdin)]))
