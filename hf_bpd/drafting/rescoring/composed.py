"""Composing rescorers, and building them from a JSON spec (how the shipped rescorers are described).

A spec is a dict with "type":
  {"type": "ngram", "lm": "ngram/ngram.arpa.gz" | null, "alpha": .., "num_paths": .., "beam": ..,
   "context_weight": .., "context_order": ..}                       -> NgramRescorer (lm null: context only)
  {"type": "neural", "lm": "rescorer" (a folder), "alpha": ..}       -> NeuralRescorer
  {"type": "compose", "parts": [spec, ...]}                          -> ComposedRescorer
Relative paths are resolved against the folder holding the spec.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..lattice import Lattice, ScoredPath


class ComposedRescorer:
    """Several rescorers at once: their drafts are interleaved (first of each, then second of each, ...)
    without duplicates. The drafter ranks them by their acceptance estimates anyway."""

    def __init__(self, parts: list) -> None:
        if not parts:
            raise ValueError("ComposedRescorer needs at least one rescorer")
        self.parts = list(parts)

    @property
    def one_row_only(self) -> bool:
        return any(getattr(part, "one_row_only", False) for part in self.parts)

    def bind(self, model) -> None:
        for part in self.parts:
            if hasattr(part, "bind"):
                part.bind(model)

    def reset(self) -> None:
        for part in self.parts:
            if hasattr(part, "reset"):
                part.reset()

    def __call__(self, lattice: Lattice, context: torch.Tensor) -> list[list[ScoredPath]]:
        results = [part(lattice, context) for part in self.parts]
        merged = []
        for b in range(lattice.batch_size):
            seen, row = set(), []
            lists = [r[b] for r in results]
            for i in range(max(len(paths) for paths in lists)):
                for paths in lists:
                    if i < len(paths) and paths[i].tokens not in seen:
                        seen.add(paths[i].tokens)
                        row.append(paths[i])
            merged.append(row)
        return merged


def build_rescorer(spec: dict, folder: str | Path = ".", base_tokenizer=None):
    """A rescorer from its spec (see the module docstring). The rescorer keeps `spec` and `spec_folder`, so
    a drafter saved with it (`BlockDrafter.save_pretrained`) can save the spec and its files too."""
    rescorer = _build(spec, Path(folder), base_tokenizer)
    rescorer.spec, rescorer.spec_folder = spec, Path(folder)
    return rescorer


def save_spec(spec: dict, source: Path, target: Path, files: str = "rescorer") -> dict:
    """Copy the files a spec names (its "lm" entries, relative to `source`) into `target/files/` and
    return the spec with paths relative to `target`."""
    import shutil

    out = dict(spec)
    if spec.get("lm"):
        src = source / spec["lm"]
        rel = Path(files) / Path(spec["lm"]).name
        dst = target / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.resolve() != dst.resolve():  # saved back into the folder it was loaded from: already there
            shutil.copytree(src, dst, dirs_exist_ok=True) if src.is_dir() else shutil.copy(src, dst)
        out["lm"] = rel.as_posix()
    if spec.get("parts"):
        out["parts"] = [save_spec(part, source, target, f"{files}/{i}") for i, part in enumerate(spec["parts"])]
    return out


def _build(spec: dict, folder: Path, base_tokenizer):
    kind = spec.get("type")
    options = {k: v for k, v in spec.items() if k not in ("type", "lm", "parts", "description")}
    if kind == "ngram":
        from .ngram import NgramLM, NgramRescorer

        lm = NgramLM(folder / spec["lm"], tokenizer=base_tokenizer) if spec.get("lm") else None
        return NgramRescorer(lm, **options)
    if kind == "neural":
        from .neural import NeuralRescorer

        return NeuralRescorer.from_pretrained(folder / spec["lm"], base_tokenizer=base_tokenizer, **options)
    if kind == "compose":
        return ComposedRescorer([_build(part, folder, base_tokenizer) for part in spec["parts"]])
    raise ValueError(f"unknown rescorer type {kind!r} in spec {spec}")
