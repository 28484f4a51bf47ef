"""How busy the machine is with other work while hf_bpd measures it.

A one-time measurement (a forward-cost curve, a kernel plan) taken while another process keeps cores busy
describes that moment, not the machine: kept, it would size every later call's trees from it. So each such
measurement is taken inside `OtherLoad`, which reads the CPU time the whole machine used over the block
and subtracts this process's own: what is left is other processes' work, in cores. A measurement that
shared the cores it runs on (`busy`) is used for the process that took it but not kept as final.
"""

from __future__ import annotations

import os
import time

import torch

# cores of other processes' work, beyond what the machine leaves beside this process's threads, from which a
# measurement counts as taken on a busy machine: idle machines show a few hundredths (daemons, the kernel)
BUSY_CORES = 0.3


def _busy_seconds() -> tuple[float, float] | None:
    """(CPU seconds the machine has been busy, CPU seconds this process has used), or None where psutil
    cannot tell."""
    try:
        import psutil

        total = psutil.cpu_times()
        busy = sum(getattr(total, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))
        own = psutil.Process().cpu_times()
        return busy, own.user + own.system
    except (ImportError, OSError, AttributeError):
        return None


class OtherLoad:
    """`with OtherLoad() as load: ...` then `load.cores`: the average number of cores other processes kept
    busy during the block (None where unknown), and `load.busy`: whether that left fewer free cores than
    this process's torch threads (by `BUSY_CORES`)."""

    def __init__(self) -> None:
        self.cores: float | None = None

    def __enter__(self) -> OtherLoad:
        self._start = _busy_seconds()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        end, wall = _busy_seconds(), time.perf_counter() - self._t0
        if self._start is not None and end is not None and wall > 0:
            others = (end[0] - self._start[0]) - (end[1] - self._start[1])
            self.cores = max(0.0, others / wall)

    @property
    def busy(self) -> bool:
        if self.cores is None:
            return False
        spare = (os.cpu_count() or 1) - torch.get_num_threads()
        return self.cores > max(spare, 0) + BUSY_CORES
