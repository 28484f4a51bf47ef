"""Loading the output of joint (LoRA + heads) training."""

from __future__ import annotations

from pathlib import Path

from .drafter import BlockDrafter


def load_joint_model(model, path: str | Path, **drafter_kwargs):
    """Apply the LoRA adapter saved under `path/lora` to `model` (merged: no PEFT overhead at decode time)
    and load the heads saved at `path`. Returns `(merged_model, drafter)`."""
    from peft import PeftModel

    lora = Path(path) / "lora"
    if not (lora / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{lora} holds no LoRA adapter: is {path} the output of `--mode joint`?")
    merged = PeftModel.from_pretrained(model, lora).merge_and_unload()
    merged.eval()
    return merged, BlockDrafter.from_pretrained(path, **drafter_kwargs)
