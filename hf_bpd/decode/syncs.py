"""Counting device-to-host synchronisations: the calls that make the host wait for the device.

On a GPU every `.tolist()`, `.item()`, `int(t)`, `bool(t)`, `.cpu()` or `.numpy()` of a device tensor stalls
the pipeline until the work queued before it is done; a decoding step with many of them cannot overlap its
drafting with the base model's forward. On a CPU these calls cost nothing extra, but they are the same
calls, so counting them on a CPU shows how a step will behave on a GPU.

`HostSyncCounter` is a `TorchFunctionMode`: inside it every such call on a tensor is counted, by phase.
It adds a Python call to every torch call, so it is for tests and measurements (`BlockDrafter(
count_host_syncs=True)`, `stats.host_syncs`), never on in a timed run.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

# tensor methods that copy a value to the host (for a device tensor: wait for it)
SYNC_METHODS = frozenset(
    {
        torch.Tensor.tolist,
        torch.Tensor.item,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.Tensor.cpu,
        torch.Tensor.numpy,
    }
)


class HostSyncCounter(TorchFunctionMode):
    """Counts host synchronisations (`SYNC_METHODS`) by phase: `with counter.phase("accept"): ...`.
    Calls outside any phase count under "other"."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._phase = "other"
        self._depth = 0

    @contextlib.contextmanager
    def phase(self, name: str):
        outer, self._phase = self._phase, name
        self._depth += 1
        try:
            # pushed once: a mode entered twice would see (and count) every call twice
            with self if self._depth == 1 else contextlib.nullcontext():
                yield
        finally:
            self._depth -= 1
            self._phase = outer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNC_METHODS:
            self.counts[self._phase] += 1
        return func(*args, **(kwargs or {}))


def phase(counter: HostSyncCounter | None, name: str) -> contextlib.AbstractContextManager:
    """`counter.phase(name)`, or nothing when not counting."""
    return contextlib.nullcontext() if counter is None else counter.phase(name)


# torch calls that make a tensor from host values (a list, a number, an array): on an accelerator each one is
# a host-to-device copy, blocking from pageable memory
HOST_TENSOR_FUNCTIONS = frozenset(
    {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor, torch.from_numpy}
)
# copies between devices: blocking unless asked otherwise (`non_blocking=True`)
COPY_METHODS = frozenset({torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.cuda})


class StepSyncCounter(HostSyncCounter):
    """`HostSyncCounter` that also counts every other way a step can make the host wait or feed the device
    from the host: tensors made from host values (`HOST_TENSOR_FUNCTIONS`, whatever the device: on a CPU
    they are the calls a GPU would copy) and blocking copies between two devices (`COPY_METHODS`).
    `calls` keeps what was counted, by phase and function name, for a failing test to show."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[tuple[str, str]] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNC_METHODS or _from_host(func, args) or _blocking_copy(func, args, kwargs):
            self.counts[self._phase] += 1
            self.calls[(self._phase, getattr(func, "__name__", str(func)))] += 1
        return func(*args, **kwargs)


def _from_host(func, args) -> bool:
    if func not in HOST_TENSOR_FUNCTIONS:
        return False
    data = args[1] if func is torch.Tensor.new_tensor else (args[0] if args else None)
    return not isinstance(data, torch.Tensor)


def _blocking_copy(func, args, kwargs) -> bool:
    if func not in COPY_METHODS or kwargs.get("non_blocking") or not args:
        return False
    source = args[0]
    if func is torch.Tensor.cuda:
        return source.device.type != "cuda"
    if func is torch.Tensor.copy_:
        other = args[1] if len(args) > 1 else kwargs.get("src")
        return isinstance(other, torch.Tensor) and other.device != source.device and not (len(args) > 2 and args[2])
    target = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (torch.device, str)):
            target = a
        elif isinstance(a, torch.Tensor):
            target = a.device
    return (
        target is not None
        and torch.device(target).type != source.device.type
        and not (len(args) > 3 and args[3] is True)
    )
