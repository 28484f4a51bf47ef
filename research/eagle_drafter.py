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

The EAGLE drafter: fc([embedding(token t+1), feature t]) → one Llama decoder layer (initialised from the base
model's last layer; attention over the features of every earlier position of the context, the prompt's
included, and over its own drafts of this chain) → RMSNorm (initialised from the base's final norm) → the base
model's LM head rows of the heads' draft vocabulary. Trained on distilled answers (prompt and answer positions)
to regress the base model's next feature (smooth L1) and to match its next-token distribution over the draft
vocabulary (cross-entropy, weight 0.1), EAGLE's losses; `--train-depth` > 1 unrolls it on its own predicted
features in training too (EAGLE-3's training-time test).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from hf_bpd.drafting.heads import RMSNorm

DEPTH = 5


@torch.no_grad()
def sequence_features(model, seqs: list[list[int]], batch_tokens: int = 4096) -> list[torch.Tensor]:
    """The base model's final hidden state (after its final norm: what its LM head reads) at every position of
    each token sequence, float16 `[len, hidden]`; length-sorted, right-padded batches."""
    from hf_bpd.training.objective import length_sorted_batches, right_padded

    rows = [{"prompt_ids": s, "response_ids": []} for s in seqs]
    out: list[torch.Tensor | None] = [None] * len(seqs)
    for batch in length_sorted_batches(rows, batch_tokens):
        _, ids, mask = right_padded([rows[i] for i in batch])
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        for b, i in enumerate(batch):
            out[i] = hidden[b, : len(seqs[i])].half().clone()
    return out  # type: ignore[return-value]


def cached_sequences(model, name: str, seqs: list[list[int]], starts: list[int], cache: Path, chunk: int = 256):
    """[(tokens [L], features [L, H] float16, answer start)] for `seqs`, computed in chunks of `chunk` sequences
    cached under `cache/<name>-<first>-<end>.pt` (a rerun resumes at the first missing chunk)."""
    cache.mkdir(parents=True, exist_ok=True)
    items = []
    for first in range(0, len(seqs), chunk):
        end = min(first + chunk, len(seqs))
        path = cache / f"{name}-{first:06d}-{end:06d}.pt"
        if path.exists():
            part = torch.load(path)
        else:
            t0 = time.perf_counter()
            part = sequence_features(model, seqs[first:end])
            torch.save(part, path)
            tokens = sum(len(s) for s in seqs[first:end])
            print(f"{name} features {first}-{end}: {tokens} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
        items += [(torch.tensor(s), f, a) for s, f, a in zip(seqs[first:end], part, starts[first:end])]
    return items


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class EagleDrafter(nn.Module):
    """EAGLE's drafter on a Llama-style base model (module docstring)."""

    def __init__(self, model, draft_vocab: torch.Tensor, start_as_identity: bool = False) -> None:
        super().__init__()
        cfg = model.config
        hidden = cfg.hidden_size
        base = model.model.layers[-1]
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or hidden // self.heads
        # both inputs normalised (EAGLE-3): the final state's scale is not that of the residual stream the
        # copied layer adds its outputs to, and a raw one would drown them
        self.token_norm, self.feature_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.fc = nn.Linear(2 * hidden, hidden)
        self.input_norm = copy.deepcopy(base.input_layernorm)
        attention = base.self_attn
        self.q, self.k, self.v, self.o = (
            copy.deepcopy(getattr(attention, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")
        )
        self.post_norm = copy.deepcopy(base.post_attention_layernorm)
        self.mlp = copy.deepcopy(base.mlp)
        self.out_norm = copy.deepcopy(model.model.norm)
        self.requires_grad_(True)  # the copies of a frozen base model's modules are frozen too
        if start_as_identity:  # the prediction starts as the feature itself, as the heads' residual blocks do
            with torch.no_grad():
                self.fc.weight.zero_()
                self.fc.weight[:, hidden:].copy_(torch.eye(hidden))
                self.fc.bias.zero_()
                self.o.weight.zero_()
                self.mlp.down_proj.weight.zero_()
        self.rotary = model.model.rotary_emb
        self.register_buffer("draft_vocab", draft_vocab.clone(), persistent=True)
        lm_head = model.get_output_embeddings().weight.detach()
        self.register_buffer("lm_rows", lm_head[draft_vocab].clone(), persistent=False)
        self.register_buffer("embedding", model.get_input_embeddings().weight.detach(), persistent=False)

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        return feature @ self.lm_rows.T

    def layer_input(self, feature: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """What the decoder layer reads: fc([normalised token embedding, normalised feature])."""
        return self.fc(torch.cat([self.token_norm(self.embedding[token]), self.feature_norm(feature)], -1))

    def step(self, feature, token, position, keys, values, mask):
        """One depth for rows `[B, R]`: input feature `[B, R, H]` and token `[B, R]` at `position [R]`; attends
        over `keys`/`values` (earlier depths, `[B, kv, C, d]`) and its own new key, `mask [R, C + R]`. Returns
        (predicted feature [B, R, H], keys, values with this depth's appended)."""
        b, r, _ = feature.shape
        x = self.layer_input(feature, token)
        h = self.input_norm(x)
        q = self.q(h).view(b, r, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, r, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, r, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, position[None])
        cos, sin = cos[:, None], sin[:, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        keys = k if keys is None else torch.cat([keys, k], 2)
        values = v if values is None else torch.cat([values, v], 2)
        group = self.heads // self.kv_heads
        attended = F.scaled_dot_product_attention(
            q, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1), attn_mask=mask
        )
        x = x + self.o(attended.transpose(1, 2).reshape(b, r, -1))
        x = x + self.mlp(self.post_norm(x))
        return self.out_norm(x), keys, values

    def unroll(self, features: torch.Tensor, tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Teacher-forced tokens, own features: for rows t = 0 .. L-2 of right-padded `features [B, L, H]` and
        `tokens [B, L]`, depth 1 reads (feature t, token t+1) with causal attention over depth 1's rows ≤ t
        (the context's true features); depth j reads (its predicted feature of depth j-1, token t+j) and attends
        over depth 1's rows ≤ t and its own chain's rows of depths 2..j. Returns the predicted features of
        each depth `[B, L-1, H]` (depth j's row t predicts the feature at t+j)."""
        b, length, _ = features.shape
        r = length - 1
        rows = torch.arange(r)
        causal = rows[None, :] <= rows[:, None]
        own = torch.eye(r, dtype=torch.bool)
        padded_tokens = F.pad(tokens, (0, depth))  # token t+j past the end: padding (its rows have no target)
        predicted, keys, values = [], None, None
        feature = features[:, :-1].float()
        for j in range(1, depth + 1):
            mask = torch.cat([causal] + [own] * (j - 1), 1)  # depth 1's rows ≤ t, then row t of each later depth
            feature, keys, values = self.step(feature, padded_tokens[:, j : j + r], rows + j - 1, keys, values, mask)
            predicted.append(feature)
        return predicted


def padded_batch(items) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """features [B, L, H] float32, tokens [B, L], lengths [B] of (tokens, features, start) items."""
    width = max(t.shape[0] for t, _, _ in items)
    hidden = items[0][1].shape[1]
    features = torch.zeros(len(items), width, hidden)
    tokens = torch.zeros(len(items), width, dtype=torch.long)
    for i, (t, f, _) in enumerate(items):
        features[i, : t.shape[0]] = f.float()
        tokens[i, : t.shape[0]] = t
    return features, tokens, torch.tensor([t.shape[0] for t, _, _ in items])


def eagle_loss(drafter: EagleDrafter, items, depth: int, cls_weight: float) -> torch.Tensor:
    """EAGLE's loss summed over depths: smooth L1 to the base's next feature plus `cls_weight` × cross-entropy
    to the base's next-token distribution over the draft vocabulary, over every row with a target."""
    features, tokens, lengths = padded_batch(items)
    predicted = drafter.unroll(features, tokens, depth)
    r = features.shape[1] - 1
    total = features.new_zeros(())
    for j, guess in enumerate(predicted, start=1):
        target_rows = torch.arange(r) + j
        valid = target_rows[None, :] < lengths[:, None]  # [B, R]
        target = features[:, target_rows.clamp(max=features.shape[1] - 1)]
        reg = F.smooth_l1_loss(guess[valid], target[valid])
        with torch.no_grad():
            teacher = F.softmax(drafter.logits(target[valid]), -1)
        cls = -(teacher * F.log_softmax(drafter.logits(guess[valid]), -1)).sum(-1).mean()
        total = total + reg + cls_weight * cls
    return total


def train(drafter: EagleDrafter, items, args) -> list[float]:
    """AdamW with warm-up and cosine decay, `args.batch_samples` sequences a step; mean loss by tenth."""
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(args.seed)).tolist()
    # batches of similar lengths (less padding), in a shuffled order of batches
    by_length = sorted(order, key=lambda i: items[i][0].shape[0])
    batches = [by_length[s : s + args.batch_samples] for s in range(0, len(by_length), args.batch_samples)]
    steps = len(batches) * args.epochs
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))
    )
    losses = []
    drafter.train()
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        shuffled = torch.randperm(len(batches), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
        for i in shuffled:
            loss = eagle_loss(drafter, [items[j] for j in batches[i]], args.train_depth, args.cls_weight)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
            if len(losses) % 50 == 0:
                print(
                    f"step {len(losses)}/{steps} loss {sum(losses[-50:]) / 50:.4f} ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    drafter.eval()
    tenth = max(1, len(losses) // 10)
    return [sum(losses[i : i + tenth]) / len(losses[i : i + tenth]) for i in range(0, len(losses), tenth)]


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
def eagle_hits(drafter: EagleDrafter, items, ks: list[int]) -> dict[int, torch.Tensor]:
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
        drafter = EagleDrafter(model, heads.draft_vocab, args.start_as_identity)
        t0 = time.perf_counter()
        curve = train(drafter, train_items, argparse.Namespace(**{**vars(args), "train_depth": depth}))
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
