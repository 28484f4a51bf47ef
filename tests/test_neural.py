"""Local neural rescoring (paper Alg. 2): the truncated small LM, its KV cache across steps, checks."""

from __future__ import annotations

import pytest
import torch
from conftest import random_heads, tiny_model

import hf_bpd
from hf_bpd import BlockDrafter, Lattice
from hf_bpd.drafting.rescoring.composed import ComposedRescorer
from hf_bpd.drafting.rescoring.neural import (
    NeuralRescorer,
    check_same_tokenizer,
    load_truncated_lm,
    save_truncated_lm,
    truncated_lm,
)


def lattice_for(model, h: int = 3, k: int = 4, seed: int = 0) -> Lattice:
    g = torch.Generator().manual_seed(seed)
    return Lattice.from_logits(torch.randn(1, h, model.config.vocab_size, generator=g), k)


def test_truncated_lm_keeps_the_first_layers_and_shared_weights():
    model = tiny_model("llama", num_hidden_layers=3)
    small = truncated_lm(model, 1)
    assert small.config.num_hidden_layers == 1 and len(small.model.layers) == 1
    assert torch.equal(small.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(small.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert torch.equal(small.get_output_embeddings().weight, model.get_output_embeddings().weight)
    with pytest.raises(ValueError, match="num_layers"):
        truncated_lm(model, 4)


def greedy_alg2(lm, lattice: Lattice, context: list[int], alpha: float) -> list[int]:
    """Alg. 2 without a cache: a full forward of the small LM for every position."""
    path = []
    for j in range(lattice.num_positions):
        with torch.no_grad():
            logp = torch.log_softmax(lm(torch.tensor([context + path])).logits[0, -1], -1)
        z = lattice.logprobs[0, j] + alpha * logp[lattice.tokens[0, j]]
        path.append(int(lattice.tokens[0, j, int(z.argmax())]))
    return path


def test_rescoring_matches_algorithm_2_and_reuses_its_cache_across_steps():
    model = tiny_model("llama")
    small = truncated_lm(model, 1)
    rescorer = NeuralRescorer(small, alpha=2.0)
    context = [1, 5, 9, 14, 3]
    for step in range(4):  # the context grows as decoding accepts tokens; the cache follows it
        lattice = lattice_for(model, seed=step)
        got = rescorer(lattice, torch.tensor([context]))[0][0]
        assert list(got.tokens) == greedy_alg2(small, lattice, context, 2.0)
        assert rescorer._cached == context  # drafted tokens cropped away again
        context = context + [7 + step, 20 + step]
    # a new prompt that does not extend the cache: only the common prefix is kept
    lattice = lattice_for(model, seed=9)
    got = rescorer(lattice, torch.tensor([[1, 5, 40]]))[0][0]
    assert list(got.tokens) == greedy_alg2(small, lattice, [1, 5, 40], 2.0)


def test_alpha_zero_keeps_the_heads_top1():
    model = tiny_model("llama")
    lattice = lattice_for(model, seed=4)
    got = NeuralRescorer(truncated_lm(model, 1), alpha=0.0)(lattice, torch.tensor([[1, 2, 3]]))[0][0]
    assert list(got.tokens) == lattice.tokens[0, :, 0].tolist()


def test_truncated_layers_save_and_rebuild_on_the_base(tmp_path):
    model = tiny_model("llama", num_hidden_layers=3)
    small = truncated_lm(model, 2)
    with torch.no_grad():
        small.model.layers[1].mlp.down_proj.weight.add_(0.25)  # "fine-tuned"
    save_truncated_lm(small, tmp_path, model)
    assert {p.name for p in tmp_path.iterdir()} == {"layers.safetensors", "truncated_lm.json"}
    rebuilt = load_truncated_lm(model, tmp_path)
    x = torch.tensor([[1, 4, 9, 16]])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x).logits, small(x).logits, atol=5e-3, rtol=5e-3)  # fp16 layers
    rescorer = NeuralRescorer.from_pretrained(tmp_path)
    rescorer.bind(model)
    assert rescorer.lm.config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="another base model"):
        NeuralRescorer.from_pretrained(tmp_path).bind(tiny_model("llama", num_hidden_layers=3, seed=5))
    (tmp_path / "layers.safetensors").write_bytes(b"corrupt")
    with pytest.raises(ValueError, match="not a readable"):
        load_truncated_lm(model, tmp_path)


class FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_rescorer_lm_with_another_tokenizer_raises():
    model = tiny_model("llama")
    base_tok = FakeTokenizer({f"t{i}": i for i in range(97)})
    other = FakeTokenizer({**{f"t{i}": i for i in range(96)}, "zz": 96})
    check_same_tokenizer(base_tok, FakeTokenizer(base_tok.get_vocab()))
    with pytest.raises(ValueError, match="another tokenizer"):
        NeuralRescorer(truncated_lm(model, 1), tokenizer=other, base_tokenizer=base_tok)
    with pytest.raises(ValueError, match="vocabulary of 120"):
        NeuralRescorer(tiny_model("llama", vocab_size=120)).bind(model)
    with pytest.raises(ValueError, match="eos_token_id"):
        NeuralRescorer(tiny_model("llama", eos_token_id=5)).bind(model)
    with pytest.raises(ValueError, match="either an LM"):
        NeuralRescorer()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_generation_with_neural_and_composed_rescorers_is_lossless(arch):
    from hf_bpd.drafting.rescoring.ngram import NgramRescorer

    model = tiny_model(arch, eos_token_id=None)
    prompt = torch.tensor([[1, 10, 11, 12, 13, 10, 11]])
    ref = model.generate(prompt, do_sample=False, max_new_tokens=40)
    rescorers = [
        NeuralRescorer(truncated_lm(model, 1), alpha=1.0),
        ComposedRescorer([NeuralRescorer(truncated_lm(model, 1)), NgramRescorer(None, context_weight=0.3)]),
    ]
    for rescorer in rescorers:
        drafter = BlockDrafter(random_heads(model, 3), top_k=4, max_tree_tokens=10, rescorer=rescorer)
        for _ in range(2):  # a second generate starts from a reset cache
            out = model.generate(
                prompt, do_sample=False, max_new_tokens=40, custom_generate=hf_bpd.generate, assistant=drafter
            )
            assert out.tolist() == ref.tolist()


def test_train_rescorer_lowers_the_loss_and_checkpoints_each_epoch(tmp_path):
    from hf_bpd.training.train_rescorer import train_rescorer

    model = tiny_model("llama", num_hidden_layers=3)
    rows = [{"prompt_ids": [1, 3 + i % 5], "response_ids": [10 + (i + j) % 7 for j in range(12)]} for i in range(40)]
    saved = []
    lm, history = train_rescorer(
        model,
        rows,
        num_layers=1,
        epochs=3,
        lr=1e-2,
        batch_tokens=128,
        progress=False,
        on_epoch=lambda lm, h: saved.append(len(h)),
    )
    assert saved == [2, 3, 4] and len(history) == 4
    assert history[-1]["val_loss"] < history[0]["val_loss"] - 0.5
    # the embeddings and output head stay the base model's (frozen, shared)
    assert torch.equal(lm.get_output_embeddings().weight, model.get_output_embeddings().weight)


def test_a_rescorer_saved_as_layers_is_rebuilt_on_the_model_at_the_first_generate(tmp_path):
    # the shipped neural rescorer is a layers-only folder: the drafter's binding to the model rebuilds its
    # LM, with no `bind` call by the user, and a rescorer that does not fit the model is refused there
    model = tiny_model("llama", num_hidden_layers=3, eos_token_id=None)
    save_truncated_lm(truncated_lm(model, 1), tmp_path, model)
    rescorer = NeuralRescorer.from_pretrained(tmp_path, alpha=1.0)
    assert rescorer.lm is None
    prompt = torch.tensor([[1, 10, 11, 12, 13, 10, 11]])
    ref = model.generate(prompt, do_sample=False, max_new_tokens=30)
    drafter = BlockDrafter(random_heads(model, 3), top_k=4, max_tree_tokens=10, rescorer=rescorer)
    kw = dict(do_sample=False, max_new_tokens=30, custom_generate=hf_bpd.generate, assistant=drafter)
    assert model.generate(prompt, **kw).tolist() == ref.tolist()
    assert rescorer.lm is not None and rescorer.lm.config.num_hidden_layers == 1
    other = tiny_model("llama", vocab_size=120, eos_token_id=None)
    drafter = BlockDrafter(random_heads(other, 3), top_k=4, max_tree_tokens=10, rescorer=NeuralRescorer(model))
    with pytest.raises(ValueError, match="vocabulary of 97"):
        other.generate(prompt, do_sample=False, max_new_tokens=5, custom_generate=hf_bpd.generate, assistant=drafter)
