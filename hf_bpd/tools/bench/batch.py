"""`hf-bpd bench --batch-size B`: batch throughput of hf_bpd against plain batched greedy `generate`.

The first turn of each selected row is one prompt; consecutive prompts form batches of B (left-padded chat
inputs, as a tokenizer with padding_side="left" makes them), and every method decodes each batch in ONE
`generate` call, methods taking turns to run first, after one untimed warm-up batch per size. A row's tokens
are its generated tokens up to and including its first eos (the padding after it is not output). Speed is the
batch's tokens per second; "tau" is tokens per base-model forward of the whole batch (plain batched greedy:
about the batch size), and each hf_bpd row's own τ (its tokens / its steps + 1) is kept too. Every row is
compared with the same row of plain batched greedy. Prompt lookup and assisted generation do not take batches
in transformers.
"""

from __future__ import annotations

import time

import torch

from ...io.models import chat_inputs
from ..forward_counter import ForwardCounter


def left_padded_batch(tokenizer, prompts: list[str], device) -> dict:
    """Chat inputs of several prompts, left-padded into one batch."""
    encoded = [chat_inputs(tokenizer, [{"role": "user", "content": p}], device)["input_ids"][0] for p in prompts]
    width = max(len(e) for e in encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(encoded), width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(encoded), width), dtype=torch.long, device=device)
    for b, e in enumerate(encoded):
        ids[b, width - len(e) :] = e
        mask[b, width - len(e) :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def row_tokens(generated: torch.Tensor, eos: set[int]) -> list[list[int]]:
    """Each row's output: its generated tokens up to and including the first eos."""
    rows = []
    for row in generated.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


def run_batch_bench(
    model,
    tokenizer,
    rows: list[dict],
    methods,
    max_new_tokens: int,
    batch_size: int,
    first_record: int = 0,
    rounds: int = 1,
) -> list[dict]:
    """Records (one per batch, round and method, category "batches of B") for `report.summarize`; the
    reference is `methods[0]`. Every method decodes the first batch once, untimed, before any timing (warm-up
    at this size); the methods then take turns running first. `rounds` decodes every batch that many times
    (the order of the methods turning on each round): a batch's prefill alone is long and its time varies
    on a shared host, so one sample per batch is noisy. `first_record` numbers the records after earlier
    ones of the same run."""
    device = next(model.parameters()).device
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = [row["turns"][0] for row in rows]
    records = []
    warm_up = left_padded_batch(tokenizer, prompts[:batch_size], device)
    for m in methods:
        m.run({**warm_up, "pad_token_id": pad}, min(max_new_tokens, 8))
    starts = list(range(0, len(prompts), batch_size))
    with ForwardCounter(model) as counter:
        for g, start in ((r * len(starts) + i, start) for r in range(rounds) for i, start in enumerate(starts)):
            batch = left_padded_batch(tokenizer, prompts[start : start + batch_size], device)
            width = batch["input_ids"].shape[1]
            results = {}
            for m in methods[g % len(methods) :] + methods[: g % len(methods)]:
                counter.count = 0
                t0 = time.perf_counter()
                out, stats = m.run({**batch, "pad_token_id": pad}, max_new_tokens)
                results[m.name] = (row_tokens(out[:, width:], eos), counter.count, stats, time.perf_counter() - t0)
            ref, _, _, ref_seconds = results[methods[0].name]
            for m in methods:
                tokens, forwards, stats, seconds = results[m.name]
                record = {
                    "row": first_record + g,
                    "question_id": rows[start].get("question_id"),
                    "category": f"batches of {batch_size}",
                    "round": g // len(starts),
                    "turn": 0,
                    "method": m.name,
                    "tokens": sum(len(t) for t in tokens),
                    "forwards": forwards,
                    "seconds": seconds,
                    "greedy_seconds": ref_seconds,
                    "identical": tokens == ref,
                    "identical_rows": sum(a == b for a, b in zip(tokens, ref)),
                }
                if stats is not None and stats.rows:
                    record["row_tau"] = [r.block_efficiency for r in stats.rows]
                    record["steps"], record["plain_steps"] = stats.steps, stats.plain_steps
                records.append(record)
    return records
