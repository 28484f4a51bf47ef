"""Pre-packed oneDNN linear layers for the tree-verification forward on a CPU.

Why: a tree forward of N > 1 tokens on a CPU costs far more than one token, not because of arithmetic but
because of how BLAS treats skinny matrices. On the dev CPU (MKL on AMD) `F.linear` of 2 rows costs 2x one
row for every weight, the 49152 x 576 output layer 20 ms against 9 ms, so a tree of 2 to 8 tokens costs
about 1.7 single-token steps and blockwise decoding barely breaks even. oneDNN with the weight reordered
once into its blocked layout (what `torch.compile` does on a CPU) runs 2 to 8 rows for about the price of
one: the output layer 4 to 7 ms.

Inside `with packed:` the float32 CPU `nn.Linear` layers of the wrapped modules run oneDNN's
`_linear_pointwise` on a packed copy of their weight, made on first use. No modeling file is copied or
changed, and outside the block the model is exactly as loaded. Only the verification forward and the heads
run inside it. Plain `generate` and the prefill are unchanged, and the output is still checked token for
token against plain `generate`: the packed kernel rounds differently, as any batched forward does.

The cost is memory: a second copy of every linear weight the forward uses (about the model's size).
A weight changed in place after packing (its `_version` moves) is packed again, never used stale.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch
import torch.nn.functional as F

# the row count oneDNN packs for (any count works): the trees `auto` verifies on the dev CPU have 2-16 tokens
PACK_ROWS = 8
# "auto" packs models whose float32 parameters take at most this much: the packed copy doubles their memory
AUTO_MAX_BYTES = 2 * 1024**3

_MODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its PackedLinear, shared by drafters
_THREAD = threading.local()  # the PackedLinear blocks open in this thread, innermost last


@functools.cache
def packed_linear_available() -> bool:
    """oneDNN is built into this torch and its packed linear ops work as this module calls them. They are
    private ops (the ones `torch.compile` uses on a CPU), so a torch release that changes them turns the
    feature off ("auto") or into a clear error (True) instead of breaking decoding."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or mkldnn is None:
        return False
    try:
        g = torch.Generator().manual_seed(0)  # never the global stream: a user's seeded sampling must not move
        weight, bias, x = (torch.randn(*shape, generator=g) for shape in ((24, 16), (24,), (3, 16)))
        packed = mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        out = mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return bool(torch.allclose(out, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4))
    except (AttributeError, RuntimeError, TypeError):
        return False


class PackedLinear:
    """Route the `nn.Linear` layers of `modules` through oneDNN with packed weights inside `with` blocks
    (see the module docstring); outside them the layers are untouched.

    Inside a block each layer's `forward` is an instance attribute (the way accelerate's hooks wrap a
    module), removed again on exit; a class-wide mode (`TorchFunctionMode`) would add a Python call to each
    of a forward's ~2,400 torch calls, about 10 ms, eating the gain. Reusable: the packed weights are kept
    between blocks (`clear()` frees them). Calls it cannot serve (one row, another dtype or device,
    autograd) run the layer's own forward. While a block is open, another thread calling the same layers
    also gets the packed path (same numbers up to rounding).
    """

    def __init__(self, *modules: torch.nn.Module) -> None:
        if not packed_linear_available():
            raise RuntimeError("this torch build has no oneDNN packed linear ops (torch.ops.mkldnn)")
        self.layers = [m for module in modules for m in module.modules() if type(m) is torch.nn.Linear]
        self._forwards = [(layer, functools.partial(self.linear, layer)) for layer in self.layers]  # made once
        # id(weight) -> (weight, its _version when packed, packed weight or None when it cannot be served)
        self._packed: dict[int, tuple[torch.Tensor, int, torch.Tensor | None]] = {}
        self._depth = 0

    def __len__(self) -> int:
        """Weights packed so far."""
        return sum(entry[2] is not None for entry in self._packed.values())

    def clear(self) -> None:
        self._packed.clear()

    def packed(self, weight: torch.Tensor) -> torch.Tensor | None:
        """`weight` in oneDNN's blocked layout, packed on first use and again after an in-place change; None
        for a weight it cannot serve (not a plain 2D float32 CPU tensor). Checked once per packing, not
        per call."""
        entry = self._packed.get(id(weight))
        if entry is None or entry[0] is not weight or entry[1] != weight._version:
            servable = (
                type(weight) in (torch.Tensor, torch.nn.Parameter)
                and weight.dim() == 2
                and weight.dtype == torch.float32
                and weight.device.type == "cpu"
                and weight.layout == torch.strided
            )
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS) if servable else None
            entry = (weight, weight._version, packed)
            self._packed[id(weight)] = entry
        return entry[2]

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear(x, weight, bias)`, on the packed weight where servable: several rows (one row stays with
        BLAS's matrix-vector kernel, faster there: 66 against 72 ms on the dev CPU), float32 on the CPU,
        outside autograd (the packed op has no backward)."""
        if (
            type(x) is torch.Tensor
            and x.dim() > 1
            and x.numel() > x.shape[-1]
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu"))
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        ):
            packed = self.packed(weight)
            if packed is not None:
                rows = x.reshape(-1, x.shape[-1])
                out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
                return out.reshape(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)

    def linear(self, layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """What `layer(x)` runs inside a block."""
        return self.apply(x, layer.weight, layer.bias)

    def __enter__(self) -> PackedLinear:
        if self._depth == 0:
            for layer, forward in self._forwards:
                layer.__dict__["forward"] = forward  # the instance attribute shadows the class's forward
        self._depth += 1
        _active().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active().pop()
        self._depth -= 1
        if self._depth == 0:
            for layer in self.layers:
                layer.__dict__.pop("forward", None)


def active_packed_linear() -> PackedLinear | None:
    """The innermost `PackedLinear` block open in this thread, for linears that are not `nn.Linear`
    layers (the heads' softmax over the base LM head's rows): `packed.apply(x, weight)`."""
    stack = _active()
    return stack[-1] if stack else None


def _active() -> list[PackedLinear]:
    if not hasattr(_THREAD, "stack"):
        _THREAD.stack = []
    return _THREAD.stack


def wants_packed_linear(model, packed_linear: bool | None) -> bool:
    """Resolve a `packed_linear` setting for `model`: True/False as given (True raises where it cannot
    work), None ("auto") packs float32 CPU models of at most `AUTO_MAX_BYTES` when oneDNN is there."""
    param = next(model.parameters())
    servable = param.device.type == "cpu" and param.dtype == torch.float32
    if packed_linear is None:
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        return servable and packed_linear_available() and size <= AUTO_MAX_BYTES
    if packed_linear and not servable:
        raise ValueError(
            f"packed_linear=True serves float32 models on a CPU; this one is {param.dtype} on {param.device}"
        )
    if packed_linear and not packed_linear_available():
        raise RuntimeError("packed_linear=True needs oneDNN's packed linear ops, which this torch build lacks")
    return bool(packed_linear)


def linear_context(model, packed_linear: bool | None) -> contextlib.AbstractContextManager:
    """The context the verification forward (and the heads) run in: `model`'s shared `PackedLinear`, or
    a no-op when `packed_linear` resolves to False (`wants_packed_linear`)."""
    if not wants_packed_linear(model, packed_linear):
        return contextlib.nullcontext()
    mode = _MODES.get(model)
    if mode is None:
        mode = _MODES[model] = PackedLinear(model)
    return mode
