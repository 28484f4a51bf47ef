"""Per-epoch training checkpoints, so an interrupted `hf-bpd train-heads` resumes where it stopped.

After each epoch the main process writes `OUTPUT/checkpoint/last.pt`: the trainable weights, the optimizer
and LR-schedule state, the shuffle generator's state, the epochs' validation records, and a fingerprint of
the run (every training argument plus a digest of the distilled samples). Re-running the same command
loads it and trains only the epochs that are left; because the shuffle order, the optimizer and the
schedule continue exactly, the resumed run ends with the same weights, bit for bit, as an uninterrupted
one. A checkpoint of other settings or other data is refused with the differing arguments named, rather
than silently mixing two runs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

# arguments that do not change what is trained: where it is written or read from, and how it is logged
_NOT_TRAINING = ("output", "features_cache", "device", "log_every", "no_progress", "model")


@dataclass
class EpochCheckpoint:
    epochs_done: int
    history: list[dict]
    modules: dict[str, dict[str, torch.Tensor]]  # name -> state dict of what is trained
    optimizer: dict
    scheduler: dict | None
    shuffle: torch.Tensor  # the data loader generator's state after `epochs_done` epochs
    fingerprint: dict


def run_fingerprint(args: argparse.Namespace, data_digest: str) -> dict:
    """What must match for a checkpoint to continue this run: the training arguments and the data."""
    fp = {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_TRAINING}
    fp["data"] = data_digest
    return fp


def checkpoint_path(output: str | Path) -> Path:
    return Path(output) / "checkpoint" / "last.pt"


def save_checkpoint(output: str | Path, ckpt: EpochCheckpoint) -> Path:
    path = checkpoint_path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(ckpt.__dict__, tmp)
    tmp.replace(path)  # atomic: an interruption while saving leaves the previous epoch's checkpoint
    return path


def load_checkpoint(output: str | Path, fingerprint: dict) -> EpochCheckpoint | None:
    """The checkpoint under `output` if there is one, after checking it belongs to this run."""
    path = checkpoint_path(output)
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, weights_only=True)
        ckpt = EpochCheckpoint(**saved)
    except Exception as e:  # truncated by hand, another format: name the file rather than a pickle trace
        raise ValueError(f"{path} is not a readable train-heads checkpoint ({e}); delete it to start over") from e
    saved_fp = ckpt.fingerprint
    changed = sorted(k for k in set(fingerprint) | set(saved_fp) if fingerprint.get(k) != saved_fp.get(k))
    if changed:
        raise ValueError(
            f"{path} belongs to a run with other settings ({', '.join(changed)} differ): "
            "use the same arguments to resume, or another --output"
        )
    return ckpt


def resume(output, fingerprint: dict, modules: dict, optimizer, scheduler, shuffle) -> tuple[list[dict], int]:
    """Load `output`'s checkpoint into the (not yet `accelerator.prepare`d) training state, if there is one.
    Returns the finished epochs' records and the first epoch to train."""
    ckpt = load_checkpoint(output, fingerprint)
    if ckpt is None:
        return [], 0
    for name, module in modules.items():
        module.load_state_dict(ckpt.modules[name])
    optimizer.load_state_dict(ckpt.optimizer)
    if scheduler is not None:
        scheduler.load_state_dict(ckpt.scheduler)
    shuffle.set_state(ckpt.shuffle)
    print(f"resuming from {checkpoint_path(output)}: {ckpt.epochs_done} epoch(s) done", flush=True)
    return list(ckpt.history), ckpt.epochs_done


def save_epoch(output, fingerprint: dict, history: list[dict], modules: dict, optimizer, scheduler, shuffle) -> None:
    """Write the state after `len(history)` epochs (main process only)."""
    save_checkpoint(
        output,
        EpochCheckpoint(
            epochs_done=len(history),
            history=history,
            modules={name: {k: v.detach().cpu() for k, v in m.state_dict().items()} for name, m in modules.items()},
            optimizer=optimizer.state_dict(),
            scheduler=None if scheduler is None else scheduler.state_dict(),
            shuffle=shuffle.get_state(),
            fingerprint=fingerprint,
        ),
    )
