"""Copy trained heads into the package (`hf_bpd/assets/<name>`), with what the model card needs:
drafter settings (drafter.json), the training log and the distillation manifests (one per distilled run the
heads were trained on, each with the number of samples it really holds)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from hf_bpd.heads import BlockDraftHeads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_bpd.training.ship", description=__doc__.split("\n")[0])
    parser.add_argument("--heads", required=True, help="train-heads output folder")
    parser.add_argument(
        "--distilled", required=True, nargs="+", help="the distill output folders the heads were trained on"
    )
    parser.add_argument("--drafter", required=True, help="drafter.json from tune_drafter")
    parser.add_argument(
        "--earlier-manifest",
        default=None,
        help="a shipped manifest.json whose runs stay recorded first, as they are: the data of the --init heads "
        "these heads continue (e.g. heads kept frozen while a context-copy pointer was trained on --distilled)",
    )
    parser.add_argument("--stage", default=None, help="what the --distilled runs trained, recorded on each of them")
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
    earlier = json.loads(Path(args.earlier_manifest).read_text()) if args.earlier_manifest else None
    manifest = data_manifest(args.distilled, earlier, args.stage)
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"shipped {num_heads} heads to {dest} ({size / 1e6:.1f} MB)")
    return 0


def data_manifest(distilled: list[str], earlier: dict | None = None, stage: str | None = None) -> dict:
    """The distillation manifest of one run, or {"runs": [...]} for several; each with what it holds
    (`distill.data_digest`: samples, response tokens, sha256; a run's `num_prompts` is its last --limit,
    which a longer run that was stopped rewrites), so a rerun of the recipe can be checked against it.
    `earlier`: a manifest whose runs come first, unchanged; `stage`: recorded on each of `distilled`."""
    from hf_bpd.training.distill import data_digest, load_distilled

    runs = [] if earlier is None else list(earlier.get("runs", [earlier]))
    for path in distilled:
        manifest = json.loads((Path(path) / "manifest.json").read_text())
        runs.append({**manifest, **data_digest(load_distilled(path)), **({"stage": stage} if stage else {})})
    return runs[0] if len(runs) == 1 else {"runs": runs}


if __name__ == "__main__":
    raise SystemExit(main())
