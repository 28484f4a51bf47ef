"""Per-epoch training checkpoints, so an interrupted `hf-bpd train-heads` resumes where it stopped.

The training state is accelerate's own: after each epoch `Accelerator.save_state` writes the prepared
modules, the optimizer, the LR schedule, the mixed-precision scaler and every process's RNG states, plus
the objects registered for checkpointing (`track`): the data loader's shuffle generator and trained weights
that are not a prepared module's (joint mode's LoRA adapter; `skip_module_in_state` keeps accelerate from
writing the whole frozen base model). Beside them `run.json` holds the epochs done, their validation
records and the run's fingerprint (every training argument plus a digest of the distilled samples).

Layout: `OUTPUT/checkpoint/epoch-N/` per saved epoch and `OUTPUT/checkpoint/latest`, which names the newest
complete one. `latest` is replaced (atomically) only after its folder is complete, so an interruption
while saving leaves the previous epoch's checkpoint in force. Re-running the same command loads it and
trains only the epochs that are left; because the shuffle order, the optimizer, the schedule and the RNG
streams continue exactly, the resumed run ends with the same weights, bit for bit, as an uninterrupted one.
A checkpoint of other settings or other data is refused with the differing arguments named, rather than
silently mixing two runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch

# arguments that do not change what is trained: where it is written or read from, and how it is logged
_NOT_TRAINING = ("output", "features_cache", "device", "log_every", "no_progress", "model")
# options added after runs were checkpointed: at these defaults (what those runs trained with) they are left
# out of the fingerprint, so such runs still resume
_LATER_OPTIONS = {
    "feature_layers": None,
    "own_prediction": 0.0,
    "own_top_k": 1,
    "chain": "none",
    "prompt_positions": False,
}


class GeneratorState:
    """A `torch.Generator` (the data loader's shuffle order) as an accelerate checkpoint object."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["state"])


def run_fingerprint(args: argparse.Namespace, data_digest: str) -> dict:
    """What must match for a checkpoint to continue this run: the training arguments and the data."""
    fp = {
        k: v
        for k, v in sorted(vars(args).items())
        if k not in _NOT_TRAINING and not (k in _LATER_OPTIONS and v == _LATER_OPTIONS[k])
    }
    fp["data"] = data_digest
    return json.loads(json.dumps(fp, default=str))  # as run.json will hold it (paths as text, tuples as lists)


def checkpoint_root(output: str | Path) -> Path:
    return Path(output) / "checkpoint"


def latest_checkpoint(output: str | Path) -> Path | None:
    """The newest complete epoch folder under `output`, or None before the first epoch ends."""
    latest = checkpoint_root(output) / "latest"
    return checkpoint_root(output) / latest.read_text().strip() if latest.is_file() else None


def read_run(folder: Path) -> dict:
    """A checkpoint folder's `run.json` (epochs_done, history, fingerprint)."""
    try:
        run = json.loads((folder / "run.json").read_text())
        if not {"epochs_done", "history", "fingerprint"} <= set(run):
            raise ValueError("keys missing")
    except (OSError, ValueError) as e:  # truncated by hand, deleted, another format: name the folder
        raise ValueError(f"{folder} is not a readable train-heads checkpoint ({e}); delete it to start over") from e
    return run


def track(accelerator, shuffle: torch.Generator, *objects) -> None:
    """Register what `save_state` does not hold by itself: the shuffle generator, then `objects` (each with
    state_dict / load_state_dict). Call in the same order in every run, before `resume`."""
    accelerator.register_for_checkpointing(GeneratorState(shuffle), *objects)


def skip_module_in_state(accelerator, module) -> None:
    """Keep accelerate's save_state / load_state off the prepared `module` (its trained part is tracked on
    its own, e.g. a LoRA adapter over a frozen base model that would otherwise be written whole)."""

    target = accelerator.unwrap_model(module)

    def skipped(model) -> bool:  # prepared modules may come wrapped (DistributedDataParallel, compiled)
        return accelerator.unwrap_model(model) is target

    def on_save(models, weights, output_dir):
        del weights[next(i for i, m in enumerate(models) if skipped(m))]

    def on_load(models, input_dir):
        models[:] = [m for m in models if not skipped(m)]

    accelerator.register_save_state_pre_hook(on_save)
    accelerator.register_load_state_pre_hook(on_load)


def resume(accelerator, output, fingerprint: dict) -> tuple[list[dict], int]:
    """Load `output`'s newest checkpoint into the prepared training state (and the `track`ed objects), after
    checking that it belongs to this run. Returns the finished epochs' records and the first epoch to
    train."""
    folder = latest_checkpoint(output)
    if folder is None:
        return [], 0
    run = read_run(folder)
    saved = run["fingerprint"]
    changed = sorted(k for k in set(fingerprint) | set(saved) if fingerprint.get(k) != saved.get(k))
    if changed:
        raise ValueError(
            f"{folder} belongs to a run with other settings ({', '.join(changed)} differ): "
            "use the same arguments to resume, or another --output"
        )
    accelerator.load_state(folder)
    if accelerator.is_main_process:
        print(f"resuming from {folder}: {run['epochs_done']} epoch(s) done", flush=True)
    return list(run["history"]), run["epochs_done"]


def save_epoch(accelerator, output, fingerprint: dict, history: list[dict]) -> Path:
    """Write the state after `len(history)` epochs. Every process calls it (each saves its RNG state)."""
    root = checkpoint_root(output)
    folder = root / f"epoch-{len(history)}"
    if accelerator.is_main_process and folder.exists():  # left by an interrupted save: never `latest`
        shutil.rmtree(folder)
    accelerator.wait_for_everyone()
    accelerator.save_state(folder)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        run = {"epochs_done": len(history), "history": history, "fingerprint": fingerprint}
        (folder / "run.json").write_text(json.dumps(run, indent=1))
        tmp = root / "latest.tmp"
        tmp.write_text(folder.name)
        os.replace(tmp, root / "latest")  # atomic: the new epoch's folder is complete from here on
        for old in root.glob("epoch-*"):
            if old != folder:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return folder
