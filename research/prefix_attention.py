"""Issue #59: do the draft heads draft better when they read, instead of the base model's last hidden state at t
alone, that state after one causal attention layer over the answer's earlier hidden states (Hydra++'s prefix
layer)? Teacher-forced accuracy and lattice oracle on held-out distilled answers, from a features cache that
`hf-bpd train-heads` wrote: the given heads as they are, continued without the layer, and continued with it,
the same samples in the same order and the same steps, in one run.

    python -m research.prefix_attention --model gemma-3-270m --data training/data/distilled_gemma3_270m \\
        --heads hf_bpd/assets/gemma3_270m/heads --features-cache runs/gemma_heads2/features --skip 1024 \\
        --samples 2048 --output benchmarks/prefix_attention/gemma3_270m_2k.json

The layer attends over answer positions only (the cache holds no prompt positions), so it sees less context
in training and here than it would in decoding. Its output projection starts at zero: it begins as the
identity, and the arm with it starts where the arm without it does.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from hf_bpd.drafting.heads import BlockDraftHeads, RMSNorm
from hf_bpd.training.objective import draft_index, heads_loss, loss_weights
from hf_bpd.training.train_heads import Features, cached_features, evaluate, split_by_sample, teacher_rows


class PrefixAttention(nn.Module):
    """x + W_o · attention(RMSNorm(x)) over earlier positions of the same sequence, rotary positions."""

    def __init__(self, hidden_size: int, head_dim: int = 64, rope_base: float = 10000.0) -> None:
        super().__init__()
        if hidden_size % head_dim:
            raise ValueError(f"hidden size {hidden_size} is not a multiple of the head size {head_dim}")
        self.heads, self.head_dim = hidden_size // head_dim, head_dim
        self.norm = RMSNorm(hidden_size)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.out.weight)  # the identity until trained
        inv_freq = rope_base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)[:, None] * self.inv_freq
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        first, second = x[..., ::2], x[..., 1::2]
        return torch.stack([first * cos - second * sin, first * sin + second * cos], dim=-1).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [B, L, H]`, sequences right-padded: causal attention never lets a real position read padding."""
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, is_causal=True)
        return x + self.out(attended.transpose(1, 2).reshape(b, n, -1))


def sample_spans(feats: Features) -> list[tuple[int, int]]:
    """(first row, end row) of each sample's consecutive rows."""
    change = (feats.sample[1:] != feats.sample[:-1]).nonzero().squeeze(1) + 1
    edges = [0, *change.tolist(), feats.sample.shape[0]]
    return list(zip(edges[:-1], edges[1:]))


def padded(hidden: torch.Tensor, spans: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, L, H]` float rows of the spans, right-padded, and the flat index of each real row in it."""
    width = max(end - start for start, end in spans)
    out = hidden.new_zeros(len(spans), width, hidden.shape[1], dtype=torch.float32)
    where = []
    for i, (start, end) in enumerate(spans):
        out[i, : end - start] = hidden[start:end].float()
        where.append(torch.arange(end - start) + i * width)
    return out, torch.cat(where)


def transformed(prefix: PrefixAttention | None, feats: Features, spans, batch: int = 16) -> Features:
    """`feats` with every row's hidden state through the prefix layer (as is without one)."""
    if prefix is None:
        return feats
    out = torch.empty(feats.hidden.shape, dtype=torch.float32)
    with torch.no_grad():
        for s in range(0, len(spans), batch):
            part = spans[s : s + batch]
            x, where = padded(feats.hidden, part)
            y = prefix(x).flatten(0, 1)[where]
            out[part[0][0] : part[-1][1]] = y
    return Features(out, feats.targets, feats.next_token, feats.sample, feats.in_prompt)


def train_arm(heads, prefix, feats, spans, teacher, args) -> list[float]:
    """Continue `heads` (and train `prefix`, when given) on the spans' rows, `args.batch_samples` samples a
    step in one fixed order; returns the mean loss of each tenth of the run."""
    torch.manual_seed(args.seed)
    params = [p for p in heads.parameters() if p.requires_grad]
    if prefix is not None:
        params += list(prefix.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    order = torch.randperm(len(spans), generator=torch.Generator().manual_seed(args.seed)).tolist()
    steps = math.ceil(len(order) / args.batch_samples) * args.epochs
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))
    )
    vocab_index = draft_index(heads)
    weights = loss_weights(heads.num_heads, args.loss_decay)
    width = heads.config.hidden_size
    losses, step = [], 0
    heads.train()
    for _ in range(args.epochs):
        for s in range(0, len(order), args.batch_samples):
            part = [spans[i] for i in order[s : s + args.batch_samples]]
            rows = torch.cat([torch.arange(a, b) for a, b in part])
            x, where = padded(feats.hidden, part)
            hidden = (prefix(x) if prefix is not None else x).flatten(0, 1)[where]
            teacher_row = teacher[rows]
            teacher_hidden = feats.hidden[teacher_row.clamp(min=0)][..., -width:].float()
            teacher_hidden[teacher_row < 0] = float("nan")
            loss, _ = heads_loss(
                heads,
                hidden,
                feats.targets[rows],
                weights,
                vocab_index,
                feats.next_token[rows],
                teacher_hidden,
                args.teacher_weight,
            )
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
            step += 1
            if step % 50 == 0:
                print(f"step {step}/{steps} loss {sum(losses[-50:]) / 50:.4f}", flush=True)
    heads.eval()
    tenth = max(1, len(losses) // 10)
    return [sum(losses[i : i + tenth]) / len(losses[i : i + tenth]) for i in range(0, len(losses), tenth)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="packaged")
    parser.add_argument("--data", nargs="+", required=True, help="the distilled folders the cache was written for")
    parser.add_argument("--heads", required=True, help="saved heads both arms continue from")
    parser.add_argument("--features-cache", required=True, help="hf-bpd train-heads' features folder")
    parser.add_argument("--samples", type=int, default=1024, help="distilled samples trained and held out")
    parser.add_argument(
        "--skip", type=int, default=0, help="the samples start after this many (those the given heads saw)"
    )
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-samples", type=int, default=4, help="samples a step (up to 128 rows each)")
    parser.add_argument("--teacher-weight", type=float, default=0.5)
    parser.add_argument("--loss-decay", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)

    from hf_bpd.io.models import load_model
    from hf_bpd.tools.bench import environment
    from hf_bpd.training.distill import load_distilled

    data = load_distilled(args.data)
    if args.skip + args.samples > len(data):
        raise SystemExit(f"--skip {args.skip} --samples {args.samples}: the distilled folders hold {len(data)} samples")
    data = data.select(range(args.skip + args.samples))
    model, _ = load_model(args.model, device="cpu", with_tokenizer=False)
    reference = BlockDraftHeads.from_pretrained(args.heads).bind(model)
    feats = cached_features(model, data, reference.num_heads, args.features_cache, progress=False)
    feats = feats.select(feats.sample >= args.skip)
    feats.sample -= args.skip
    teacher = teacher_rows(feats, reference.num_heads)
    train_index, val_index = split_by_sample(feats, args.val_fraction, args.seed)
    held_out = set(feats.sample[val_index].tolist())
    train_spans = [s for s in sample_spans(feats) if int(feats.sample[s[0]]) not in held_out]
    val = feats.select(val_index)
    val_spans = sample_spans(val)
    print(f"{len(train_spans)} training samples ({train_index.numel()} rows), {len(val_spans)} held out", flush=True)

    results = {"as given": evaluate(reference, val, args.top_k)}
    arms = {}
    for name, with_prefix in (("continued", False), ("continued with prefix attention", True)):
        heads = BlockDraftHeads.from_pretrained(args.heads).bind(model)
        prefix = PrefixAttention(heads.config.hidden_size) if with_prefix else None
        t0 = time.perf_counter()
        curve = train_arm(heads, prefix, feats, train_spans, teacher, args)
        results[name] = {
            **evaluate(heads, transformed(prefix, val, val_spans), args.top_k),
            "loss_by_tenth": curve,
            "seconds": time.perf_counter() - t0,
        }
        arms[name] = prefix
        print(name, json.dumps(results[name]), flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"environment": environment("cpu", "float32"), "args": vars(args), "results": results}
    out.write_text(json.dumps(record, indent=2) + "\n")
    for name, r in results.items():
        top1 = " ".join(f"{x:.3f}" for x in r["top1"])
        print(f"{name:34s} top1 {top1}  oracle {r[f'oracle_top{args.top_k}']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
