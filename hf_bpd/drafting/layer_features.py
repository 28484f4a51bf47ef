"""The hidden states of a few decoder layers, captured by forward hooks, for heads with `feature_layers`.

Fusion heads (`heads.py`, `feature_layers`: e.g. `[2, 15, -1]`) read the base model's hidden states at a few
layers. The forwards hf_bpd runs anyway (prefill, tree verification) compute them, so they cost no extra
forward; only `output_hidden_states=True` would keep every layer's output. `LayerFeatures` instead puts a
forward hook on each chosen decoder layer (a pre-hook on the first layer for index 0, the embeddings) for
the duration of a context, and keeps those layers' outputs alone. Indices are those of
`output_hidden_states`' tuple, so `features(out)` equals the concatenation of `out.hidden_states[i]` for the
chosen i (the final one, -1, is the output's own `hidden_states[-1]`, after the final norm, as every
forward hf_bpd runs asks for it: `compat.last_hidden_state_request`).

Decoding (`decoding_features`, held by `generation.generate` for a whole call): a hook on the model itself
then replaces each forward's `hidden_states` by the fused state of every position, `(heads.fuse(features),)`,
so every loop reads and gathers `out.hidden_states[-1]` (the rows of the accepted nodes) exactly as for
last-layer heads: nothing downstream changes. The prefill keeps the last position alone
(`only_last_position`): the heads read no other. The hooks go when the context closes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

FINAL = -1  # the final hidden state: the forward's own `hidden_states[-1]`
LAYER_LIST_NAMES = ("layers", "h", "layer", "blocks")
_ACTIVE = "_bpd_layer_features"  # the `LayerFeatures` decoding `model` holds, in its __dict__


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of `model` in order: `get_decoder().layers` (or `.h`, `.layer`, `.blocks`), else
    the one ModuleList as long as its text config's `num_hidden_layers`. ValueError where there is none."""
    owners = []
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        with contextlib.suppress(Exception):
            owners.append(get_decoder())
    owners += [getattr(model, name, None) for name in ("model", "transformer", "language_model")] + [model]
    for owner in owners:
        for name in LAYER_LIST_NAMES:
            layers = getattr(owner, name, None) if owner is not None else None
            if isinstance(layers, nn.ModuleList) and len(layers) > 0:
                return layers
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    count = getattr(text, "num_hidden_layers", None)
    found = [m for m in model.modules() if isinstance(m, nn.ModuleList) and count and len(m) == count]
    if len(found) == 1:
        return found[0]
    raise ValueError(
        f"{type(model).__name__}: no decoder layer list found (looked for get_decoder().layers/.h/.layer/.blocks and "
        f"one ModuleList of num_hidden_layers={count} modules): heads with feature_layers cannot hook its layers"
    )


def _hidden_of(output) -> torch.Tensor:
    """A decoder layer's output hidden state: the output itself, or the first element of a tuple."""
    return output[0] if isinstance(output, (tuple, list)) else output


class LayerFeatures:
    """Context: hooks on `model`'s decoder layers that keep the hidden states `layers` selects
    (`output_hidden_states` indices; -1, the final one, is read from the output). `features(out)` after a
    forward: `[B, T, k * hidden]`, in `layers`' order. With `fuse` (decoding), the model's own forward hook
    replaces each forward's `hidden_states` by `(fuse(features),)`."""

    def __init__(
        self, model: nn.Module, layers: list[int], fuse: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        self.model, self.layers, self.fuse = model, list(layers), fuse
        stack = decoder_layers(model)
        depth = len(stack)
        for i in self.layers:
            if i != FINAL and not 0 <= i < depth:
                raise ValueError(
                    f"feature layer {i} is outside {type(model).__name__}'s hidden states 0..{depth} (the last one: -1)"
                )
        self._stack = stack
        self._captured: dict[int, torch.Tensor] = {}
        self._handles: list = []
        self._depth = 0  # forwards of `model` running (the layers may also serve another module: a rescorer)
        self.last_only = False  # keep the last position alone (a prefill: the heads read no other)

    def __enter__(self) -> LayerFeatures:
        try:
            for i in self.layers:
                if i == 0:  # the embeddings: the first layer's input
                    handle = self._stack[0].register_forward_pre_hook(self._keep_input, with_kwargs=True)
                elif i != FINAL:  # hidden state i: the output of layer i (1-based)
                    handle = self._stack[i - 1].register_forward_hook(self._keeper(i))
                else:
                    continue
                self._handles.append(handle)
            self._handles.append(self.model.register_forward_pre_hook(self._start))
            self._handles.append(self.model.register_forward_hook(self._finish))
        except BaseException:
            self.close()
            raise
        if self.fuse is not None:
            self.model.__dict__[_ACTIVE] = self
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook and drop what was kept."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._captured.clear()
        if self.model.__dict__.get(_ACTIVE) is self:
            del self.model.__dict__[_ACTIVE]

    def _keep(self, i: int, hidden: torch.Tensor) -> None:
        if self._depth:
            self._captured[i] = hidden[:, -1:] if self.last_only else hidden

    def _keeper(self, i: int):
        def hook(module, args, output):
            self._keep(i, _hidden_of(output))

        return hook

    def _keep_input(self, module, args, kwargs):
        self._keep(0, args[0] if args else kwargs["hidden_states"])

    def _start(self, module, args):
        self._depth += 1
        if self._depth == 1:
            self._captured.clear()

    def _finish(self, module, args, output):
        self._depth -= 1
        if self._depth or self.fuse is None:
            return None
        features = self.features(output)
        self._captured.clear()
        final = output.hidden_states[-1]
        output.hidden_states = (self.fuse(features).to(final.device),)
        return output

    def features(self, output) -> torch.Tensor:
        """`[B, T, k * hidden]`: the kept hidden states of the last forward and its output's final one
        (`output.hidden_states[-1]`), concatenated in `layers`' order (the last position alone under
        `last_only`)."""
        hidden_states = getattr(output, "hidden_states", None)
        final = hidden_states[-1] if hidden_states else None
        if final is None:
            raise ValueError(
                f"{type(self.model).__name__}'s forward returned no final hidden state to read features with"
            )
        if self.last_only:
            final = final[:, -1:]
        missing = [i for i in self.layers if i != FINAL and i not in self._captured]
        if missing:
            raise RuntimeError(f"the forward ran none of the hooked layers for hidden states {missing}")
        parts = [final if i == FINAL else self._captured[i].to(final.device) for i in self.layers]
        return torch.cat(parts, dim=-1)


def decoding_features(model: nn.Module, heads) -> contextlib.AbstractContextManager:
    """The context a `generate` call decodes in: for heads with `feature_layers`, a `LayerFeatures` that
    turns every forward's `hidden_states` into the heads' fused state (module docstring); else nothing."""
    layers = getattr(getattr(heads, "config", None), "feature_layers", None)
    if not layers:
        return contextlib.nullcontext()

    def fuse(features: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return heads.fuse(features.to(heads.device, heads.dtype))

    return LayerFeatures(model, layers, fuse)


@contextlib.contextmanager
def only_last_position(model: nn.Module) -> Iterator[None]:
    """Inside: the decoding features of `model` (if any) keep each forward's last position alone."""
    capture = model.__dict__.get(_ACTIVE)
    if capture is None:
        yield
        return
    capture.last_only = True
    try:
        yield
    finally:
        capture.last_only = False
