"""Loading a base model by name: a packaged model ('packaged' = SmolLM2-135M-Instruct, 'gemma-3-270m';
`hf_bpd.packaged.PACKAGED_MODELS`) or any local/Hub causal LM."""

from __future__ import annotations

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


def chat_inputs(tokenizer, messages: list[dict], device="cpu") -> dict:
    """`generate` inputs for a chat: the model's chat template with the generation prompt."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return {k: v.to(device) for k, v in enc.items()}
