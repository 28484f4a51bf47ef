"""n-gram LMs over token ids (training, checked loading) and the global lattice rescorer."""

from __future__ import annotations

import gzip
import itertools
import math
import random

import pytest
import torch
from conftest import tiny_model

import hf_bpd
from hf_bpd import BlockDrafter, Lattice
from hf_bpd.drafting.rescoring.ngram import LN10, ContextNgram, NgramLM, NgramRescorer
from hf_bpd.training.train_ngram import add_unk, train_arpa, train_ngram

VOCAB = 97


def corpus(n: int = 60, seed: int = 0) -> list[list[int]]:
    """Token-id sentences with strong local structure (counting patterns) the n-gram can learn."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(3, 60)
        out.append([start + (i % 7) for i in range(rng.randrange(10, 30))])
    return out


@pytest.fixture(scope="module")
def ngram_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ngram")
    rows = [{"prompt_ids": s[:3], "response_ids": s[3:]} for s in corpus()]
    meta = train_ngram(rows, folder, order=3, vocab_size=VOCAB, heldout_fraction=0.1)
    assert meta["heldout_perplexity"] < 20 and meta["ngram_counts"][1] > 10
    return folder


def test_trained_arpa_has_unk_and_loads(ngram_dir):
    lm = NgramLM(ngram_dir / "ngram.arpa.gz", vocab_size=VOCAB)
    assert lm.order == 3
    # an id never seen in training is improbable, not impossible (no -100 log10)
    assert -20 < lm.sequence_logprob([96]) / LN10 < 0
    # the learnt pattern beats its reverse
    assert lm.sequence_logprob([11, 12, 13, 14]) > lm.sequence_logprob([14, 13, 12, 11]) + 5


def test_add_unk_is_idempotent_and_counts():
    text = train_arpa([" ".join(map(str, s)) for s in corpus(10)], order=2)
    assert text.count("\t<unk>\t") == 1 and add_unk(text) == text
    n1 = int(text.split("ngram 1=")[1].split()[0])
    assert n1 == len(text.split("\\1-grams:")[1].split("\\2-grams:")[0].strip().splitlines())


def test_ngram_files_that_would_score_wrongly_raise(tmp_path, ngram_dir):
    from kaldingram.train import NgramCounts

    # no <unk>: KenLM would score every unseen id -100
    counts = NgramCounts(2)
    counts.add_raw_counts_from_line("5 6 7")
    counts.cal_discounting_constants()
    counts.cal_f()
    counts.cal_bow()
    with open(tmp_path / "nounk.arpa", "w") as f:
        counts.print_as_arpa(fout=f)
    with pytest.raises(ValueError, match="<unk>"):
        NgramLM(tmp_path / "nounk.arpa")
    # words that are not token ids (an ARPA over text), or ids beyond the vocabulary
    text = add_unk((tmp_path / "nounk.arpa").read_text()).replace("\t5", "\thello")
    (tmp_path / "words.arpa").write_text(text)
    with pytest.raises(ValueError, match="not over this model's token ids"):
        NgramLM(tmp_path / "words.arpa", vocab_size=VOCAB)
    (tmp_path / "ids.arpa").write_text(add_unk((tmp_path / "nounk.arpa").read_text()))
    with pytest.raises(ValueError, match="not over this model's token ids"):
        NgramLM(tmp_path / "ids.arpa", vocab_size=6)  # id 7 is beyond a 6-token vocabulary
    # corrupt files
    (tmp_path / "junk.arpa").write_bytes(b"\x00\x01garbage")
    with pytest.raises(ValueError, match="ARPA"):
        NgramLM(tmp_path / "junk.arpa")
    good = gzip.decompress((ngram_dir / "ngram.arpa.gz").read_bytes())
    (tmp_path / "cut.arpa.gz").write_bytes(gzip.compress(good)[:200])
    with pytest.raises(ValueError):
        NgramLM(tmp_path / "cut.arpa.gz")
    with pytest.raises(FileNotFoundError):
        NgramLM(tmp_path / "missing.arpa")


def test_ngram_for_another_vocabulary_raises(ngram_dir):
    with pytest.raises(ValueError, match="vocabulary of 97"):
        NgramLM(ngram_dir / "ngram.arpa.gz", vocab_size=50000)
    rescorer = NgramRescorer(NgramLM(ngram_dir / "ngram.arpa.gz"))
    with pytest.raises(ValueError, match="another tokenizer"):
        rescorer.bind(tiny_model("llama", vocab_size=120))


class FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_ngram_for_another_tokenizer_raises(tmp_path):
    rows = [{"prompt_ids": s[:3], "response_ids": s[3:]} for s in corpus(20)]
    tok = FakeTokenizer({f"t{i}": i for i in range(VOCAB)})
    train_ngram(rows, tmp_path, order=2, vocab_size=VOCAB, tokenizer=tok, heldout_fraction=0.0)
    NgramLM(tmp_path / "ngram.arpa.gz", vocab_size=VOCAB, tokenizer=tok)  # same tokenizer: fine
    other = FakeTokenizer({f"u{i}": i for i in range(VOCAB)})
    with pytest.raises(ValueError, match="another tokenizer"):
        NgramLM(tmp_path / "ngram.arpa.gz", vocab_size=VOCAB, tokenizer=other)


def random_lattice(h: int, k: int, seed: int = 0) -> Lattice:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, h, VOCAB, generator=g) * 3
    return Lattice.from_logits(logits, k)


def brute_force(lattice: Lattice, lm: NgramLM, alpha: float, context: list[int]) -> list[tuple[float, tuple]]:
    tokens, logprobs = lattice.row(0)
    scored = []
    for ranks in itertools.product(range(lattice.top_k), repeat=lattice.num_positions):
        path = tuple(tokens[i][r] for i, r in enumerate(ranks))
        head = sum(logprobs[i][r] for i, r in enumerate(ranks))
        scored.append((head + alpha * lm.sequence_logprob(path, context), path))
    return sorted(scored, reverse=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wide_beam_search_is_exact_p_best(ngram_dir, seed):
    lm = NgramLM(ngram_dir / "ngram.arpa.gz", vocab_size=VOCAB)
    lattice = random_lattice(h=3, k=4, seed=seed)
    context = [1, 10, 11, 12]
    rescorer = NgramRescorer(lm, alpha=1.0, num_paths=5, beam=64)
    got = rescorer(lattice, torch.tensor([context]))[0]
    want = brute_force(lattice, lm, 1.0, context)[:5]
    assert [p.tokens for p in got] == [p for _, p in want]
    assert [p.score for p in got] == pytest.approx([s for s, _ in want], abs=1e-4)
    # acceptance estimates are log-probabilities, one per token
    assert all(len(p.token_logprobs) == 3 and all(lp <= 1e-9 for lp in p.token_logprobs) for p in got)


def test_zero_alpha_gives_the_heads_best_paths(ngram_dir):
    lm = NgramLM(ngram_dir / "ngram.arpa.gz", vocab_size=VOCAB)
    lattice = random_lattice(h=4, k=5, seed=3)
    got = NgramRescorer(lm, alpha=0.0, num_paths=3, beam=8)(lattice, torch.tensor([[1, 2]]))[0]
    assert [p.tokens for p in got] == [p.tokens for p in lattice.best_paths(0, 3)]


def test_ngram_repairs_a_repetitive_draft(ngram_dir):
    # heads slightly prefer "12 12" but the n-gram knows 12 is followed by 13
    lm = NgramLM(ngram_dir / "ngram.arpa.gz", vocab_size=VOCAB)
    tokens = torch.tensor([[[12, 40], [12, 13]]])
    logprobs = torch.tensor([[[-0.1, -3.0], [-0.6, -0.8]]])
    lattice = Lattice(tokens, logprobs)
    heads_only = lattice.best_paths(0, 1)[0].tokens
    rescored = NgramRescorer(lm, alpha=1.0)(lattice, torch.tensor([[9, 10, 11]]))[0][0].tokens
    assert heads_only == (12, 12) and rescored == (12, 13)


def test_context_ngram_counts_and_proposes_copies():
    ctx = ContextNgram(order=3)
    ctx.update([5, 6, 7, 5, 6, 8, 5, 6])
    assert ctx.predict([5, 6]) == {7: 0.5, 8: 0.5}
    assert ctx.predict([9, 7]) == {5: 1.0}  # backs off to the last token
    assert ctx.predict([99]) == {}
    ctx.update([5, 6, 7, 5, 6, 8, 5, 6, 7])  # extends: incremental
    assert ctx.predict([5, 6]) == {7: 2 / 3, 8: 1 / 3}
    ctx.update([1, 2])  # does not extend: starts over
    assert ctx.predict([1]) == {2: 1.0} and ctx.predict([5, 6]) == {}
    # a context-only rescorer drafts the copy even where the heads do not have it in their top-k
    lattice = Lattice(torch.tensor([[[30, 31], [32, 33]]]), torch.tensor([[[-1.0, -1.2], [-1.0, -1.2]]]))
    rescorer = NgramRescorer(None, context_weight=0.5, num_paths=1)
    best = rescorer(lattice, torch.tensor([[20, 21, 22, 23, 20, 21]]))[0][0]
    assert best.tokens == (22, 23) and best.token_logprobs[0] == pytest.approx(math.log(0.5))


def test_bad_rescorer_arguments_raise(ngram_dir):
    lm = NgramLM(ngram_dir / "ngram.arpa.gz", vocab_size=VOCAB)
    with pytest.raises(ValueError, match="needs an n-gram"):
        NgramRescorer(None)
    with pytest.raises(ValueError, match="num_paths"):
        NgramRescorer(lm, num_paths=8, beam=4)
    with pytest.raises(ValueError, match="context_weight"):
        NgramRescorer(lm, context_weight=1.0)
    with pytest.raises(ValueError, match="alpha"):
        NgramRescorer(lm, alpha=-1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_generation_with_ngram_rescorers_is_lossless(ngram_dir, arch):
    from conftest import random_heads

    model = tiny_model(arch, eos_token_id=None)
    lm = NgramLM(ngram_dir / "ngram.arpa.gz", vocab_size=VOCAB)
    rescorers = [
        NgramRescorer(lm, alpha=0.7),
        NgramRescorer(lm, alpha=0.7, num_paths=4, beam=8),
        NgramRescorer(None, context_weight=0.4, num_paths=2),
        NgramRescorer(lm, alpha=0.3, num_paths=4, beam=8, context_weight=0.3),
    ]
    prompt = torch.tensor([[1, 10, 11, 12, 13, 10, 11]])
    ref = model.generate(prompt, do_sample=False, max_new_tokens=40)
    for rescorer in rescorers:
        drafter = BlockDrafter(random_heads(model, 4), top_k=4, max_tree_tokens=12, rescorer=rescorer)
        out = model.generate(
            prompt, do_sample=False, max_new_tokens=40, custom_generate=hf_bpd.generate, assistant=drafter
        )
        assert out.tolist() == ref.tolist()
        assert drafter.stats.time_rescore > 0


def test_context_extension_drafts_a_copied_span_past_the_heads():
    ctx = ContextNgram(order=4)
    ctx.update([9, 8, 9, 8, 9, 7])  # "9 8" -> 9 was right once; "8 9" -> 8 then 7: a miss at match 2
    assert ctx.attempts[2] >= 1 and 0 < ctx.accuracy(2) < 1
    lattice = Lattice(torch.tensor([[[30, 31], [32, 33]]]), torch.tensor([[[-1.0, -1.2], [-1.0, -1.2]]]))
    rescorer = NgramRescorer(None, context_weight=0.5, context_extend=4)
    accepted = [20, 21, 22, 23, 24, 25, 26, 5, 20, 21]
    best = rescorer(lattice, torch.tensor([accepted]))[0][0]
    assert best.tokens == (22, 23, 24, 25, 26, 5)  # 2 lattice positions + 4 copied
    assert len(best.token_logprobs) == 6 and all(lp < 0 for lp in best.token_logprobs)
    # the drafter verifies the deep copy when the estimates make it worth it
    model = tiny_model("llama", eos_token_id=None)
    from conftest import random_heads

    prompt = torch.tensor([accepted])
    ref = model.generate(prompt, do_sample=False, max_new_tokens=20)
    drafter = BlockDrafter(random_heads(model, 2), top_k=2, max_tree_tokens=12, rescorer=rescorer)
    out = model.generate(prompt, do_sample=False, max_new_tokens=20, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist() and max(drafter.stats.tree_sizes) > 3
