"""Where hf_bpd keeps what it builds once per machine: the dequantised packaged model (`packaged.py`) and
the measured forward-cost curves (`cost.py`) and CPU kernel plans (`packed_linear.py`), keyed by the
machine and model they were measured on.

A measurement is kept as final only when the machine was quiet while it ran (`machine_load.OtherLoad`):
one taken beside other processes' work is used by the process that took it and measured again by the next
(`measured_once`). A kept one that decoding's own timings contradict is dropped (`forget`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch

from .log import logged, logger
from .machine_load import OtherLoad


def cache_root() -> Path:
    """hf_bpd's cache directory: `$HF_BPD_CACHE`, else `$HF_HOME/hf_bpd`, else `$XDG_CACHE_HOME/hf_bpd`,
    else `~/.cache/hf_bpd`."""
    if os.environ.get("HF_BPD_CACHE"):
        return Path(os.environ["HF_BPD_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hf_bpd"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "hf_bpd"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:  # the CPU model: a cached curve is only valid on the same kind of processor
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(model) -> dict:
    """What a measurement of `model` on this machine depends on: its architecture (config without names),
    dtype, device kind, threads and torch version (not its weights)."""
    param = next(model.parameters())
    config = {k: v for k, v in model.config.to_dict().items() if "name" not in k and k != "transformers_version"}
    return {
        "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "dtype": str(param.dtype),
        "device": f"{param.device.type}: {device_name(param.device)}",
        "threads": torch.get_num_threads() if param.device.type == "cpu" else None,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }


def key_file_name(key: dict) -> str:
    """`<digest of key>.json`: the name a measurement keyed by `key` is cached under."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16] + ".json"


def cache_file(folder: str, key: dict) -> Path:
    """`folder/<digest of key>.json` in hf_bpd's cache."""
    return cache_root() / folder / key_file_name(key)


def read_cached(path: Path, key: dict) -> dict | None:
    try:
        stored = json.loads(path.read_text())
        return stored if stored.get("key") == key else None
    except (OSError, ValueError, AttributeError):
        return None  # missing, unreadable or from another format: measure again


def write_cached(path: Path, record: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, path)  # atomic: concurrent processes never read half a file
    except OSError:
        pass  # a read-only cache only costs a measurement next time


def measured_once(path: Path, key: dict, measure, what: str, refresh: bool = False) -> tuple[dict, bool]:
    """The record cached at `path` for `key`, or a new one from `measure()` (a dict), timed and logged as
    `what` and written there with how busy the machine was meanwhile. Returns (record, measured now).
    A record measured on a busy machine is measured again (module docstring); `refresh` measures again."""
    stored = None if refresh else read_cached(path, key)
    if stored is not None and not stored.get("busy"):
        return stored, False
    if stored is not None:
        logger.info(
            "%s was measured while other processes kept %.1f cores busy: measuring it again",
            what,
            stored.get("other_cores") or 0.0,
        )
    with logged(f"measuring {what} (once per machine, cached in {path.parent})"), OtherLoad() as load:
        record = measure()
    record.update(key=key, measured=time.time(), other_cores=load.cores, busy=load.busy)
    if load.busy:
        logger.warning(
            "%s was measured while other processes kept %.1f cores busy: it is used now and measured again "
            "by the next process",
            what,
            load.cores,
        )
    write_cached(path, record)
    return record, True


def forget(path: Path) -> None:
    """Drop a cached measurement, so that the next use measures it again."""
    with contextlib.suppress(OSError):
        path.unlink()
