"""Train block draft heads on self-distilled data.

From the base model's last hidden state at position t, head i (1..h) learns the token at t+1+i (the base
model itself predicts t+1). Loss = sum_i w_i * L_i with per-head weights w_i (the paper's lambda_h), where
L_i = (1 - b) * CE(token t+1+i) + b * CE(the base model's own distribution over token t+1+i)
(`--teacher-weight b`). The distilled token is that distribution's argmax; the whole distribution also
says which other tokens the base model nearly chose, which is what a head's top-k in a draft tree needs.
It costs no extra base-model pass: the base model's logits for token t+1+i are its LM head on the cached
hidden state at position t+i (Hydra++'s teacher distillation, without running the teacher again).

Modes
  frozen  (Medusa-1) the base model is frozen: its last hidden states are computed once and cached to
          disk (`OUTPUT/features/`, in resumable chunks that a grown data set reuses), so an epoch only
          runs the small heads. Practical on a CPU.
  joint   (Medusa-2) the base model is adapted with LoRA (PEFT) together with the heads; the base model's
          own next-token loss is kept so its outputs stay what they were. Saves the heads at the output
          root and the adapter under `lora/`; `hf_bpd.load_joint_model` applies it.

Runs as is on one CPU/GPU or under `accelerate launch` on several GPUs or nodes (data parallel through
`accelerate.Accelerator`; mixed precision with `--mixed-precision bf16|fp16` where the device has it).

Heads reading several layers (`--feature-layers 2,15,-1`, `heads.py`): the cached features are those
layers' hidden states, concatenated (captured by forward hooks, `layer_features.py`), in a folder of their
own under the cache; the fusion learns with the heads. With `--init` last-layer heads, the fusion starts as
the identity on the final hidden state, so training continues from those heads' behaviour.

Own predictions (`--own-prediction p`, "previous" heads; EAGLE-3's training-time test): head i > 1 reads,
with probability p per position, the token the heads themselves put at depth i-1 (the previous head's top-1,
or a draw from its top `--own-top-k`) instead of the true token: what it reads in decoding.

Chained heads (`--chain state|beside`, "previous" heads): head i > 1 also reads head i-1's state (`heads.py`),
teacher forced along the true continuation. `--init` unchained heads gain the chain with their weights
("beside" starts drafting exactly as they do).

Deeper heads (`--num-layers` above the `--init` heads' own): each head gains residual blocks after its own,
starting at zero (the identity), so training continues from those heads' behaviour.

Prompt positions (`--prompt-positions`, frozen mode; Medusa-2's teacher-forced data):
the distilled samples' prompts are real text the model was not asked to write. Where it agrees with the
model's own greedy choices for i tokens in a row, the model's greedy token after them is exactly what head i
must draft there, so those positions are training rows at the cost of the forward already run (and one LM
head over the prompt). Their features live in a folder of their own under the cache.

Validation each epoch on held-out distilled samples: per-head top-1 / top-k accuracy, and the lattice
oracle (mean longest prefix of the true continuation inside the top-k lattice).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from hf_bpd.compat import last_hidden_state_request
from hf_bpd.drafting.heads import FINAL_HIDDEN_STATE, BlockDraftHeads, BlockDraftHeadsConfig, normalise_feature_layers
from hf_bpd.drafting.layer_features import LayerFeatures, decoder_layers
from hf_bpd.drafting.vocab import model_vocab_size
from hf_bpd.training.checkpoint import resume, run_fingerprint, save_epoch, track
from hf_bpd.training.copy_training import SampleTokens, copy_hits, copy_loss, copy_targets, feature_positions
from hf_bpd.training.objective import (
    IGNORE,
    agreeing_targets,
    chain_option,
    check_replicas_agree,
    draft_index,
    head_targets,
    heads_loss,
    initial_heads,
    length_sorted_batches,
    loss_weights,
    resolve_heads_shape,
    response_positions,
    right_padded,
    rows_digest,
    token_input,
)

TOKEN_INPUT_CHOICES = ("previous", "next", "none")  # --token-input; "none" is token_input ""


FLOAT16_MAX = torch.finfo(torch.float16).max


def stored_features(hidden: torch.Tensor) -> torch.Tensor:
    """Hidden states as training caches keep them: float16 where every value fits, else bfloat16 (float32's
    range at a coarser step). A raw residual stream can exceed float16's 65,504 (Gemma-3's middle layers do),
    and float16 would store inf there: the fusion's norm of an inf row is nan, and so is every loss after it."""
    return hidden.half() if hidden.abs().amax() <= FLOAT16_MAX else hidden.bfloat16()


def joined_features(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat` of stored hidden states, all in bfloat16 where any part needed it (`stored_features`)."""
    dtype = torch.bfloat16 if any(p.dtype == torch.bfloat16 for p in parts) else torch.float16
    return torch.cat([p.to(dtype) for p in parts])


def checked_loss(loss: torch.Tensor, step: str) -> torch.Tensor:
    """`loss`, or FloatingPointError where it is not finite: one nan step would make every weight nan (and
    saved so at the next save), so training stops before the optimizer takes it."""
    if not torch.isfinite(loss):
        raise FloatingPointError(f"{step}: the loss is {float(loss)}; training stopped before this step")
    return loss


@dataclass
class Features:
    """Cached training positions: hidden [n, H] (base last hidden state at t; with feature layers [n, k*H],
    their hidden states at t concatenated, the final one last), targets [n, h] (token at
    t+1+i for head i, IGNORE past the end), next_token [n] (token t+1: the base model's own choice, read
    by heads with a token input), sample [n] (index of the distilled sample), in_prompt [n] (a prompt
    position, teacher forced: `--prompt-positions`)."""

    hidden: torch.Tensor
    targets: torch.Tensor
    next_token: torch.Tensor
    sample: torch.Tensor
    in_prompt: torch.Tensor

    def select(self, index: torch.Tensor) -> Features:
        """The positions picked by a boolean mask or index tensor."""
        return Features(*(getattr(self, f.name)[index] for f in fields(self)))

    @staticmethod
    def from_saved(saved: dict) -> Features:
        """A cached chunk's features; chunks written before prompt positions existed hold answers alone."""
        saved.setdefault("in_prompt", torch.zeros(saved["sample"].shape[0], dtype=torch.bool))
        return Features(**{f.name: saved[f.name] for f in fields(Features)})

    @staticmethod
    def concat(parts: list[Features]) -> Features:
        join = {"hidden": joined_features}
        return Features(*(join.get(f.name, torch.cat)([getattr(p, f.name) for p in parts]) for f in fields(Features)))


def teacher_rows(feats: Features, num_heads: int) -> torch.Tensor:
    """[n, h]: for each position t and head i, the row of `feats` at position t+i of the same sample (its
    hidden state gives the base model's own distribution over token t+1+i, head i's target), -1 where
    head i has no target. Rows of one sample are consecutive positions (`compute_features`)."""
    n = feats.sample.shape[0]
    rows = torch.arange(n)[:, None] + torch.arange(1, num_heads + 1)[None]
    valid = (feats.targets[:, :num_heads] != IGNORE) & (rows < n)
    rows = rows.clamp(max=max(n - 1, 0))
    valid &= feats.sample[rows] == feats.sample[:, None]
    return torch.where(valid, rows, -1)


@torch.no_grad()
def compute_features(
    model,
    data,
    num_heads: int,
    batch_tokens: int = 4096,
    progress: bool = True,
    first_sample: int = 0,
    feature_layers: list[int] | None = None,
    prompt_positions: bool = False,
) -> Features:
    """Base last hidden states for every response position of every sample (length-sorted batches of at
    most `batch_tokens` padded tokens). Sample indices start at `first_sample`. With `feature_layers`
    (`output_hidden_states` indices), those layers' hidden states concatenated instead, captured by hooks
    (`layer_features.LayerFeatures`) rather than by keeping every layer's. `prompt_positions`: every prompt
    position too, before the answer's, with the targets of `agreeing_targets` (the model's greedy choices
    where the prompt's text agrees with them; positions without a target serve as teacher rows)."""
    import inspect

    from tqdm import tqdm

    device = next(model.parameters()).device
    # only hidden states are needed: skip the LM head on every position but one where the model allows it
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    hidden, targets, next_token, sample, in_prompt = [], [], [], [], []
    output_embeddings = model.get_output_embeddings() if prompt_positions else None
    bar = tqdm(total=len(data), disable=not progress, desc="features")
    capture = LayerFeatures(model, feature_layers) if feature_layers else contextlib.nullcontext()
    request = last_hidden_state_request(model) if feature_layers else True
    with capture:
        for batch in length_sorted_batches(data, batch_tokens):
            seqs, ids, mask = right_padded([data[j] for j in batch])
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=request, **extra)
            last = (capture.features(out) if feature_layers else out.hidden_states[-1]).float().cpu()
            del out
            for r, j in enumerate(batch):
                start = response_positions(len(data[j]["prompt_ids"]))
                first = 0 if prompt_positions else start
                if prompt_positions:  # the model's greedy choice at each prompt position: its LM head's argmax
                    width = last.shape[-1] // (len(feature_layers) if feature_layers else 1)
                    final = last[r, :start, -width:]  # the final hidden state: the features' last slice
                    weight = output_embeddings.weight
                    greedy = output_embeddings(final.to(device=weight.device, dtype=weight.dtype)).argmax(-1).cpu()
                    t = agreeing_targets(seqs[r], start, greedy, num_heads)
                else:
                    t = head_targets(seqs[r], start, num_heads)
                n = t.shape[0]
                hidden.append(stored_features(last[r, first : first + n]))
                targets.append(t)
                next_token.append(torch.tensor(seqs[r][first + 1 : first + 1 + n], dtype=torch.long))
                sample.append(torch.full((n,), first_sample + j, dtype=torch.long))
                in_prompt.append(torch.arange(first, first + n) < start)
            bar.update(len(batch))
    bar.close()
    return Features(
        joined_features(hidden), torch.cat(targets), torch.cat(next_token), torch.cat(sample), torch.cat(in_prompt)
    )


def feature_cache_folder(
    cache_dir: str | Path, feature_layers: list[int] | None, prompt_positions: bool = False
) -> Path:
    """Where the chunks of these features live: `cache_dir` itself for the final hidden state alone at the
    answers' positions (as always), a folder of their own for feature layers (`layers-2-15-final`) and for
    prompt positions (`with-prompts/`), so that caches of other features, e.g. one shared with last-layer
    runs, are never mistaken for them nor replaced."""
    folder = Path(cache_dir) / "with-prompts" if prompt_positions else Path(cache_dir)
    if not feature_layers:
        return folder
    names = ["final" if i == FINAL_HIDDEN_STATE else str(i) for i in feature_layers]
    return folder / ("layers-" + "-".join(names))


def cached_features(
    model,
    data,
    num_heads: int,
    cache_dir: str | Path,
    chunk: int = 512,
    progress: bool = True,
    feature_layers: list[int] | None = None,
    prompt_positions: bool = False,
) -> Features:
    """`compute_features` for all of `data`, cached on disk in chunks of samples
    (`features-<first>-<end>.pt`). An interrupted run resumes at the first missing chunk, and a grown data
    set only computes its new samples: existing chunk files are reused when they tile the data from
    sample 0 and hold the same samples (token digest) with enough heads and no inf; any other chunk is
    recomputed.
    Features of `feature_layers` are cached in their own folder (`feature_cache_folder`)."""
    cache_dir = feature_cache_folder(cache_dir, feature_layers, prompt_positions)
    cache_dir.mkdir(parents=True, exist_ok=True)

    def rows(start: int, end: int):  # a datasets.Dataset or a list
        return data.select(range(start, end)) if hasattr(data, "select") else data[start:end]

    def cached_chunk(folder: Path, covered: int, layers: int, own: bool):
        """(Features, end) of a chunk file in `folder` that starts at `covered` and holds these samples with
        enough heads, the final state's slice of `layers` concatenated states; (None, None) when none does.
        Stale files of this run's own folder are removed."""
        for path in sorted(folder.glob(f"features-{covered:07d}-*.pt")):
            end = int(path.stem.split("-")[2])
            if end > len(data):
                continue
            saved = torch.load(path)
            if saved["digest"] == rows_digest(rows(covered, end)) and saved["targets"].shape[1] >= num_heads:
                width = saved["hidden"].shape[1] // layers  # the final state: the last of them
                saved["hidden"] = saved["hidden"][:, -width:].clone() if layers > 1 else saved["hidden"]
                if torch.isfinite(saved["hidden"]).all():  # float16 that overflowed before `stored_features`: stale
                    return Features.from_saved(saved), end
            if own:
                path.unlink()  # other samples or fewer heads: stale
        return None, None

    # the final hidden state alone is the last slice of any layers' features that end with it: read from there
    # rather than computed again (a fusion run's cache serves its last-layer control)
    wider = [] if feature_layers else sorted(cache_dir.glob("layers-*-final"))
    sources = [(cache_dir, 1, True)] + [(folder, len(folder.name.split("-")) - 1, False) for folder in wider]
    parts, covered = [], 0
    while covered < len(data):
        part = None
        for folder, layers, own in sources:
            part, end = cached_chunk(folder, covered, layers, own)
            if part is not None:
                break
        if part is None:
            end = min(covered + chunk, len(data))
            new_rows = rows(covered, end)
            part = compute_features(
                model,
                new_rows,
                num_heads,
                progress=progress,
                first_sample=covered,
                feature_layers=feature_layers,
                prompt_positions=prompt_positions,
            )
            tmp = cache_dir / f".features-{covered:07d}-{end:07d}.tmp"
            torch.save({**part.__dict__, "digest": rows_digest(new_rows)}, tmp)
            tmp.replace(cache_dir / f"features-{covered:07d}-{end:07d}.pt")  # atomic: no half-written chunk
        part.targets = part.targets[:, :num_heads]
        parts.append(part)
        covered = end
    return Features.concat(parts)


def draft_vocabulary(data, size: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent tokens of the distilled responses and prompts (prompts matter for copying
    tasks: summaries, RAG), plus `always` (e.g. eos), as sorted token ids. Ties, including the many unseen
    tokens of a small data set, go to the lower BPE id: earlier merges are the more frequent ones."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for row in data:
        ids = torch.tensor(row["response_ids"] + row["prompt_ids"], dtype=torch.long)
        counts += torch.bincount(ids, minlength=vocab_size).double()
    counts[torch.tensor(always, dtype=torch.long)] = counts.max() + 1
    score = counts * vocab_size + (vocab_size - torch.arange(vocab_size, dtype=torch.float64))
    return score.topk(size).indices.sort().values


@torch.no_grad()
def evaluate(
    heads: BlockDraftHeads,
    feats: Features,
    top_k: int,
    batch: int = 512,
    sample_tokens: SampleTokens | None = None,
    positions: torch.Tensor | None = None,
) -> dict:
    """Per-head top-1 / top-k accuracy (over positions with a target) and the top-k lattice oracle. For
    "previous" heads the accuracies are given the true tokens before each target, and the oracle is that
    of a tree that expands each head's top-k: the longest true prefix whose every token is in its head's
    top-k given the true tokens before it. Context-copy heads are scored by their mixture, which needs
    the samples' tokens and each row's position (`copy_training.feature_positions`)."""
    with_copy = heads.context_copy is not None
    if with_copy and (sample_tokens is None or positions is None):
        raise ValueError("evaluating context-copy heads needs the samples' tokens and each row's position")
    device = next(heads.parameters()).device
    h = heads.num_heads
    hit1, hitk, count = torch.zeros(h), torch.zeros(h), torch.zeros(h)
    oracle_sum, n_pos = 0.0, 0
    ids = heads.draft_vocab
    for s in range(0, feats.hidden.shape[0], batch):
        x = feats.hidden[s : s + batch].to(device=device, dtype=heads.dtype)  # fused by the heads' forward
        t = feats.targets[s : s + batch].to(device)
        valid = t != IGNORE
        if with_copy:
            rows = slice(s, s + batch)
            read, targets = copy_targets(sample_tokens, feats.sample[rows], positions[rows], t.cpu(), None)
            top1, in_k = copy_hits(heads, x, read.to(device), targets.to(device), top_k)
        else:
            tokens = heads.teacher_forced_tokens(torch.cat([feats.next_token[s : s + batch, None].to(device), t], 1))
            logits = heads(x, tokens)  # [n, h, S]
            topk = ids[logits.topk(top_k, dim=-1).indices]  # token ids [n, h, k]
            in_k = (topk == t[..., None]).any(-1) & valid
            top1 = (topk[..., 0] == t) & valid
        hit1 += top1.sum(0).cpu().float()
        hitk += in_k.sum(0).cpu().float()
        count += valid.sum(0).cpu().float()
        oracle_sum += float(in_k.long().cumprod(dim=1).sum())
        n_pos += x.shape[0]
    return {
        "top1": (hit1 / count.clamp(min=1)).tolist(),
        f"top{top_k}": (hitk / count.clamp(min=1)).tolist(),
        f"oracle_top{top_k}": oracle_sum / max(n_pos, 1),
        "positions": n_pos,
    }


def split_by_sample(feats: Features, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices (train, val) of `feats`, holding out a `val_fraction` of the samples whole."""
    num_samples = int(feats.sample.max()) + 1
    g = torch.Generator().manual_seed(seed)
    val_samples = torch.randperm(num_samples, generator=g)[: max(1, int(num_samples * val_fraction))]
    is_val = torch.isin(feats.sample, val_samples)
    return (~is_val).nonzero().squeeze(1), is_val.nonzero().squeeze(1)


def train_frozen(model, data, args) -> tuple[BlockDraftHeads, list[dict]]:
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    torch.manual_seed(args.seed)
    resolve_heads_shape(args)
    layers = resolved_feature_layers(model, args)
    check_own_prediction(args)
    check_chained(args)
    check_prompt_positions(args)
    cache = Path(args.features_cache or Path(args.output) / "features")
    # the main process computes what the cache lacks and writes it; the others then read it back
    prompts = args.prompt_positions
    if accelerator.is_main_process:
        feats = cached_features(
            model,
            data,
            args.num_heads,
            cache,
            progress=not args.no_progress,
            feature_layers=layers,
            prompt_positions=prompts,
        )
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        feats = cached_features(
            model, data, args.num_heads, cache, progress=False, feature_layers=layers, prompt_positions=prompts
        )
    train_index, val_index = split_by_sample(feats, args.val_fraction, args.seed)
    if prompts:  # prompt rows without a target only serve as teacher rows; validation reads the answers alone
        train_index = train_index[(~feats.in_prompt | (feats.targets[:, 0] != IGNORE))[train_index]]
        val_index = val_index[~feats.in_prompt[val_index]]
    if args.max_positions and train_index.numel() > args.max_positions:
        keep = torch.randperm(train_index.numel(), generator=torch.Generator().manual_seed(args.seed))
        train_index = train_index[keep[: args.max_positions]]
    train, val = feats.select(train_index), feats.select(val_index)

    draft_vocab = None
    if args.draft_vocab_size and not args.init:  # --init heads keep the draft vocabulary they were trained on
        eos = model.generation_config.eos_token_id
        always = eos if isinstance(eos, list) else [eos] if eos is not None else []
        train_samples = set(train.sample.unique().tolist())
        vocab = model_vocab_size(model)
        draft_vocab = draft_vocabulary([data[i] for i in sorted(train_samples)], args.draft_vocab_size, vocab, always)
    heads = initial_heads(model, args, draft_vocab)
    if layers and heads.fusion is None:  # --init last-layer heads: a fusion that starts as the identity
        heads = heads.with_feature_layers(layers)
    hidden_size = heads.config.hidden_size  # the teacher reads the final hidden state: the features' last slice
    sample_tokens = positions = None
    if heads.context_copy is not None:  # the pointer reads each position's context: the samples' tokens
        sample_tokens = SampleTokens.build(data, response_positions)
        positions = feature_positions(feats.sample, sample_tokens)
    if args.freeze_heads:  # only the context-copy pointer learns
        for name, param in heads.named_parameters():
            param.requires_grad_(name.startswith("context_copy."))
    vocab_index = draft_index(heads)
    weights = loss_weights(args.num_heads, args.loss_decay)
    params = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    # head i's soft target comes from the hidden state at position t+i; rows are found before `select`
    # reorders anything, as indices into `feats` (val and train rows alike are consecutive per sample)
    teacher = teacher_rows(feats, args.num_heads)
    train_teacher = teacher[train_index]
    dataset = torch.utils.data.TensorDataset(train.hidden, train.targets, train.next_token, train_teacher, train_index)
    shuffle = torch.Generator().manual_seed(args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, generator=shuffle)
    total_steps = max(1, args.epochs * len(loader))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s / total_steps, 1.0)))
    )
    fingerprint = run_fingerprint(args, rows_digest(data))
    heads, optimizer, loader, scheduler = accelerator.prepare(heads, optimizer, loader, scheduler)
    track(accelerator, shuffle)
    history, first_epoch = resume(accelerator, args.output, fingerprint)
    bare = accelerator.unwrap_model(heads)
    if vocab_index is not None:
        vocab_index = vocab_index.to(accelerator.device)
    for epoch in range(first_epoch, args.epochs):
        heads.train()
        t0, running, steps = time.time(), 0.0, 0
        for hidden, targets, next_tokens, rows, feature_rows in loader:
            teacher_hidden = None
            if args.teacher_weight and not args.freeze_heads:  # NaN marks "no teacher" (past the sample's end)
                teacher_hidden = feats.hidden[rows.clamp(min=0).cpu()][..., -hidden_size:].float().to(hidden.device)
                teacher_hidden[rows < 0] = float("nan")
            loss = hidden.new_zeros(()).float()
            if sample_tokens is not None:
                at = feature_rows.cpu()
                read, copy = copy_targets(sample_tokens, feats.sample[at], positions[at], targets.cpu(), vocab_index)
                with accelerator.autocast():
                    loss, _ = copy_loss(heads, hidden.float(), read.to(hidden.device), copy.to(hidden.device), weights)
            if not args.freeze_heads:  # the heads' own loss (frozen heads: the pointer's alone)
                with accelerator.autocast():
                    own, _ = heads_loss(
                        heads,
                        hidden.float(),
                        targets,
                        weights,
                        vocab_index,
                        next_tokens,
                        teacher_hidden,
                        args.teacher_weight,
                        own_prediction=args.own_prediction,
                        own_top_k=args.own_top_k,
                    )
                loss = loss + own
            accelerator.backward(checked_loss(loss, f"epoch {epoch} step {steps + 1}"))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            running += float(loss.detach())
            steps += 1
            if args.log_every and steps % args.log_every == 0 and accelerator.is_main_process:
                print(f"epoch {epoch} step {steps}/{len(loader)} loss {running / steps:.4f}", flush=True)
        heads.eval()
        check_replicas_agree(accelerator, bare)
        val_positions = None if positions is None else positions[val_index]
        metrics = (
            evaluate(bare, val, args.top_k, 512, sample_tokens, val_positions) if accelerator.is_main_process else {}
        )
        record = {
            "epoch": epoch,
            "train_loss": running / max(steps, 1),
            "seconds": time.time() - t0,
            "processes": accelerator.num_processes,
            "train_positions": int(train_index.numel()),
            **metrics,
        }
        history.append(record)
        if accelerator.is_main_process:
            print(json.dumps(record), flush=True)
        save_epoch(accelerator, args.output, fingerprint, history)
    return bare, history


def parse_feature_layers(text: str) -> list[int]:
    """`--feature-layers 2,15,-1` -> [2, 15, -1]."""
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"feature layers are comma-separated integers, got {text!r}") from err


def resolved_feature_layers(model, args: argparse.Namespace) -> list[int] | None:
    """The feature layers these heads read (`--feature-layers` resolved against `model`'s depth, or the
    `--init` heads' own), or None: the final hidden state alone. `--init` heads with feature layers keep
    theirs: another `--feature-layers` raises ValueError."""
    given = getattr(args, "feature_layers", None)
    depth = len(decoder_layers(model)) if given else None
    wanted = normalise_feature_layers(given, depth) if given else None
    saved = BlockDraftHeads.saved_config(args.init).feature_layers if args.init else None
    if saved and wanted and saved != wanted:
        raise ValueError(f"--feature-layers {wanted} differs from the --init heads in {args.init}, which read {saved}")
    return saved or wanted


def check_own_prediction(args: argparse.Namespace) -> None:
    """Own-prediction training needs heads that read the token before their target."""
    if not 0.0 <= args.own_prediction <= 1.0:
        raise ValueError(f"--own-prediction is a probability, got {args.own_prediction}")
    if args.own_top_k < 1:
        raise ValueError(f"--own-top-k must be >= 1, got {args.own_top_k}")
    if args.own_prediction and args.token_input != "previous":
        raise ValueError(
            "--own-prediction feeds each head the previous head's prediction: it needs --token-input previous, got "
            f"{args.token_input}"
        )


def check_prompt_positions(args: argparse.Namespace) -> None:
    """Prompt positions have no context-copy targets (the pointer is trained on answers)."""
    if getattr(args, "prompt_positions", False) and getattr(args, "copy_dim", 0):
        raise ValueError("--prompt-positions trains the heads' own distributions: it cannot train a --copy-dim pointer")


def check_chained(args: argparse.Namespace) -> None:
    """`--chain` with the other heads options, checked by the heads' own config (chained heads read the
    drafted token before their target and have no context-copy pointer): refused before any feature is
    computed."""
    BlockDraftHeadsConfig(
        token_input=token_input(args), chain=chain_option(args), copy_dim=getattr(args, "copy_dim", 0)
    )


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="packaged", help="base model path or 'packaged'")
    parser.add_argument(
        "--data", required=True, nargs="+", help="hf-bpd distill --output folders (or their dataset/), in this order"
    )
    parser.add_argument("--output", required=True)
    parser.add_argument("--mode", choices=["frozen", "joint"], default="frozen")
    parser.add_argument(
        "--init",
        default=None,
        help="saved heads to continue training from (more data, or the joint stage after a frozen one); they "
        "keep their shape and draft vocabulary, and the shape arguments below default to theirs",
    )
    parser.add_argument("--num-heads", type=int, default=None, help="default 4")
    parser.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="residual blocks per head (default 1); above the --init heads' own it deepens them, the new blocks "
        "starting as the identity",
    )
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="default 0: the full vocabulary")
    parser.add_argument(
        "--token-input",
        choices=TOKEN_INPUT_CHOICES,
        default=None,
        help="the token embedding each head also reads: 'previous' (the default) the token before its target "
        "(drafted node by node), 'next' token t+1 (the base model's own choice), 'none' plain Medusa heads",
    )
    parser.add_argument(
        "--copy-dim",
        type=int,
        default=0,
        help="frozen mode, 'previous' heads: add a context-copy pointer of this width to the heads (0: none; "
        "heads that have one keep it)",
    )
    parser.add_argument(
        "--freeze-heads",
        action="store_true",
        help="train only the context-copy pointer, keeping the heads' own weights (e.g. of --init heads)",
    )
    parser.add_argument(
        "--feature-layers",
        type=parse_feature_layers,
        default=None,
        help="frozen mode: hidden states the heads read a fusion of, as output_hidden_states indices, e.g. 2,15,-1 "
        "(-1: the final hidden state, which must be among them; default: the final one alone). With --init "
        "last-layer heads the fusion starts as the identity on the final state",
    )
    parser.add_argument(
        "--chain",
        choices=["none", "state", "beside"],
        default="none",
        help="'previous' heads: head i > 1 also reads head i-1's state, 'state' in place of the hidden state (a "
        "recurrent drafter, as Apple's ReDrafter), 'beside' it through new weights starting at zero; --init "
        "unchained heads gain the chain with their weights",
    )
    parser.add_argument(
        "--prompt-positions",
        action="store_true",
        help="frozen mode: also train on the prompts' positions, teacher forced, where the prompt's text agrees "
        "with the model's own greedy choices (the target is then the greedy continuation); validation stays on "
        "the answers",
    )
    parser.add_argument(
        "--own-prediction",
        type=float,
        default=0.0,
        help="'previous' heads: probability that head i > 1 reads the heads' own prediction at depth i-1 instead "
        "of the true token (EAGLE-3's training-time test; 0: teacher forcing, 1: always)",
    )
    parser.add_argument(
        "--own-top-k",
        type=int,
        default=1,
        help="with --own-prediction: 1 reads the previous head's top-1, k > 1 a draw from its top k",
    )
    parser.add_argument("--features-cache", default=None, help="frozen mode: cache folder (default: OUTPUT/features)")
    parser.add_argument("--loss-decay", type=float, default=0.8, help="head i loss weight = decay**(i-1)")
    parser.add_argument(
        "--teacher-weight",
        type=float,
        default=0.0,
        help="frozen mode: weight of the base model's own distribution as a soft target (0: distilled tokens only)",
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=256, help="positions (frozen) or samples (joint)")
    parser.add_argument("--max-positions", type=int, default=0, help="cap on training positions (0: all)")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--top-k", type=int, default=5, help="k of the top-k accuracy and lattice oracle")
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--base-loss-weight", type=float, default=1.0, help="joint mode: weight of the base LM loss")
    parser.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--no-progress", action="store_true")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-bpd train-heads", description=__doc__.split("\n\n")[0])
    add_args(parser)
    args = parser.parse_args(argv)
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    from hf_bpd.io.models import load_model
    from hf_bpd.training.distill import load_distilled

    # under accelerate launch / torchrun: this process's device (cuda:<local rank>); CPU data parallelism
    # with ACCELERATE_USE_CPU=true, as `Accelerator` reads it
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    device = args.device or str(state.device)
    model, _ = load_model(args.model, device=device, with_tokenizer=False)
    data = load_distilled(args.data)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if args.mode == "frozen":
        heads, history = train_frozen(model, data, args)
    else:
        from hf_bpd.training.joint import train_joint

        heads, history = train_joint(model, data, args)
    if state.is_main_process:
        heads.save_pretrained(out)
        (out / "training_log.json").write_text(json.dumps({"args": vars(args), "epochs": history}, indent=2))
        print(f"saved heads to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
