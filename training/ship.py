"""Copy trained heads into the package (`hf_bpd/assets/<name>`), with what the model card needs:
drafter settings (drafter.json), the training log and the distillation manifest."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from hf_bpd.heads import BlockDraftHeads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.ship", description=__doc__.split("\n")[0])
    parser.add_argument("--heads", required=True, help="train-heads output folder")
    parser.add_argument("--distilled", required=True, help="distill output folder (for manifest.json)")
    parser.add_argument("--drafter", required=True, help="drafter.json from tune_drafter")
    parser.add_argument("--to", default="hf_bpd/assets/smollm2")
    args = parser.parse_args(argv)

    settings = json.loads(Path(args.drafter).read_text())
    heads = BlockDraftHeads.from_pretrained(args.heads)
    num_heads = settings.pop("num_heads", heads.num_heads)
    if num_heads < heads.num_heads:
        heads = heads.first_heads(num_heads)
    dest = Path(args.to)
    # replace the heads and their records only: the rescorers shipped beside them (ngram/, rescorer/,
    # rescorers.json) stay
    if (dest / "heads").exists():
        shutil.rmtree(dest / "heads")
    (dest / "heads").mkdir(parents=True)
    heads.save_pretrained(dest / "heads")
    (dest / "drafter.json").write_text(json.dumps(settings, indent=2) + "\n")
    shutil.copy(Path(args.heads) / "training_log.json", dest / "training_log.json")
    shutil.copy(Path(args.distilled) / "manifest.json", dest / "manifest.json")
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"shipped {num_heads} heads to {dest} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
