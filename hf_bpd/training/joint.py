"""Joint training (Medusa-2): LoRA on the base model (PEFT) + the draft heads, in one loss.

loss = base_loss_weight * CE(base next token) + sum_i w_i * CE(head i). The base targets are the base
model's own distilled tokens, so the adapted model keeps saying what it said; the heads see hidden states
that the adapter has made easier to draft from. `hf_bpd.load_joint_model` merges the adapter for use.
"""

from __future__ import annotations

import json
import time

import torch

from hf_bpd.drafting.heads import BlockDraftHeads
from hf_bpd.training.checkpoint import resume, run_fingerprint, save_epoch, skip_module_in_state, track
from hf_bpd.training.objective import (
    IGNORE,
    check_replicas_agree,
    draft_index,
    head_targets,
    heads_loss,
    initial_heads,
    loss_weights,
    resolve_heads_shape,
    response_positions,
    right_padded,
    rows_digest,
)


class LoraWeights:
    """The adapter's weights as a checkpoint entry: the base model itself is frozen and hundreds of MB."""

    def __init__(self, peft_model) -> None:
        self.peft_model = peft_model

    def state_dict(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.peft_model)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.peft_model, state)


def collate(rows, num_heads: int) -> dict[str, torch.Tensor]:
    """Right-padded batch with base labels (response tokens) and head targets at every position."""
    seqs, ids, mask = right_padded(rows)
    labels = torch.full_like(ids, IGNORE)
    targets = torch.full((*ids.shape, num_heads), IGNORE, dtype=torch.long)
    for b, (row, s) in enumerate(zip(rows, seqs)):
        start = response_positions(len(row["prompt_ids"]))
        labels[b, start : len(s) - 1] = ids[b, start + 1 : len(s)]  # label at t = token t+1
        t = head_targets(s, start, num_heads)
        targets[b, start : start + t.shape[0]] = t
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "targets": targets}


def train_joint(model, data, args) -> tuple[BlockDraftHeads, list[dict]]:
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model

    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    torch.manual_seed(args.seed)
    resolve_heads_shape(args)
    heads = initial_heads(model, args)
    if heads.fusion is not None or getattr(args, "feature_layers", None):
        raise ValueError(
            "joint mode trains heads on the final hidden state: heads reading feature layers "
            f"({heads.config.feature_layers or args.feature_layers}) train in frozen mode"
        )
    if getattr(args, "own_prediction", 0.0):
        raise ValueError("--own-prediction is a frozen-mode option")
    if getattr(args, "prompt_positions", False):
        raise ValueError("--prompt-positions is a frozen-mode option")
    if heads.context_copy is not None:
        raise ValueError(
            "joint mode does not train a context-copy pointer: train the pointer in frozen mode "
            "(--copy-dim, --freeze-heads) on the joint stage's heads"
        )
    vocab_index = draft_index(heads)
    lora = LoraConfig(
        r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    peft_model = get_peft_model(model, lora)
    weights = loss_weights(args.num_heads, args.loss_decay)
    params = [p for p in peft_model.parameters() if p.requires_grad] + list(heads.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    shuffle = torch.Generator().manual_seed(args.seed)
    loader = torch.utils.data.DataLoader(
        list(data),
        batch_size=args.batch_size,
        shuffle=True,
        collate_fn=lambda rows: collate(rows, args.num_heads),
        generator=shuffle,
    )
    fingerprint = run_fingerprint(args, rows_digest(data))
    peft_model, heads, optimizer, loader = accelerator.prepare(peft_model, heads, optimizer, loader)
    # the checkpoint holds the adapter, not the whole (frozen) base model the PEFT wrapper would save
    skip_module_in_state(accelerator, peft_model)
    track(accelerator, shuffle, LoraWeights(accelerator.unwrap_model(peft_model)))
    history, first_epoch = resume(accelerator, args.output, fingerprint)
    bare_heads = accelerator.unwrap_model(heads)
    if vocab_index is not None:
        vocab_index = vocab_index.to(accelerator.device)
    for epoch in range(first_epoch, args.epochs):
        peft_model.train()
        t0, running, steps = time.time(), 0.0, 0
        for batch in loader:
            with accelerator.autocast():
                out = peft_model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
                )
                base = torch.nn.functional.cross_entropy(
                    out.logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE
                )
                valid = batch["attention_mask"].bool()
                hidden = out.hidden_states[-1][valid]
                next_tokens = batch["labels"][valid].clamp(min=0)  # token t+1; no head target where IGNORE
                head_loss, _ = heads_loss(heads, hidden, batch["targets"][valid], weights, vocab_index, next_tokens)
                loss = args.base_loss_weight * base + head_loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            running += float(loss.detach())
            steps += 1
        check_replicas_agree(accelerator, bare_heads)
        check_replicas_agree(accelerator, accelerator.unwrap_model(peft_model))
        record = {
            "epoch": epoch,
            "train_loss": running / max(steps, 1),
            "seconds": time.time() - t0,
            "processes": accelerator.num_processes,
        }
        history.append(record)
        if accelerator.is_main_process:
            print(json.dumps(record), flush=True)
        save_epoch(accelerator, args.output, fingerprint, history)
    unwrapped = accelerator.unwrap_model(peft_model)
    if accelerator.is_main_process:
        unwrapped.save_pretrained(f"{args.output}/lora")
    accelerator.wait_for_everyone()
    unwrapped.unload()  # leave the caller's base model as it was
    return bare_heads, history
