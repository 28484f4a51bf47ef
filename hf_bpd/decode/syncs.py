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
