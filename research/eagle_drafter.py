"""Issue #59: would a drafter that drafts autoregressively on the base model's features (EAGLE's one decoder
layer over [feature at t, embedding of token t+1], predicting the feature at t+1, then fed its own prediction)
draft better than the shipped heads? Offline, on the model's own greedy answers to Spec-Bench dev: the accepted
drafts of a chain (top-1 at each depth) and of full top-k trees, for the shipped heads (without their pointer,
as the shipped drafter runs them), for heads of the same shape trained here on the same data (`--heads-control`)
and for EAGLE drafters trained here, all on the same positions in one run.

    python -m research.eagle_drafter --data training/data/distilled/distill2 --samples 4096 \\
        --heads hf_bpd/assets/smollm2/heads --features-cache runs/eagle/features --heads-control \\
        --train-depth 1 3 --epochs 2 --lr 1e-3 --cls-weight 1.0 --start-as-identity \\
        --output benchmarks/eagle/smollm2_eagle_4k.json

What is compared. For every answer position t of every dev turn, the base model's token t+1 is the bonus token
a step already has; the drafters draft tokens t+2 .. t+1+D (D = 5, the heads' depth). `accepted(k)`: how many
leading depths have the true token within the drafter's top k, given the true tokens before it (the tree that
expands each depth's top k, walked along the true answer), averaged over positions; k = 1 is a chain of D
nodes, whose τ is 1 + accepted(1). The heads read the true token before their target ("previous" input); the
EAGLE drafter reads it too, and at depth j > 1 reads its own predicted feature of depth j - 1, never the base
model's: what it would have in decoding.

The EAGLE drafter is hf_bpd's `EagleDraftLayer` (`hf_bpd/drafting/eagle.py`: fc([normalised embedding of token
t+1, normalised feature t]) → one Llama decoder layer started from the base model's last → a norm started from
its final one → the base model's LM-head rows of the heads' draft vocabulary), trained by `hf-bpd train-eagle`'s
loop (`hf_bpd/training/train_eagle.py`: EAGLE's smooth L1 to the next feature plus `--cls-weight` x cross-entropy
to the base's next-token distribution; `--train-depth` > 1 unrolls it on its own predictions, EAGLE-3's
training-time test). The claim `eagle_drafter_smollm2_4k` ran this study at 8e7e206, before the layer moved into
hf_bpd (its input norms then had eps 1e-6, the base's 1e-5 now).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_bpd.drafting.eagle import EagleDraftLayer
from hf_bpd.training.train_eagle import cached_sequences, padded_batch, train

DEPTH = 5


def accepted(hits: torch.Tensor) -> torch.Tensor:
    """Leading hits of `[n, D]` booleans: the accepted drafts of each row."""
    return hits.long().cumprod(1).sum(1)


def true_targets(tokens: torch.Tensor, t: int) -> torch.Tensor:
    """Tokens t+2 .. t+1+DEPTH, -1 past the end."""
    out = torch.full((DEPTH,), -1, dtype=torch.long)
    part = tokens[t + 2 : t + 2 + DEPTH]
    out[: part.shape[0]] = part
    return out


@torch.no_grad()
def heads_hits(heads, items, ks: list[int]) -> dict[int, torch.Tensor]:
    """{k: [n, D] hits} of the heads at every answer position t whose tokens t+1 and t+2 exist, item by item."""
    ids = heads.draft_vocab
    out = {k: [] for k in ks}
    for tokens, features, start in items:
        rows = torch.arange(max(start - 1, 0), tokens.shape[0] - 2)
        if rows.numel() == 0:
            continue
        targets = torch.stack([true_targets(tokens, int(t)) for t in rows])
        tokens_in = heads.teacher_forced_tokens(torch.cat([tokens[rows + 1, None], targets.clamp(min=0)], 1))
        logits = heads(features[rows].float(), tokens_in)  # [n, h, S]
        top = ids[logits.topk(max(ks), -1).indices]  # [n, h, kmax]
        for k in ks:
            out[k].append((top[..., :k] == targets[..., None]).any(-1) & (targets >= 0))
    return {k: torch.cat(v) for k, v in out.items()}


@torch.no_grad()
def eagle_hits(drafter: EagleDraftLayer, items, ks: list[int]) -> dict[int, torch.Tensor]:
    """{k: [n, D] hits} of the EAGLE drafter at every answer row, one item at a time (its whole context)."""
    out = {k: [] for k in ks}
    for item in items:
        tokens, _, start = item
        rows = torch.arange(max(start - 1, 0), tokens.shape[0] - 2)
        if rows.numel() == 0:
            continue
        features, tok, _ = padded_batch([item])
        predicted = drafter.unroll(features, tok, DEPTH)
        targets = torch.stack([true_targets(tokens, int(t)) for t in rows])
        top = torch.stack(
            [drafter.draft_vocab[drafter.logits(p[0, rows]).topk(max(ks), -1).indices] for p in predicted], 1
        )  # [n, D, kmax]
        for k in ks:
            out[k].append((top[..., :k] == targets[..., None]).any(-1) & (targets >= 0))
    return {k: torch.cat(v) for k, v in out.items()}


def summary(hits: dict[int, torch.Tensor]) -> dict:
    return {
        f"top{k}": {
            "accepted": float(accepted(h).float().mean()),
            "depth_hit_rate": h.float().mean(0).tolist(),
            "chain_tau_by_depth": [1 + float(accepted(h[:, :d]).float().mean()) for d in range(1, h.shape[1] + 1)],
        }
        for k, h in hits.items()
    }


def answer_features(items):
    """`train_heads.Features` of the items' answer positions (the rows the heads are trained on): position t
    from the last prompt token on, its targets tokens t+2 .. t+1+DEPTH."""
    from hf_bpd.training.objective import head_targets
    from hf_bpd.training.train_heads import Features

    hidden, targets, next_token, sample = [], [], [], []
    for i, (tokens, features, start) in enumerate(items):
        first = max(start - 1, 0)
        t = head_targets(tokens.tolist(), first, DEPTH)
        hidden.append(features[first : first + t.shape[0]])
        targets.append(t)
        next_token.append(tokens[first + 1 : first + 1 + t.shape[0]])
        sample.append(torch.full((t.shape[0],), i))
    n = sum(t.shape[0] for t in targets)
    return Features(
        torch.cat(hidden),
        torch.cat(targets),
        torch.cat(next_token),
        torch.cat(sample),
        torch.zeros(n, dtype=torch.bool),
    )


def heads_control(model, draft_vocab: torch.Tensor, items, args):
    """Heads of the shipped shape (DEPTH heads of one block, "previous" token input, the same draft
    vocabulary) trained from scratch on the items' answer positions, `research.prefix_attention`'s loop with
    the SmolLM2 recipe's objective (teacher weight 0.5, loss decay 0.8): the EAGLE drafter's control at equal
    data and epochs."""
    from hf_bpd.drafting.heads import BlockDraftHeads
    from hf_bpd.training.train_heads import teacher_rows
    from research.prefix_attention import sample_spans, train_arm

    torch.manual_seed(args.seed)
    heads = BlockDraftHeads.for_base_model(
        model, num_heads=DEPTH, num_layers=1, draft_vocab=draft_vocab, token_input="previous"
    )
    feats = answer_features(items)
    settings = argparse.Namespace(
        seed=args.seed,
        lr=args.heads_lr,
        epochs=args.epochs,
        batch_samples=args.batch_samples,
        loss_decay=0.8,
        teacher_weight=0.5,
    )
    curve = train_arm(heads, None, feats, sample_spans(feats), teacher_rows(feats, DEPTH), settings)
    return heads, curve


def dev_items(model, tokenizer, args) -> list:
    from hf_bpd.tools.bench import read_prompts
    from hf_bpd.tools.replay import answered_turns, read_answers

    _, answers = read_answers(args.eval_answers)
    seqs, starts = [], []
    for _, prompt, answer in answered_turns(tokenizer, read_prompts(args.eval_data), answers):
        ids = prompt[0].tolist()
        seqs.append(ids + list(answer))
        starts.append(len(ids))
    return cached_sequences(model, "dev", seqs, starts, Path(args.features_cache))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="packaged")
    parser.add_argument("--data", nargs="+", required=True, help="distilled folders to train on")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--heads", required=True, help="the heads compared against; their draft vocabulary is used")
    parser.add_argument("--eval-data", default="../shared/data/spec_bench_dev.jsonl")
    parser.add_argument("--eval-answers", default="benchmarks/replay/spec_bench_dev_greedy128.jsonl")
    parser.add_argument("--features-cache", required=True)
    parser.add_argument("--train-depth", type=int, nargs="+", default=[1, 3], help="one EAGLE drafter per depth")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--batch-samples", type=int, default=4)
    parser.add_argument("--cls-weight", type=float, default=0.1)
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--start-as-identity", action="store_true", help="fc passes the feature, attention and MLP outputs start at 0"
    )
    parser.add_argument("--heads-control", action="store_true", help="also train heads of the shipped shape here")
    parser.add_argument("--heads-lr", type=float, default=2e-3, help="the heads control's learning rate")
    parser.add_argument("--features-only", action="store_true")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    from hf_bpd.drafting.heads import BlockDraftHeads
    from hf_bpd.io.models import load_model
    from hf_bpd.tools.bench import environment
    from hf_bpd.training.distill import load_distilled

    data = load_distilled(args.data)
    if args.samples > len(data):
        raise SystemExit(f"--samples {args.samples}: the distilled folders hold {len(data)} samples")
    model, tokenizer = load_model(args.model, device="cpu")
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise SystemExit("this study needs a Llama-style base model (model.model.layers)")
    model.requires_grad_(False)
    heads = BlockDraftHeads.from_pretrained(args.heads).bind(model)
    heads.context_copy = None  # the shipped drafter runs the heads without their pointer
    dev = dev_items(model, tokenizer, args)
    rows = data.select(range(args.samples))
    train_items = cached_sequences(
        model,
        "train",
        [r["prompt_ids"] + r["response_ids"] for r in rows],
        [len(r["prompt_ids"]) for r in rows],
        Path(args.features_cache),
    )
    print(f"{len(train_items)} training sequences, {len(dev)} dev turns", flush=True)
    if args.features_only:
        return 0

    results = {"heads (shipped, no pointer)": summary(heads_hits(heads, dev, args.top_k))}
    print("heads", json.dumps(results["heads (shipped, no pointer)"]["top1"]), flush=True)
    if args.heads_control:
        t0 = time.perf_counter()
        control, curve = heads_control(model, heads.draft_vocab, train_items, args)
        name = "heads of the shipped shape, trained here"
        results[name] = {
            **summary(heads_hits(control, dev, args.top_k)),
            "loss_by_tenth": curve,
            "train_seconds": time.perf_counter() - t0,
        }
        print(name, json.dumps(results[name]["top1"]), flush=True)
    for depth in args.train_depth:
        torch.manual_seed(args.seed)
        drafter = EagleDraftLayer.for_base_model(model, heads.draft_vocab, DEPTH, args.start_as_identity)
        drafter.requires_grad_(True)  # the copies of a frozen base model's weights are frozen too
        t0 = time.perf_counter()
        losses = train(drafter, train_items, argparse.Namespace(**{**vars(args), "depth": depth}))
        tenth = max(1, len(losses) // 10)
        curve = [sum(losses[i : i + tenth]) / len(losses[i : i + tenth]) for i in range(0, len(losses), tenth)]
        name = f"EAGLE drafter, trained at depth {depth}"
        results[name] = {
            **summary(eagle_hits(drafter, dev, args.top_k)),
            "loss_by_tenth": curve,
            "train_seconds": time.perf_counter() - t0,
        }
        print(name, json.dumps(results[name]["top1"]), flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"environment": environment("cpu", "float32"), "args": vars(args), "results": results}
    out.write_text(json.dumps(record, indent=2) + "\n")
    for name, r in results.items():
        line = "  ".join(f"top{k} {r[f'top{k}']['accepted']:.3f}" for k in args.top_k)
        print(f"{name:40s} accepted drafts: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
