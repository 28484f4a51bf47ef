"""Chat prompts written by the model itself (Magpie, Xu et al. 2024), for self-distillation on what a chat
user asks rather than on task templates.

Why: the bundled training prompts are 95 % T0 task templates, and heads trained further on them gain
accuracy on that data without gaining τ on Spec-Bench (RESULTS.md, claim
`deep_prompts_lr3e-4_spread40_lookup0`). An instruct model given its chat template up to where the user's
message begins writes a user message: sampling from that prefix gives prompts from the model's own idea of
a chat, with no benchmark or outside text. Their answers are then distilled as any prompts are:

    python -m hf_bpd.training.self_prompts --output training/data/self_prompts.jsonl --num 2000 --seed 0
    hf-bpd distill --prompts training/data/self_prompts.jsonl --output runs/distill_self ...

Sampling draws from torch's generator seeded per batch, so a run is determined by the model, `--num`,
`--seed`, `--batch-size` and `--max-new-tokens` on one machine.
"""

from __future__ import annotations

import argparse

import torch

from hf_bpd.io.jsonl import write_jsonl

_MARKER = "<<hf_bpd user message>>"


def user_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where the user's first message begins (with the template's
    default system prompt, if it has one). A tokenizer without a chat template raises ValueError."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("self-written prompts need an instruct model's chat template; this tokenizer has none")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}], tokenize=False)
    if _MARKER not in text:
        raise ValueError("the chat template does not place the user's message in its text: no prefix to sample from")
    return list(tokenizer(text[: text.index(_MARKER)], add_special_tokens=False)["input_ids"])


@torch.no_grad()
def self_prompts(
    model, tokenizer, num: int, seed: int = 0, batch_size: int = 32, max_new_tokens: int = 96, progress: bool = False
) -> list[str]:
    """`num` distinct user messages sampled from the model after `user_prefix` (temperature 1, top-p 1), in
    the order drawn. Only messages the model ended itself (an end-of-turn token within `max_new_tokens`)
    count; after `8 * num` draws without enough of them it raises RuntimeError rather than loop on."""
    if num < 1 or batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"num, batch_size and max_new_tokens must be >= 1, got {num}, {batch_size}, {max_new_tokens}")
    prefix = torch.tensor([user_prefix(tokenizer)], device=next(model.parameters()).device)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    eos.add(tokenizer.eos_token_id)
    eos.discard(None)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    from tqdm import tqdm

    found, seen, drawn, batch = [], set(), 0, 0
    bar = tqdm(total=num, disable=not progress, desc="self prompts")
    while len(found) < num:
        if drawn >= 8 * num:
            raise RuntimeError(f"{drawn} draws gave {len(found)} finished, distinct messages of the {num} asked")
        torch.manual_seed(seed * 1_000_003 + batch)
        out = model.generate(
            prefix.expand(batch_size, -1),
            attention_mask=torch.ones(batch_size, prefix.shape[1], dtype=torch.long, device=prefix.device),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=50,
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(eos),
            pad_token_id=pad,
        )[:, prefix.shape[1] :].tolist()
        for row in out:
            ends = [i for i, t in enumerate(row) if t in eos]
            if not ends:
                continue  # cut off by max_new_tokens: not a whole message
            text = tokenizer.decode(row[: ends[0]], skip_special_tokens=True).strip()
            if text and text not in seen and len(found) < num:
                seen.add(text)
                found.append(text)
        drawn += batch_size
        batch += 1
        bar.update(len(found) - bar.n)
    bar.close()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="packaged", help="an instruct model: path or 'packaged'")
    parser.add_argument("--output", required=True)
    parser.add_argument("--num", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    from hf_bpd.io.models import load_model

    model, tokenizer = load_model(args.model)
    prompts = self_prompts(model, tokenizer, args.num, args.seed, args.batch_size, args.max_new_tokens, progress=True)
    prefix = "self" if args.seed == 0 else f"self{args.seed}"  # ids stay distinct across seeds' files
    rows = [{"id": f"{prefix}-{i}", "source": "self_prompts", "prompt": p} for i, p in enumerate(prompts)]
    write_jsonl(args.output, rows)
    print(f"wrote {len(rows)} prompts to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
