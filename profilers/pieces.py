"""One piece of the runtime's model (``embed``, ``block``, ``head``, and an MoE model's ``moe``) built at a
shape, with its timed calls.

An MoE model's ``block`` is its first dense layer and ``moe`` its first MoE layer (attention, router,
the dispatch's permutation, the routed experts of EP rank 0 of ``ep`` (at etp rank 0's slice of
``etp``) and the combine, the shared experts), timed as one process stands for its ep and etp shard
(``runtime.expert_parallel.shard_groups``); ``moe_parts`` gives its FFN's steps apart.

Shared by the per-layer profiles (``profilers/layers.py``) and the kernel profile's reference block
(``profilers/block_ref.py``); its own module so that neither imports the other.
"""

from __future__ import annotations

from typing import Any


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while the context is open, and
    whether one of them is an s x s score matrix."""

    def __init__(self, seq: int = 0) -> None:
        self.seen: dict[int, int] = {}
        self.seq = seq
        self.scores = False

    def pack(self, t):
        # [batch, heads, s, s]: the softmax output SDPA's math kernel keeps (weights and [b, s, h]
        # activations are 2- and 3-dimensional, whatever h is)
        if self.seq > 1 and t.dim() == 4 and t.shape[-1] == t.shape[-2] == self.seq:
            self.scores = True
        try:
            st = t.untyped_storage()
            self.seen.setdefault(st.data_ptr(), st.nbytes())
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse)
            self.seen.setdefault(id(t), t.numel() * t.element_size())
        return t

    @staticmethod
    def unpack(t):
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _tp_axis(t: int):
    from autotune.runtime.mesh import Axis

    # no process group: every tp layer keeps its shard's shape and skips its collectives
    return Axis(size=t, index=0, ranks=list(range(t)), group=None)


def piece_layers(piece: str, model: Any) -> list[int]:
    """The layer a ``block`` or ``moe`` piece builds (none for ``embed`` and ``head``): a dense
    model's layer 0; an MoE model's first dense layer, or its first MoE layer. Of those, the first
    with full causal attention where the model has sliding-window layers (GPT-OSS starts with a
    windowed one): the cost model reads a piece as the full layer and prices windowed layers apart
    (``cost.layers.applies``)."""
    if piece not in ("block", "moe"):
        return []
    found = [i for i in range(model.layers) if model.is_moe_layer(i) == (piece == "moe")]
    if not found:
        raise ValueError(f"model {model.name} has no {'MoE' if piece == 'moe' else 'dense'} layer")
    full = [i for i in found if not model.is_window_layer(i)]
    return (full or found)[:1]


class Piece:
    """One piece at one (tp, micro_batch, seq[, ep]): its module, inputs and the two timed calls."""

    def __init__(self, piece: str, model: Any, t: int, b: int, s: int, device: str, dtype: Any, seed: int = 0,
                 ep: int = 1, etp: int = 1):
        import torch

        from autotune.runtime.expert_parallel import shard_groups
        from autotune.runtime.model import Layout, StageModel, build_on_meta, materialize
        from autotune.runtime.moe import MoEContext

        moe = MoEContext(groups=shard_groups(model.moe.experts, ep, t, etp)) if piece == "moe" else None
        layout = Layout(tp=_tp_axis(t), moe=moe)
        first, last, layers = piece == "embed", piece == "head", piece_layers(piece, model)
        dev = torch.device(device)
        self.module = materialize(build_on_meta(lambda: StageModel(model, layout, layers, first, last, s)),
                                  model, seed, dev, dtype)
        g = torch.Generator(device="cpu").manual_seed(seed + 7919 * t + 31 * b + s)
        vocab_shard = model.vocab // t
        if first:
            self.x = torch.randint(0, vocab_shard, (b, s), generator=g).to(dev)
        else:
            self.x = (torch.randn(b, s, model.hidden, generator=g) * 0.5).to(device=dev, dtype=dtype)
        self.target = torch.randint(0, vocab_shard, (b, s), generator=g).to(dev) if last else None
        self.piece = piece
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters())

    def moe_parts(self) -> Any:
        """A ``moe`` piece's MoE FFN steps (``profilers/moe_parts.py``), on the input its block's
        attention hands the FFN (drawn once here, under no gradient)."""
        import torch

        from profilers.moe_parts import MoEParts, moe_layer

        layer = moe_layer(self.module)
        seen = {}
        hook = layer.register_forward_pre_hook(lambda _m, args: seen.setdefault("x", args[0].detach()))
        with torch.no_grad():
            self.module(self.x)
        hook.remove()
        return MoEParts(layer, seen["x"])

    def _out(self):
        x = self.x
        if self.piece != "embed":
            x = x.detach().requires_grad_(True)  # the gradient flows on to the previous stage
        y = self.module(x)
        if self.piece == "head":
            y = self.module.token_losses(y, self.target).mean()
        return y

    def fwd(self) -> None:
        self._out()

    def fwd_bwd(self) -> None:
        import torch

        y = self._out()
        y.backward(torch.ones_like(y) if y.dim() else None)
        for p in self.module.parameters():
            p.grad = None

    def saved(self) -> SavedBytes:
        import torch

        rec = SavedBytes(self.x.shape[1])
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
            y = self._out()
        del y
        # weights and buffers (rotary tables) are model state, not activations
        state = {t.untyped_storage().data_ptr() for t in (*self.module.parameters(), *self.module.buffers())}
        rec.seen = {ptr: n for ptr, n in rec.seen.items() if ptr not in state}
        return rec

    def activation_bytes(self) -> int:
        return self.saved().total
