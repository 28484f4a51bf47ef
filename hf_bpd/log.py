"""hf_bpd's logger and progress bars.

The `hf_bpd` logger is quiet by default, as transformers' is: its INFO lines (each one-time measurement,
with what it measures and how long it took) show once a user asks for them, with
`logging.getLogger("hf_bpd").setLevel(logging.INFO)` and a handler, or `hf_bpd.log.show_info()`;
warnings (a cached measurement that decoding contradicts) show as Python's warnings-level log records do.
A progress bar appears for work that runs longer than `PROGRESS_DELAY` seconds, unless huggingface_hub's
progress bars are turned off (`HF_HUB_DISABLE_PROGRESS_BARS=1`).
"""

from __future__ import annotations

import contextlib
import logging
import time

logger = logging.getLogger("hf_bpd")

PROGRESS_DELAY = 2.0  # seconds of work before its bar is drawn: short work draws none


def show_info() -> None:
    """Print hf_bpd's INFO lines to stderr (the command-line tools call this)."""
    if not any(getattr(h, "_hf_bpd", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("hf_bpd: %(message)s"))
        handler._hf_bpd = True
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def progress(total: int, desc: str):
    """A progress bar of `total` steps for one-time work, drawn only past `PROGRESS_DELAY` seconds."""
    from tqdm.auto import tqdm

    try:
        from huggingface_hub.utils import are_progress_bars_disabled

        disabled = are_progress_bars_disabled()
    except ImportError:
        disabled = False
    return tqdm(total=total, desc=f"hf_bpd: {desc}", delay=PROGRESS_DELAY, leave=False, disable=disabled)


@contextlib.contextmanager
def logged(what: str):
    """Log `what` when it starts and, with its duration, when it ends (INFO)."""
    logger.info("%s ...", what)
    t0 = time.perf_counter()
    yield
    logger.info("%s: done in %.1f s", what, time.perf_counter() - t0)
