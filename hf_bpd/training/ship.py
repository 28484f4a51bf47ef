"""Copy trained heads into the package (`hf_bpd/assets/<name>`), with what the model card needs:
drafter settings (drafter.json), the training log, the distillation manifests (one per distilled run the
heads were trained on, each with the number of samples it really holds) and, with --bench, the τ measured
with them (bench.json); then write their model card, `model_cards/<packaged model>.md`, from the template.

`--cards` writes every shipped head set's card again from the assets (after a template change);
`--check` only compares: exit status 1, naming the cards that differ, when one is not what the assets give;
`--lm-head-sketch` records the packaged models' LM-head sketch (`hf_bpd.drafting.heads.lm_head_sketch`) in the
configs of every head set and rescorer shipped for them, their weights untouched."""

from __future__ import annotations

import argparse
import difflib
import json
import shutil
import sys
from pathlib import Path

from hf_bpd.card import CHECKOUT_CARDS, bench_summary, load_json, precision_summary, render_card
from hf_bpd.drafting.corpus import CorpusIndex
from hf_bpd.drafting.files import CORPUS_FILE, drafting_module, drafting_module_class
from hf_bpd.drafting.heads import BlockDraftHeads, lm_head_identity
from hf_bpd.io.packaged import HEAD_KINDS, SHIPPED_ASSETS
from hf_bpd.training.distill import load_distilled

PACKAGE = Path(__file__).resolve().parents[1]


def shipped_card(name: str | None, assets: str | Path | None = None) -> str:
    """The card of a shipped head set, from its assets alone (heads config, drafter.json, training_log.json,
    manifest.json, bench.json): of packaged model `name` (its assets folder unless `assets` is given), or
    with `name` None of heads shipped elsewhere (`assets`), loaded from a "<repo_id>" in the card."""
    assets = Path(assets) if assets is not None else PACKAGE / SHIPPED_ASSETS[name]
    settings = load_json(assets / "drafter.json") or {}
    settings.pop("num_heads", None)
    return render_card(
        drafting_module_class(assets / "heads").config_class.from_pretrained(assets / "heads"),
        training_log=load_json(assets / "training_log.json"),
        bench=load_json(assets / "bench.json"),
        manifest=load_json(assets / "manifest.json"),
        top_k=settings.get("top_k", 10),
        max_tree_tokens=settings.get("max_tree_tokens", "auto"),
        packaged=name,
        settings=settings,
        precision=load_json(assets / "precision.json"),
    )


def shipped_head_sets() -> dict[str, Path]:
    """Packaged model -> its assets folder, for those that ship heads now."""
    return {
        name: PACKAGE / folder
        for name, folder in SHIPPED_ASSETS.items()
        if (PACKAGE / folder / "heads" / "config.json").is_file()
    }


def check_cards(cards: Path = CHECKOUT_CARDS, write: bool = False) -> list[str]:
    """The shipped head sets whose card in `cards` is not what their assets give (missing or stale); with
    `write`, those cards are written again."""
    stale = []
    for name, assets in shipped_head_sets().items():
        card, path = shipped_card(name, assets), cards / f"{name}.md"
        if path.is_file() and path.read_text(encoding="utf-8") == card:
            continue
        stale.append(name)
        if write:
            path.write_text(card, encoding="utf-8")
        else:
            old = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
            sys.stdout.writelines(
                line + "\n"
                for line in difflib.unified_diff(old, card.splitlines(), str(path), "from the assets", lineterm="")
            )
    return stale


# the shipped rescorer that records its base model's LM head (`hf_bpd.drafting.rescoring.neural.save_truncated_lm`)
TRUNCATED_LM_CONFIG = Path("rescorer") / "truncated_lm.json"


def record_lm_head_sketch(name: str, assets: Path) -> list[Path]:
    """Record packaged model `name`'s LM-head sketch (`lm_head_identity`) in every config shipped in `assets`
    that names its base model by row sums (head sets, the truncated-LM rescorer), after checking that those
    row sums are this model's: the assets were trained on the packaged model, so its sketch is theirs. Written
    as each file was (transformers' config layout; the rescorer's own); weights untouched. Returns the files
    written."""
    from hf_bpd.io.packaged import load_packaged_model

    model, _ = load_packaged_model(name)
    identity = lm_head_identity(model.get_output_embeddings().weight)
    configs = [assets / folder / "config.json" for folder in HEAD_KINDS.values()] + [assets / TRUNCATED_LM_CONFIG]
    written = []
    for path in (p for p in configs if p.is_file()):
        text = path.read_text()
        config = json.loads(text)
        recorded = config.get("base_lm_head_fingerprint")
        if recorded is None:
            continue
        fresh = identity["base_lm_head_fingerprint"]
        if len(recorded) != len(fresh) or any(abs(a - b) > 1e-4 * (1 + abs(b)) for a, b in zip(recorded, fresh)):
            raise SystemExit(f"{path} records the row sums of another LM head than packaged {name}'s: not changed")
        config["base_lm_head_sketch"] = identity["base_lm_head_sketch"]
        if path.name == "config.json":  # as transformers writes a config
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:  # as save_truncated_lm writes it
            path.write_text(json.dumps(config, indent=2) + ("\n" if text.endswith("\n") else ""))
        written.append(path)
    return written


def write_bench(dest: Path, bench: str) -> None:
    """Record what the card's τ table shows (`hf_bpd.card.bench_summary` of an `hf-bpd bench` JSON) beside
    the heads, as `bench.json`."""
    summary = bench_summary(json.loads(Path(bench).read_text()))
    (dest / "bench.json").write_text(json.dumps(summary, indent=2) + "\n")


def write_precision(dest: Path, report: str) -> None:
    """Record what the card says of the base model in another precision (`hf_bpd.card.precision_summary` of a
    `research.perturbed_base_tau` JSON) beside the heads, as `precision.json`."""
    summary = precision_summary(json.loads(Path(report).read_text()))
    (dest / "precision.json").write_text(json.dumps(summary, indent=2) + "\n")


def packaged_name(dest: Path) -> str | None:
    """The packaged model whose assets folder `dest` is, if any."""
    return next((n for n, f in SHIPPED_ASSETS.items() if dest.resolve() == (PACKAGE / f).resolve()), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_bpd.training.ship", description=__doc__.split("\n")[0])
    parser.add_argument("--heads", help="train-heads (or train-eagle) output folder")
    parser.add_argument("--distilled", nargs="+", help="the distill output folders the heads were trained on")
    parser.add_argument("--drafter", help="drafter.json from tune_drafter")
    parser.add_argument(
        "--earlier-manifest",
        default=None,
        help="a shipped manifest.json whose runs stay recorded first, as they are: the data of the --init heads "
        "these heads continue (e.g. heads kept frozen while a context-copy pointer was trained on --distilled)",
    )
    parser.add_argument("--stage", default=None, help="what the --distilled runs trained, recorded on each of them")
    parser.add_argument(
        "--corpus",
        nargs="+",
        default=None,
        help="distill output folders whose answers become the drafter's retrieval corpus (corpus.npz beside the "
        "heads, named in drafter.json); without it a shipped corpus is removed",
    )
    parser.add_argument("--to", default="hf_bpd/assets/smollm2")
    parser.add_argument(
        "--bench", default=None, help="an `hf-bpd bench --output` JSON measured with these heads: the card's τ table"
    )
    parser.add_argument(
        "--card",
        default=None,
        help="where the model card goes (default: model_cards/<packaged model>.md where --to is a packaged "
        "model's assets folder, else README.md in --to)",
    )
    parser.add_argument(
        "--cards",
        action="store_true",
        help="only write every shipped head set's card again (with --bench: record it in --to first)",
    )
    parser.add_argument("--check", action="store_true", help="only check every shipped head set's card")
    parser.add_argument(
        "--precision",
        default=None,
        help="with --cards: a `research.perturbed_base_tau` JSON measured with the heads in --to, recorded for "
        "their card (τ on the base model perturbed)",
    )
    parser.add_argument(
        "--lm-head-sketch",
        action="store_true",
        help="only record each packaged model's LM-head sketch in the configs shipped for it (loads the models)",
    )
    args = parser.parse_args(argv)
    if args.lm_head_sketch:
        for name, assets in shipped_head_sets().items():
            for path in record_lm_head_sketch(name, assets):
                print(f"recorded {name}'s LM-head sketch in {path.relative_to(PACKAGE.parent)}")
        return 0
    if args.cards and args.bench:  # a measurement of heads shipped earlier, recorded before their card is written
        write_bench(Path(args.to), args.bench)
    if args.cards and args.precision:
        write_precision(Path(args.to), args.precision)
    if args.check or args.cards:
        stale = check_cards(write=args.cards)
        verb = "rewrote" if args.cards else "stale"
        print(f"{verb}: {', '.join(stale)}" if stale else "every shipped card is what its assets give")
        return 1 if stale and args.check else 0
    missing = [f"--{a}" for a in ("heads", "distilled", "drafter") if not getattr(args, a)]
    if missing:
        parser.error(f"shipping heads needs {', '.join(missing)} (or only --check / --cards)")

    settings = json.loads(Path(args.drafter).read_text())
    heads = drafting_module(args.heads)  # draft heads, or an EAGLE draft layer
    num_heads = settings.pop("num_heads", heads.num_heads)
    if isinstance(heads, BlockDraftHeads) and num_heads < heads.num_heads:
        heads = heads.first_heads(num_heads)
    dest = Path(args.to)
    # replace the heads and their records only: the rescorers shipped beside them (ngram/, rescorer/,
    # rescorers.json) stay
    if (dest / "heads").exists():
        shutil.rmtree(dest / "heads")
    (dest / "heads").mkdir(parents=True)
    heads.save_pretrained(dest / "heads")
    if args.corpus:
        CorpusIndex.from_answers(load_distilled(args.corpus)["response_ids"]).save(dest / CORPUS_FILE)
        settings["corpus"] = CORPUS_FILE
    elif (dest / CORPUS_FILE).exists():  # the earlier heads' corpus: these heads were not measured with it
        (dest / CORPUS_FILE).unlink()
    (dest / "drafter.json").write_text(json.dumps(settings, indent=2) + "\n")
    shutil.copy(Path(args.heads) / "training_log.json", dest / "training_log.json")
    earlier = json.loads(Path(args.earlier_manifest).read_text()) if args.earlier_manifest else None
    manifest = data_manifest(args.distilled, earlier, args.stage)
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if args.bench:
        write_bench(dest, args.bench)
    elif (dest / "bench.json").exists():  # what the earlier heads measured does not describe these
        (dest / "bench.json").unlink()
    name = packaged_name(dest)
    card = Path(args.card) if args.card else CHECKOUT_CARDS / f"{name}.md" if name else dest / "README.md"
    card.parent.mkdir(parents=True, exist_ok=True)
    card.write_text(shipped_card(name, dest), encoding="utf-8")
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    what = f"{num_heads} heads" if isinstance(heads, BlockDraftHeads) else "an EAGLE draft layer"
    print(f"shipped {what} to {dest} ({size / 1e6:.1f} MB); model card {card}")
    return 0


def data_manifest(distilled: list[str], earlier: dict | None = None, stage: str | None = None) -> dict:
    """The distillation manifest of one run, or {"runs": [...]} for several; each with what it holds
    (`distill.data_digest`: samples, response tokens, sha256; a run's `num_prompts` is its last --limit,
    which a longer run that was stopped rewrites), so a rerun of the recipe can be checked against it.
    `earlier`: a manifest whose runs come first, unchanged; `stage`: recorded on each of `distilled`."""
    from hf_bpd.training.distill import data_digest

    runs = [] if earlier is None else list(earlier.get("runs", [earlier]))
    for path in distilled:
        manifest = json.loads((Path(path) / "manifest.json").read_text())
        runs.append({**manifest, **data_digest(load_distilled(path)), **({"stage": stage} if stage else {})})
    return runs[0] if len(runs) == 1 else {"runs": runs}


if __name__ == "__main__":
    raise SystemExit(main())
