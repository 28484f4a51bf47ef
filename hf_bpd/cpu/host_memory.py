"""Host memory on a CPU: keep freed blocks for reuse instead of giving them back to the kernel each time.

Why: glibc's malloc serves every block above its mmap threshold (adaptive, at most 32 MiB on 64-bit) with
a fresh `mmap` and unmaps it when freed. A forward over many tokens (a prefill, above all a batch's)
allocates such blocks in every layer (activations of rows x tokens x features), so each layer pays again
for faulting every page of them in, zeroed by the kernel. Inside `reuse_freed_memory` glibc serves them from
its heap (`M_MMAP_MAX` 0) and keeps what is freed there for the next layer (`M_TRIM_THRESHOLD` at its
maximum); on leaving the outermost block the settings the process started with come back and
`malloc_trim(0)` hands the freed heap back, so the block's peak does not stay resident.

Process-wide (malloc's settings are the process's) and a no-op where the C library is not glibc.
`research/prefill_memory.py` measures what it changes (RESULTS.md); `fast_cpu` and hf_bpd's own decode
both open it (the model's shared `PackedLinear` block), so plain and drafted decoding are timed under the
same allocator.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_MAX = -4
KEEP_FREED = 2**31 - 1  # mallopt takes a C int: the largest trim threshold it can set
# glibc's defaults, unless the process set its own through malloc's environment variables
GLIBC_DEFAULTS = {M_MMAP_MAX: ("MALLOC_MMAP_MAX_", 65536), M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", 128 * 1024)}

_LOCK = threading.Lock()
_depth = 0  # blocks open, all threads together: the settings are the process's


@functools.cache
def glibc() -> ctypes.CDLL | None:
    """The process's C library where it is glibc (it has `mallopt` and `malloc_trim`), else None."""
    try:
        libc = ctypes.CDLL(None)
        _ = libc.gnu_get_libc_version  # glibc's own: musl and macOS lack it
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    except (OSError, AttributeError):
        return None
    return libc


def starting_value(param: int) -> int:
    """What `param` was when the process started: its environment variable's value, or glibc's default."""
    name, default = GLIBC_DEFAULTS[param]
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


@contextlib.contextmanager
def reuse_freed_memory():
    """Inside the block, freed host memory stays with malloc for the next allocation (module docstring).
    Nested and concurrent blocks share one setting: the outermost exit restores it."""
    global _depth
    libc = glibc()  # None: blocks are counted, malloc is left alone
    with _LOCK:
        if _depth == 0 and libc is not None:
            libc.mallopt(M_MMAP_MAX, 0)
            libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED)
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0 and libc is not None:
                for param in GLIBC_DEFAULTS:
                    libc.mallopt(param, starting_value(param))
                libc.malloc_trim(0)
