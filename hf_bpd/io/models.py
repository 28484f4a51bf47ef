"""Loading a base model by name: a packaged model ('packaged' = SmolLM2-135M-Instruct, 'gemma-3-270m';
`hf_bpd.io.packaged.PACKAGED_MODELS`) or any local/Hub causal LM."""

from __future__ import annotations

import torch

from .packaged import load_packaged_model, resolve_packaged_name


def load_model(
    name: str = "packaged",
    dtype: str = "float32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    with_tokenizer: bool = True,
):
    """Return `(model, tokenizer)` in eval mode on `device` (tokenizer None when `with_tokenizer=False`:
    training on token ids needs none, and a model folder may have none).

    name: "packaged" (SmolLM2-135M-Instruct), another packaged model's name ("gemma-3-270m"; these take
          precedence: write "./gemma-3-270m" for a local folder of that name), or a local folder / Hub id.
    """
    packaged = resolve_packaged_name(name)
    if packaged is not None:
        model, tokenizer = load_packaged_model(packaged, dtype=dtype, attn_implementation=attn_implementation)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation=attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(name) if with_tokenizer else None
    return model.to(device).eval(), tokenizer


# How a prompt becomes a base model's input (no chat template): `hf-bpd distill --prompt-template`'s named
# formats. "qa" is the framing under which a base model answers rather than continues the question.
PROMPT_FORMATS = {"plain": "{prompt}", "qa": "Question: {prompt}\nAnswer:"}


def chat_inputs(tokenizer, messages: list[dict], device="cpu") -> dict:
    """`generate` inputs for a chat: the model's chat template with the generation prompt.

    A tokenizer with no chat template (a base model such as Gemma-3-270M) gets the "qa" framing its shipped
    heads were distilled on, turn after turn: "Question: {turn 1}\nAnswer:{answer 1}\nQuestion: {turn 2}
    \nAnswer:", tokenized with the tokenizer's special tokens (Gemma's <bos>); a system message is a first
    line of plain text."""
    if getattr(tokenizer, "chat_template", True) is not None:  # transformers' tokenizers say None for none
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        return {k: v.to(device) for k, v in enc.items()}
    parts = []
    for message in messages:
        if message["role"] == "user":
            parts.append(("\n" if parts else "") + PROMPT_FORMATS["qa"].replace("{prompt}", message["content"]))
        elif message["role"] == "assistant":
            parts.append(message["content"])
        elif message["role"] == "system":
            parts.append(message["content"] + "\n")
        else:
            raise ValueError(f"message role {message['role']!r}: expected 'system', 'user' or 'assistant'")
    if not messages or messages[-1]["role"] != "user":
        raise ValueError("a conversation to answer ends with a user message")
    ids = torch.tensor([list(tokenizer("".join(parts), add_special_tokens=True)["input_ids"])], device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
