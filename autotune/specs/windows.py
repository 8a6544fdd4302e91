"""Sliding-window attention: which layers are windowed, and the one rule that counts the (query, key)
pairs a causal mask with documents and a window keeps.

GPT-OSS (OpenAI's gpt-oss model card, 2025; the HF config's ``sliding_window: 128`` and
``layer_types``) alternates windowed layers, where a query attends itself and the 127 tokens before
it, with full causal layers, starting with a windowed one. Megatron-LM writes the same with
``--window-size 127,0`` (keys to the left and right of the query, the query itself not counted) and
``--window-attn-skip-freq 2``; its rule (``megatron/core/transformer/utils.py``
``is_layer_window_attention``, layer numbers from 1): without a skip frequency every layer is
windowed; an integer N makes layer n full where ``n % N == 0`` ((N-1) windowed layers, then one
full); a list gives each layer 1 (windowed) or 0 (full). A model file writes the same two forms
(``window_skip_freq: 2`` or ``window_skip_freq: [1, 0, 1, 0]``) and ``window`` as the keys a query
attends, itself included (HF's ``sliding_window``; Megatron's left size plus one).
"""

from __future__ import annotations

from typing import Any

from autotune.errors import InputError

SkipFreq = int | tuple[int, ...] | None


def is_window_layer(window: int, skip_freq: SkipFreq, layer: int) -> bool:
    """Whether 0-indexed ``layer`` is windowed (Megatron's ``is_layer_window_attention`` on layer
    number ``layer + 1``)."""
    if not window:
        return False
    if skip_freq is None:
        return True
    if isinstance(skip_freq, int):
        return (layer + 1) % skip_freq != 0
    return bool(skip_freq[layer])


def query_keys(lo: int, hi: int, start: int, window: int | None = None) -> float:
    """Sum over the queries at positions ``[lo, hi)`` of the keys each attends in the document that
    starts at ``start <= lo``: causal, a query at p attends the p - start + 1 positions from the
    document's start up to itself, at most ``window`` of them (the nearest; None or 0: no window).
    The one pair count of the cost model: causal windows, document masks
    (``cost/documents.masked_pairs``) and windowed layers (``ModelSpec.window_keys``,
    ``cost/windows.py``) all ask it."""
    if hi <= lo:
        return 0.0
    first, last = lo - start + 1, hi - start  # keys of the first and of the last query
    if not window or last <= window:  # sum over p in [lo, hi) of (p - start + 1)
        return (hi - lo) * (first + last) / 2.0
    total = 0.0
    if first <= window:  # the queries that still see the document's start: first .. window keys
        total += (window - first + 1) * (first + window) / 2.0
    return total + (last - max(first, window + 1) + 1) * float(window)


def check_window(window: int, skip_freq: SkipFreq, layers: int) -> None:
    """One-line errors naming the field for a bad window or skip pattern."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise InputError(f"must be a non-negative integer (keys a query attends, itself included), got {window!r}",
                         field="window")
    if window == 1:
        raise InputError("a window of 1 attends the query alone; use 2 or more (0: no window)", field="window")
    if skip_freq is None:
        return
    if not window:
        raise InputError("needs a window (window: N keys) for the layers it windows", field="window_skip_freq")
    if isinstance(skip_freq, int):
        if isinstance(skip_freq, bool) or skip_freq < 2:
            raise InputError(f"must be an integer >= 2 (every Nth layer full) or a list of 0/1 per layer, got "
                             f"{skip_freq!r}", field="window_skip_freq")
        return
    if len(skip_freq) != layers:
        raise InputError(f"the pattern has {len(skip_freq)} entries, the model {layers} layers", field="window_skip_freq")
    bad = [x for x in skip_freq if x not in (0, 1) or isinstance(x, bool)]
    if bad:
        raise InputError(f"entries are 1 (windowed) or 0 (full), got {bad[0]!r}", field="window_skip_freq")
    if not any(skip_freq):
        raise InputError("no layer is windowed: drop window and window_skip_freq", field="window_skip_freq")


def skip_freq_from(value: Any) -> SkipFreq:
    """A model file's ``window_skip_freq``: an integer, a list of 0/1, or absent."""
    if value is None or isinstance(value, bool) or isinstance(value, int):
        return value
    if isinstance(value, list | tuple):
        return tuple(value)
    raise InputError(f"expected an integer or a list of 0/1 per layer, got {value!r}", field="window_skip_freq")


def megatron_pattern(skip_freq: SkipFreq) -> str | None:
    """``--window-attn-skip-freq`` as Megatron's parser (``moe_freq_type``) reads it back."""
    if skip_freq is None:
        return None
    if isinstance(skip_freq, int):
        return str(skip_freq)
    return "[" + ",".join(str(x) for x in skip_freq) + "]"


def hf_attention(model: Any) -> dict[str, Any] | None:
    """The model's windows and sinks in the keys of a Hugging Face ``GptOssConfig`` (``sliding_window``,
    ``layer_types``; sinks are part of that model's attention), for the exports whose framework
    config holds no attention architecture (DeepSpeed: the user's model reads them); None without."""
    if not (model.window or model.sinks):
        return None
    out: dict[str, Any] = {}
    if model.window:
        out["sliding_window"] = model.window
        out["layer_types"] = ["sliding_attention" if model.is_window_layer(i) else "full_attention"
                              for i in range(model.layers)]
    if model.sinks:
        out["sinks"] = True
    return out
