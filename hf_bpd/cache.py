"""Where hf_bpd keeps what it builds once per machine: the dequantised packaged model (`packaged.py`) and
the measured forward-cost curves and CPU kernel plans (`cost.py`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """hf_bpd's cache directory: `$HF_BPD_CACHE`, else `$HF_HOME/hf_bpd`, else `$XDG_CACHE_HOME/hf_bpd`,
    else `~/.cache/hf_bpd`."""
    if os.environ.get("HF_BPD_CACHE"):
        return Path(os.environ["HF_BPD_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hf_bpd"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "hf_bpd"
