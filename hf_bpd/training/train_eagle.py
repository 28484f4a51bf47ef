"""`hf-bpd train-eagle`: train an EAGLE draft layer (`drafting/eagle.py`) on distilled answers.

    hf-bpd train-eagle --data training/data/distilled/distill2 --samples 4096 --heads hf_bpd/assets/smollm2/heads \\
        --features-cache runs/eagle/features --depth 3 --epochs 3 --output runs/eagle/layer

The base model's final hidden states over whole sequences (prompt and answer) are computed once and cached in
float16 chunks (bfloat16 where a value exceeds float16's range: `train_heads.stored_features`;
`--features-cache`, resumable). The layer is trained with EAGLE's losses at every row with a
target: smooth L1 from its predicted feature to the base model's next one, plus `--cls-weight` times the
cross-entropy to the base model's next-token distribution over the draft vocabulary; `--depth` > 1 unrolls
it on its own predictions (EAGLE-3's training-time test), the losses of every depth summed. With
`--feature-layers 2,15,-1` (EAGLE-3's fusion) the cache holds those layers' hidden states, concatenated
(captured by hooks, `layer_features.py`), in a folder of their own under `--features-cache`; the layer's rows
read their fusion, its predictions still target the final state. With an `--init` layer that reads the final
state alone, the fusion starts as the identity on it, so training continues from that layer's drafts. The draft
vocabulary is the `--heads`' (the heads shipped for the same model). The layer is saved to `--output` after
every epoch and every `--save-every` steps, with the run's settings and loss curve in `training_log.json` and
what `--resume` continues from (the same steps as an uninterrupted run) in `checkpoint.pt`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from ..drafting.eagle import EagleDraftLayer
from .train_heads import checked_loss, parse_feature_layers, stored_features

CHECKPOINT = "checkpoint.pt"  # beside the saved layer: the optimizer's and schedule's state, for --resume


@torch.no_grad()
def sequence_features(
    model, seqs: list[list[int]], batch_tokens: int = 4096, feature_layers: list[int] | None = None
) -> list[torch.Tensor]:
    """The base model's final hidden state (after its final norm: what its LM head reads) at every position of
    each token sequence, `[len, hidden]` as `train_heads.stored_features` keeps them; with `feature_layers`,
    those hidden states concatenated `[len, k * hidden]` (the final one last), captured by hooks.
    Length-sorted, right-padded batches."""
    from ..compat import last_hidden_state_request
    from ..drafting.heads import check_feature_layers
    from ..drafting.layer_features import LayerFeatures
    from .objective import length_sorted_batches, right_padded

    if feature_layers is not None and check_feature_layers(feature_layers) != list(feature_layers):
        raise ValueError(f"feature layers {feature_layers} are not in canonical order (the final state, -1, last)")

    rows = [{"prompt_ids": s, "response_ids": []} for s in seqs]
    out: list[torch.Tensor | None] = [None] * len(seqs)
    with LayerFeatures(model, feature_layers) if feature_layers else contextlib.nullcontext() as capture:
        for batch in length_sorted_batches(rows, batch_tokens):
            _, ids, mask = right_padded([rows[i] for i in batch])
            if feature_layers:  # the hooks follow the whole model's forward; its LM head runs on one position
                request = last_hidden_state_request(model)
                full = model(input_ids=ids, attention_mask=mask, output_hidden_states=request, logits_to_keep=1)
                hidden = capture.features(full)
            else:
                hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            for b, i in enumerate(batch):
                out[i] = stored_features(hidden[b, : len(seqs[i])])
    return out  # type: ignore[return-value]


def cached_sequences(
    model,
    name: str,
    seqs: list[list[int]],
    starts: list[int],
    cache: Path,
    chunk: int = 256,
    feature_layers: list[int] | None = None,
):
    """[(tokens [L], features [L, H] (`stored_features`), answer start)] for `seqs` ([L, k * H] with
    `feature_layers`), computed in chunks of `chunk` sequences cached under `cache/<name>-<first>-<end>.pt` (a
    rerun resumes at the first missing chunk and computes a chunk holding inf again; a chunk is named by its
    sequences' indices, so one cache serves one list of sequences and its extensions); the features of
    `feature_layers` in a folder of their own under `cache` (`train_heads.feature_cache_folder`)."""
    from .train_heads import feature_cache_folder

    cache = feature_cache_folder(cache, feature_layers)
    cache.mkdir(parents=True, exist_ok=True)
    items = []
    for first in range(0, len(seqs), chunk):
        end = min(first + chunk, len(seqs))
        path = cache / f"{name}-{first:06d}-{end:06d}.pt"
        part = torch.load(path) if path.exists() else None
        if part is not None and not all(torch.isfinite(f).all() for f in part):
            print(f"{path} holds inf (float16 overflowed before `stored_features`): computing it again", flush=True)
            part = None
        if part is None:
            t0 = time.perf_counter()
            part = sequence_features(model, seqs[first:end], feature_layers=feature_layers)
            torch.save(part, path)
            tokens = sum(len(s) for s in seqs[first:end])
            print(f"{name} features {first}-{end}: {tokens} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
        if any(f.shape[0] != len(s) for s, f in zip(seqs[first:end], part)):
            raise ValueError(f"{path} holds features of other sequences: delete it or use another --features-cache")
        items += [(torch.tensor(s), f, a) for s, f, a in zip(seqs[first:end], part, starts[first:end])]
    return items


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


def eagle_loss(layer: EagleDraftLayer, items, depth: int, cls_weight: float) -> torch.Tensor:
    """EAGLE's loss summed over depths: smooth L1 to the base's next final hidden state plus `cls_weight` x
    cross-entropy to the base's next-token distribution over the draft vocabulary, over every row with a
    target. Items' features of several layers hold the final state last."""
    features, tokens, lengths = padded_batch(items)
    predicted = layer.unroll(features, tokens, depth)
    features = features[..., -layer.config.hidden_size :]  # the final hidden state: the targets
    r = features.shape[1] - 1
    total = features.new_zeros(())
    for j, guess in enumerate(predicted, start=1):
        target_rows = torch.arange(r) + j
        valid = target_rows[None, :] < lengths[:, None]  # [B, R]
        target = features[:, target_rows.clamp(max=features.shape[1] - 1)]
        regression = F.smooth_l1_loss(guess[valid], target[valid])
        with torch.no_grad():
            teacher = F.softmax(layer.logits(target[valid]), -1)
        cross_entropy = -(teacher * F.log_softmax(layer.logits(guess[valid]), -1)).sum(-1).mean()
        total = total + regression + cls_weight * cross_entropy
    return total


def train(layer: EagleDraftLayer, items, args, save=None, resume: dict | None = None) -> list[float]:
    """AdamW with warm-up and cosine decay, `args.batch_samples` sequences of similar length a step, batches
    in a seeded shuffled order. `save(losses, optimizer, schedule)` after each epoch and every
    `args.save_every` steps (if set); `resume`: a state it saved (`steps_done`, `losses`, `optimizer`,
    `schedule`), with the layer's weights of that step already loaded, continues where it stopped (the same
    steps as an uninterrupted run). Returns every step's loss."""
    params = [p for p in layer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(args.seed)).tolist()
    by_length = sorted(order, key=lambda i: items[i][0].shape[0])
    batches = [by_length[s : s + args.batch_samples] for s in range(0, len(by_length), args.batch_samples)]
    steps = len(batches) * args.epochs
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))
    )
    losses: list[float] = []
    if resume is not None:
        optimizer.load_state_dict(resume["optimizer"])
        schedule.load_state_dict(resume["schedule"])
        losses = list(resume["losses"])
    layer.train()
    t0 = time.perf_counter()
    for epoch in range(len(losses) // len(batches), args.epochs):
        shuffled = torch.randperm(len(batches), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
        for i in shuffled[len(losses) - epoch * len(batches) :]:  # a resumed epoch: from its next batch
            loss = eagle_loss(layer, [items[j] for j in batches[i]], args.depth, args.cls_weight)
            checked_loss(loss, f"step {len(losses) + 1}").backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
            if len(losses) % 50 == 0:
                mean = sum(losses[-50:]) / 50
                print(f"step {len(losses)}/{steps} loss {mean:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
            at_save = len(losses) % len(batches) == 0 or (args.save_every and len(losses) % args.save_every == 0)
            if save is not None and at_save:
                layer.eval()
                save(losses, optimizer, schedule)
                layer.train()
    layer.eval()
    return losses


def training_items(model, args) -> list:
    """The `--samples` first distilled sequences with their cached features."""
    from .distill import load_distilled

    data = load_distilled(args.data)
    if args.samples > len(data):
        raise SystemExit(f"--samples {args.samples}: the distilled folders hold {len(data)} samples")
    rows = data.select(range(args.samples))
    return cached_sequences(
        model,
        "train",
        [r["prompt_ids"] + r["response_ids"] for r in rows],
        [len(r["prompt_ids"]) for r in rows],
        Path(args.features_cache),
        feature_layers=args.feature_layers,
    )


def changed_settings(saved: dict, settings: dict) -> list[str]:
    """The settings in which a run saved with `saved` differs from `settings`; an option newer than the run,
    missing from `saved`, had its default there, None."""
    return sorted(k for k in settings if saved.get(k) != settings[k])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-bpd train-eagle", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="packaged")
    parser.add_argument("--data", nargs="+", required=True, help="distilled folders, in order")
    parser.add_argument("--samples", type=int, required=True, help="the first N distilled sequences")
    parser.add_argument("--heads", required=True, help="heads of the same model: their draft vocabulary is used")
    parser.add_argument("--features-cache", required=True)
    parser.add_argument("--depth", type=int, default=3, help="unrolled depths in training (1: teacher-forced)")
    parser.add_argument("--max-depth", type=int, default=5, help="the deepest draft of a tree in decoding")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-samples", type=int, default=4)
    parser.add_argument("--cls-weight", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--init",
        default=None,
        help="a saved layer of the same model and draft vocabulary to start from (else the "
        "base model's last decoder layer)",
    )
    parser.add_argument(
        "--feature-layers",
        type=parse_feature_layers,
        default=None,
        help="hidden states the rows read a fusion of, e.g. 2,15,-1 (-1: the final one, which must be among them; "
        "default: the final one alone)",
    )
    parser.add_argument("--save-every", type=int, default=500, help="also save every N steps, for --resume")
    parser.add_argument(
        "--output", required=True, help="folder the layer is saved to (each epoch, every --save-every steps)"
    )
    parser.add_argument("--resume", action="store_true", help="continue the run saved in --output")
    args = parser.parse_args(argv)
    for name in ("samples", "depth", "max_depth", "epochs", "batch_samples", "save_every"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")

    output = Path(args.output)
    # what the steps depend on (not where they are saved, nor how often)
    settings = {k: v for k, v in vars(args).items() if k not in ("output", "resume", "save_every")}
    state = None  # before any expensive work: a run to continue, or one not to overwrite
    if (output / CHECKPOINT).is_file():
        if not args.resume:
            raise SystemExit(f"{output} holds a run already: pass --resume to continue it, or another --output")
        state = torch.load(output / CHECKPOINT, weights_only=False)
        changed = changed_settings(state["settings"], settings)
        if changed:
            raise SystemExit(f"--resume: {output} was trained with other settings ({', '.join(changed)})")
    if args.init is not None and state is None:
        try:
            init_config = EagleDraftLayer.saved_config(args.init)
        except ValueError as err:
            raise SystemExit(f"--init: {err}") from None
        if init_config.max_depth != args.max_depth:
            raise SystemExit(
                f"--init {args.init} drafts {init_config.max_depth} deep, not --max-depth {args.max_depth}"
            )

    from ..drafting.heads import BlockDraftHeads, normalise_feature_layers
    from ..drafting.layer_features import decoder_layers
    from ..io.models import load_model
    from ..tools.bench import environment

    model, _ = load_model(args.model, device="cpu")
    model.requires_grad_(False)
    heads = BlockDraftHeads.from_pretrained(args.heads).bind(model)  # checks the heads fit the model
    torch.manual_seed(args.seed)
    try:
        args.feature_layers = normalise_feature_layers(args.feature_layers, len(decoder_layers(model)))
    except ValueError as err:
        raise SystemExit(f"--feature-layers: {err}") from None
    if args.init is not None and state is None:
        saved_layers = init_config.feature_layers
        if saved_layers and saved_layers != args.feature_layers:
            raise SystemExit(
                f"--init {args.init} reads feature layers {saved_layers}: pass the same --feature-layers "
                f"({','.join(map(str, saved_layers))}), not {args.feature_layers}"
            )
    # the block a run continues (`--init`'s, or `--resume`'s own) keeps its kind: a layer saved before the base
    # layer's own norms were kept is a Llama-style block
    if state is not None:
        continued = EagleDraftLayer.saved_config(output)
    else:
        continued = init_config if args.init is not None else None
    base_norms = continued is None or continued.qk_norm or continued.sandwich_norms
    layer = EagleDraftLayer.for_base_model(
        model, heads.draft_vocab, args.max_depth, feature_layers=args.feature_layers, base_norms=base_norms
    )
    if args.init is not None and state is None:
        start = EagleDraftLayer.from_pretrained(args.init)
        start.check_compatible(model)  # trained on this model
        if not torch.equal(start.draft_vocab, layer.draft_vocab):
            raise SystemExit(f"--init {args.init} drafts over another vocabulary than --heads {args.heads}")
        # the draft vocabulary (equal, checked above) is saved only where it is not the whole vocabulary; a
        # fusion new to this run keeps its start, the identity on the final state
        missing, unexpected = layer.load_state_dict(start.state_dict(), strict=False)
        new_fusion = {k for k in missing if k.startswith("fusion.")} if start.fusion is None else set()
        if set(missing) - {"draft_vocab"} - new_fusion or unexpected:
            raise SystemExit(f"--init {args.init}: weights {sorted(set(missing) | set(unexpected))} do not fit")
    layer.requires_grad_(True)
    items = training_items(model, args)
    print(f"{len(items)} training sequences, {sum(t.shape[0] for t, _, _ in items)} tokens", flush=True)
    if state is not None:
        layer.load_state_dict(EagleDraftLayer.from_pretrained(output).state_dict())
        print(f"resuming after step {len(state['losses'])}", flush=True)
    env = environment("cpu", "float32")
    t0 = time.perf_counter() - (state["seconds"] if state else 0.0)

    def save(losses: list[float], optimizer, schedule) -> None:
        layer.save_pretrained(output)
        seconds = time.perf_counter() - t0
        epochs_done = round(len(losses) / math.ceil(len(items) / args.batch_samples), 3)
        checkpoint = {"settings": settings, "steps_done": len(losses), "losses": losses, "seconds": seconds}
        checkpoint.update(optimizer=optimizer.state_dict(), schedule=schedule.state_dict())
        torch.save(checkpoint, output / CHECKPOINT)
        log = {
            "environment": env,
            "args": vars(args),
            "epochs_done": epochs_done,
            "steps": len(losses),
            "seconds": seconds,
            "loss_by_50_steps": [sum(losses[i : i + 50]) / len(losses[i : i + 50]) for i in range(0, len(losses), 50)],
        }
        (output / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
        print(f"step {len(losses)} (epoch {epochs_done}) saved to {output}", flush=True)

    train(layer, items, args, save, state)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
