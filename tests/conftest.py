"""Shared fixtures: tiny random-weight models of several architectures (fast), and the real packaged
SmolLM2 (marked `real`; the long runs also `slow`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_bpd.io.jsonl import read_jsonl

SPEC_BENCH = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "spec_bench_dev.jsonl"
SPEC_BENCH_SAMPLE = Path(__file__).resolve().parent / "data" / "spec_bench_sample.jsonl"
SPEC_BENCH_DEV_ROWS = 240

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_model(arch: str = "llama", attn: str = "sdpa", seed: int = 0, **overrides):
    """A tiny random causal LM of architecture `arch` in eval mode (deterministic per seed)."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),  # per-head query and key norms, no output norms
    }
    config_cls, model_cls = classes[arch]
    kwargs = dict(TINY, **overrides)
    if arch == "mistral":
        kwargs.setdefault("sliding_window", 4096)
    if arch == "qwen3":
        kwargs.setdefault("head_dim", 8)
    if arch == "gemma3":  # Gemma-3-270M's shape of layer: query, key and output norms, a query scale of its own
        kwargs.setdefault("head_dim", 8)
        kwargs.setdefault("query_pre_attn_scalar", 12)
        kwargs.setdefault("sliding_window", 4)
        kwargs.setdefault("layer_types", ["sliding_attention", "full_attention"])
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    config._attn_implementation = attn
    model = model_cls(config).eval()
    if arch in ("gemma3", "qwen3"):  # its norms start as the identity: random ones, so a wrong copy shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(torch.randn(p.shape) * 0.5)
    # Sharpen the random model's distributions so greedy choices are far from ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0) if not config.tie_word_embeddings else None
    return model


def random_heads(model, num_heads: int = 3, seed: int = 0, std: float = 0.3, **kw):
    from hf_bpd import BlockDraftHeads

    heads = BlockDraftHeads.for_base_model(model, num_heads=num_heads, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return heads


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Other processes' load is unknown to the tests (`machine_load.OtherLoad` reads None), so a measurement
    is cached whatever else runs on the machine: the tests of busy measurements set the load they need."""
    monkeypatch.setattr("hf_bpd.machine_load._busy_seconds", lambda: None)


@pytest.fixture(autouse=True)
def private_forward_cost_cache(tmp_path, monkeypatch):
    """Measured forward-cost curves go to a folder of this test, not the user's cache: a test of "auto"
    trees measures its model instead of reading a curve another test or run left."""
    folder = tmp_path / "forward_cost"
    monkeypatch.setattr("hf_bpd.decode.cost.forward_cost_dir", lambda: folder)
    return folder


@pytest.fixture(scope="session")
def smollm2():
    from hf_bpd import load_packaged_model

    try:
        return load_packaged_model()
    except ModuleNotFoundError as err:
        pytest.skip(f"packaged model unavailable: {err}")


def spec_bench_rows() -> list[dict]:
    """The Spec-Bench dev rows the real-model tests decode, shipped in tests/data (every row keeps its
    index in the full dev file as `dev_row`), so these tests run on a fresh clone."""
    return read_jsonl(SPEC_BENCH_SAMPLE)


def spec_bench_prompts(n: int) -> list[str]:
    """First-turn prompts of n rows spread over the dev file's categories (every 240/n-th dev row)."""
    step = max(SPEC_BENCH_DEV_ROWS // n, 1)
    return [r["turns"][0] for r in spec_bench_rows() if r["dev_row"] % step == 0][:n]


def tiny_distilled(model, n=24, prompt_len=6, new=24, seed=0):
    """A distilled `datasets.Dataset` of `model`'s own greedy answers to `n` random prompts."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows = {"id": [], "prompt_ids": [], "response_ids": []}
    for i in range(n):
        prompt = torch.randint(3, 97, (1, prompt_len), generator=g)
        out = model.generate(prompt, do_sample=False, max_new_tokens=new)
        rows["id"].append(str(i))
        rows["prompt_ids"].append(prompt[0].tolist())
        rows["response_ids"].append(out[0, prompt_len:].tolist())
    return datasets.Dataset.from_dict(rows)


def assert_replay_matches_loop(model, make_drafter, ids, new_tokens: int = 40, trial=None):
    """Replay (`tools.replay.replay_turn`) of greedy's answer with a fresh `make_drafter()` takes the steps the
    decoding loop took with another: the same accepted lengths and tree sizes. Returns the loop's drafter."""
    import hf_bpd
    from hf_bpd.tools.replay import replay_turn

    decoding = make_drafter()
    out = model.generate(
        ids, do_sample=False, max_new_tokens=new_tokens, custom_generate=hf_bpd.generate, assistant=decoding
    )
    replayed = replay_turn(model, make_drafter(), ids, out[0, ids.shape[1] :].tolist())
    assert replayed.accepted_lengths == decoding.stats.accepted_lengths, trial
    assert replayed.tree_sizes == decoding.stats.tree_sizes, trial
    return decoding
