"""What every head-training mode shares: the targets of a distilled sample, the heads to start from and
their loss. `train_heads` (frozen mode, and the `hf-bpd train-heads` command), `joint` (LoRA mode),
`train_rescorer` and `evaluate_heads` build on it; it imports none of them."""

from __future__ import annotations

import argparse
import json

import torch

from hf_bpd.drafting.heads import BlockDraftHeads

IGNORE = -100


def head_targets(sequence: list[int], start: int, num_heads: int) -> torch.Tensor:
    """Targets [L - start - 1, h] for positions t = start .. L-2 of `sequence`: row t holds the tokens at
    t+2 .. t+1+h (IGNORE past the end)."""
    seq = torch.tensor(sequence)
    n = len(sequence) - start - 1
    out = torch.full((max(n, 0), num_heads), IGNORE, dtype=torch.long)
    for i in range(1, num_heads + 1):
        src = seq[start + 1 + i :]
        m = min(n, src.numel())
        out[:m, i - 1] = src[:m]
    return out


def agreeing_targets(sequence: list[int], start: int, greedy: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Targets [L - 1, h] for every position t = 0 .. L-2 of `sequence`, a prompt followed from `start` on by
    the model's own greedy answer. `greedy [start]`: the model's greedy choice of token t+1 at each prompt
    position t < start. At t >= start these are `head_targets`. In the prompt (real text, teacher forced)
    head i's target at t is the model's greedy token after tokens ..t+i, valid only where the text agrees
    with the model's greedy choices at t .. t+i-1: there the heads read exactly what greedy decoding from t
    would feed them, so the target is the greedy continuation. IGNORE elsewhere."""
    seq = torch.tensor(sequence, dtype=torch.long)
    m = len(sequence) - 1
    if m <= 0:
        return torch.full((0, num_heads), IGNORE, dtype=torch.long)
    start = min(start, m)
    choice = torch.cat([greedy[:start].to(torch.long), seq[start + 1 :]])  # greedy token t+1 at each t
    agree = seq[1:] == choice
    agree[start:] = True
    run = torch.zeros(m + 1, dtype=torch.long)  # run[t]: agreeing positions from t on
    for t in range(m - 1, -1, -1):
        run[t] = run[t + 1] + 1 if agree[t] else 0
    out = torch.full((m, num_heads), IGNORE, dtype=torch.long)
    positions = torch.arange(m)
    for i in range(1, num_heads + 1):
        ok = (positions + i < m) & (run[:m] >= i)
        out[ok, i - 1] = choice[positions[ok] + i]
    return out


def response_positions(prompt_len: int) -> int:
    """First position trained on: the last prompt token (its hidden state drafts the response start)."""
    return max(prompt_len - 1, 0)


def right_padded(rows) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """prompt+response sequences of `rows`, right-padded: (sequences, input_ids [B, L], attention_mask).
    Right padding keeps every real token at positions 0..len-1; padded keys are masked."""
    seqs = [r["prompt_ids"] + r["response_ids"] for r in rows]
    ids = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
    return seqs, ids, mask


def length_sorted_batches(data, batch_tokens: int) -> list[list[int]]:
    """Indices of `data` rows (prompt + response) in batches of at most `batch_tokens` padded tokens,
    shortest first: similar lengths share a batch, so little of it is padding."""
    length = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in data]
    batches: list[list[int]] = []
    for j in sorted(range(len(data)), key=length.__getitem__):
        # sorted by length: the new row is the batch's longest
        if batches and length[j] * (len(batches[-1]) + 1) <= batch_tokens:
            batches[-1].append(j)
        else:
            batches.append([j])
    return batches


def rows_digest(rows) -> str:
    """Identifies distilled rows by their tokens: a cached chunk is reused only for the same samples."""
    import hashlib

    h = hashlib.sha1()
    for r in rows:
        h.update(json.dumps([r["prompt_ids"], r["response_ids"]]).encode())
    return h.hexdigest()


HEADS_SHAPE_DEFAULTS = {"num_heads": 4, "num_layers": 1, "token_input": "previous", "draft_vocab_size": 0}


def resolve_heads_shape(args: argparse.Namespace) -> None:
    """Fill in the heads' shape arguments (`HEADS_SHAPE_DEFAULTS`) left unset, in place: from the `--init`
    heads when there are some, else the defaults. A value given that differs from the `--init` heads
    raises ValueError naming it: continuing from heads cannot change their shape, except to deepen them
    (`--num-layers` above theirs: `initial_heads` adds blocks that start as the identity)."""
    saved = {}
    if args.init:
        cfg = BlockDraftHeads.saved_config(args.init)  # a folder that is not heads raises here
        saved = {
            "num_heads": cfg.num_heads,
            "num_layers": cfg.num_layers,
            "token_input": cfg.token_input or "none",
            "draft_vocab_size": cfg.draft_vocab_size,
        }
    for name, default in HEADS_SHAPE_DEFAULTS.items():
        given = getattr(args, name)
        deeper = name == "num_layers" and given is not None and name in saved and given > saved[name]
        if given is not None and name in saved and given != saved[name] and not deeper:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {given} differs from the --init heads in {args.init}, which have {saved[name]}")
        setattr(args, name, saved.get(name, default) if given is None else given)


def initial_heads(model, args: argparse.Namespace, draft_vocab: torch.Tensor | None = None) -> BlockDraftHeads:
    """The heads training starts from, in float32 and bound to `model`: the `--init` heads (checked to fit
    `model`), or new ones of the arguments' shape drafting `draft_vocab` (None: the whole vocabulary).
    `--copy-dim` adds a context-copy pointer to heads that have none, `--num-layers` above theirs deepens them."""
    copy_dim = getattr(args, "copy_dim", 0)
    if getattr(args, "freeze_heads", False) and not copy_dim:
        raise ValueError("--freeze-heads trains only a context-copy pointer: give --copy-dim")
    if args.init:
        device = next(model.parameters()).device
        heads = BlockDraftHeads.from_pretrained(args.init).to(device).float().bind(model)
        if args.num_layers > heads.config.num_layers:  # deeper: the new blocks start as the identity
            heads = heads.with_num_layers(args.num_layers)
        if copy_dim and heads.context_copy is None:
            return heads.with_context_copy(copy_dim)
        if copy_dim and copy_dim != heads.config.copy_dim:
            raise ValueError(
                f"--copy-dim {copy_dim} differs from the --init heads in {args.init}, which have "
                f"{heads.config.copy_dim}"
            )
        chain = chain_option(args)
        if chain and chain != heads.config.chain:
            if heads.chained:
                raise ValueError(f"--chain {chain} differs from the --init heads in {args.init}: {heads.config.chain}")
            return heads.with_chain(chain)
        return heads
    heads = BlockDraftHeads.for_base_model(
        model,
        args.num_heads,
        args.num_layers,
        draft_vocab=draft_vocab,
        token_input=token_input(args),
        copy_dim=copy_dim,
        feature_layers=getattr(args, "feature_layers", None),
        chain=chain_option(args),
    )
    return heads.float()


def draft_index(heads: BlockDraftHeads) -> torch.Tensor | None:
    """Token id -> index in the heads' draft vocabulary (IGNORE for tokens outside it, which no head can
    draft and so are not trained on); None for heads that draft the whole vocabulary."""
    index = heads.draft_index()
    return None if index is None else torch.where(index < 0, IGNORE, index)


def loss_weights(num_heads: int, decay: float) -> list[float]:
    """w_i = decay**(i-1): later heads are less accurate and matter less for acceptance."""
    return [decay**i for i in range(num_heads)]


def heads_loss(
    heads: BlockDraftHeads,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weights: list[float],
    vocab_index: torch.Tensor | None,
    next_tokens: torch.Tensor | None = None,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: float = 0.0,
    own_prediction: float = 0.0,
    own_top_k: int = 1,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Weighted CE over heads, computed head by head (a [n, h, V] logit tensor would not fit).
    `next_tokens`: token t+1 per position, for heads with a token input. `teacher_hidden [n, h, H]`: the
    base hidden state at position t+i for head i (NaN where there is none), whose base-model logits are
    the soft target mixed in with `teacher_weight` (module docstring). `own_prediction` ("previous" heads):
    the probability that head i > 1 reads the heads' own prediction instead of the true token
    (`own_prediction_tokens`). `hidden` may be heads' feature layers' concatenated states (`heads.py`):
    the heads' forward fuses them. `heads` may be wrapped for data parallelism (`accelerator.prepare`):
    the forward goes through the wrapper, or gradients would not be synchronised across processes."""
    from accelerate.utils import extract_model_from_parallel

    bare = extract_model_from_parallel(heads)
    tokens = None if next_tokens is None else bare.teacher_forced_tokens(torch.cat([next_tokens[:, None], targets], 1))
    if own_prediction and tokens is not None and bare.conditions_on_draft:
        tokens = own_prediction_tokens(bare, hidden, tokens, own_prediction, own_top_k)
    states = heads(hidden, tokens, return_states=True)
    project = bare.project
    total, per_head = hidden.new_zeros(()).float(), []
    for i, w in enumerate(weights):
        tgt = targets[:, i] if vocab_index is None else vocab_index[targets[:, i].clamp(min=0)]
        tgt = torch.where(targets[:, i] == IGNORE, IGNORE, tgt)
        logits = project(states[:, i]).float()
        # the mean over the rows with a target, 0 for a batch with none; a non-finite logit stays nan (nan_to_num
        # once turned it into a silent loss of 0)
        loss = torch.nn.functional.cross_entropy(logits, tgt, ignore_index=IGNORE, reduction="sum")
        loss = loss / (tgt != IGNORE).sum().clamp(min=1)
        if teacher_weight:
            loss = (1 - teacher_weight) * loss + teacher_weight * teacher_loss(bare, logits, teacher_hidden[:, i])
        per_head.append(loss.detach())
        total = total + w * loss
    return total, per_head


@torch.no_grad()
def own_prediction_tokens(
    heads: BlockDraftHeads, hidden: torch.Tensor, tokens: torch.Tensor, probability: float, top_k: int = 1
) -> torch.Tensor:
    """The tokens "previous" heads read `[n, h]` with own predictions mixed in (EAGLE-3's training-time
    test): head 1 reads token t+1 as given (the base model's own choice, the tree's root); head i > 1
    reads, with `probability` per position, the token head i-1 predicts from what it read itself (its
    top-1, or with `top_k` > 1 a draw from its top k by their probabilities), as a greedy draft branch puts
    it at depth i-1, else the given (true) token. `hidden [n, H]` (or feature layers' `[n, k*H]`)."""
    fused = heads.fusion is not None and hidden.shape[-1] == heads.fusion.in_features
    state_in = heads.fuse(hidden) if fused else hidden
    out, state = tokens.clone(), None
    for i in range(heads.num_heads - 1):
        state = heads.step(i, state_in, out[:, i], state)  # chained heads: the next head reads this state
        logits = heads.project(state).float()
        if top_k == 1:
            index = logits.argmax(-1)
        else:
            values, top = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
            index = top.gather(-1, torch.multinomial(values.softmax(-1), 1)).squeeze(-1)
        predicted = heads.draft_vocab.to(index.device)[index]
        own = torch.rand(index.shape, device=index.device) < probability
        out[:, i + 1] = torch.where(own, predicted, out[:, i + 1])
    return out


def teacher_loss(heads: BlockDraftHeads, logits: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
    """Mean CE of the head's `logits [n, S]` against the base model's own distribution over the draft
    vocabulary (`heads.base_logits` of `teacher_hidden [n, H]`), over the rows that have a teacher (not NaN)."""
    has = ~teacher_hidden[:, 0].isnan()
    if not bool(has.any()):
        return logits.new_zeros(())
    with torch.no_grad():
        target = heads.base_logits(teacher_hidden[has].to(logits.dtype)).float().softmax(-1)
    return -(target * logits[has].log_softmax(-1)).sum(-1).mean()


def check_replicas_agree(accelerator, module: torch.nn.Module) -> None:
    """Data-parallel replicas must hold the same weights after each epoch: a gradient that bypassed the
    wrapper's synchronisation would silently train one different model per process."""
    if accelerator.num_processes == 1:
        return
    checksum = torch.stack([p.detach().double().sum() for p in module.parameters()]).to(accelerator.device)
    gathered = accelerator.gather(checksum[None])
    if not torch.allclose(gathered, gathered[:1].expand_as(gathered)):
        raise RuntimeError(f"data-parallel replicas diverged ({accelerator.num_processes} processes)")


def chain_option(args: argparse.Namespace) -> str:
    """`--chain` as `BlockDraftHeadsConfig.chain` ("none" -> "")."""
    chain = getattr(args, "chain", "none")
    return "" if chain == "none" else chain


def token_input(args: argparse.Namespace) -> str:
    """`--token-input` as `BlockDraftHeadsConfig.token_input` ("none" -> "")."""
    return "" if args.token_input == "none" else args.token_input
