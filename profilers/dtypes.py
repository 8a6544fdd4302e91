"""Which dtypes a device computes natively: what the compute profile measures and what local trials
train in. Its own module so that ``profilers.compute`` (the sweeps) and ``profilers.overheads``
(the per-call costs) both ask it without importing each other."""

from __future__ import annotations


def dtype_support(device: str, dtypes: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """(dtypes to measure, {dtype: why not} for the others). A GEMM dtype counts as supported when
    the device has a native kernel for it: on CPU oneDNN's check (bf16 needs AVX-512 or AMX, fp16
    AVX-512-FP16 or AMX-FP16; without them torch runs a slow reference loop that no training would
    use), on CUDA bf16 needs compute capability 8.0. The reason is stored with the profile."""
    import torch

    ok, why = [], {}
    for dt in dtypes:
        reason = None
        if device.startswith("cuda"):
            if dt == "bf16" and not torch.cuda.is_bf16_supported():
                reason = f"{torch.cuda.get_device_name(torch.device(device))} has no native bf16 (needs sm_80+)"
        elif dt in ("bf16", "fp16"):
            check = getattr(torch.ops.mkldnn, f"_is_mkldnn_{dt}_supported", None)
            try:
                native = bool(check()) if check is not None else False
            except RuntimeError:
                native = False
            if not native:
                need = "AVX-512 (BF16) or AMX" if dt == "bf16" else "AVX-512-FP16 or AMX-FP16"
                reason = (f"no native {dt} matmul on this CPU (oneDNN needs {need}; "
                          f"torch.ops.mkldnn._is_mkldnn_{dt}_supported() is false)")
        if reason:
            why[dt] = reason
        else:
            ok.append(dt)
    return ok, why


def trial_dtype(device: str) -> str:
    """The dtype local trials compute in: bf16 where the device has native bf16, else fp32."""
    ok, _ = dtype_support(device, ("bf16",))
    return "bf16" if ok else "fp32"
