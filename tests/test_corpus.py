"""Retrieval drafts: chains looked up in a corpus of the model's own answers, merged into the tree."""

import math

import numpy as np
import pytest
import torch
from conftest import tiny_model

import hf_bpd
from hf_bpd import BlockDrafter
from hf_bpd.drafting.calibration import HEADS, AcceptanceCalibration, Arc
from hf_bpd.drafting.corpus import CorpusIndex, corpus_source
from hf_bpd.drafting.lookup import merge_chain
from hf_bpd.drafting.tree import DraftTree


def test_continuations_are_the_most_frequent_nodes_of_the_longest_match():
    index = CorpusIndex.from_answers([[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [2, 3, 4, 5, 7]], max_ngram=3)
    # "2 3" is the longest match of [8, 2, 3]: three occurrences, all followed by 4, then 5 twice and 6 once;
    # after "4 5" only one occurrence goes on (the first answer ends there), with 7
    chains, n = index.continuations([8, 2, 3], 5, 10)
    assert n == 2 and [tokens for tokens, _ in chains] == [[4, 6], [4, 5, 7]]
    assert np.allclose(chains[1][1], [math.log(3 / 4), math.log(2 / 4), math.log(1 / 3)])
    assert np.allclose(chains[0][1], [math.log(3 / 4), math.log(1 / 4)])
    # best first by path frequency: with two nodes, 4 then 5 (3/4 * 2/4 beats 3/4 * 1/4)
    assert [tokens for tokens, _ in index.continuations([8, 2, 3], 5, 2)[0]] == [[4, 5]]
    assert [tokens for tokens, _ in index.continuations([8, 2, 3], 1, 10)[0]] == [[4]]
    # the trigram "9 2 3" occurs once: its own continuation, then the answer ends (no chain crosses it)
    assert [tokens for tokens, _ in index.continuations([9, 2, 3], 5, 10)[0]] == [[4, 6]]
    assert index.continuations([42], 5, 10) == ([], 0)


def test_matches_equal_a_brute_force_search():
    rng = np.random.default_rng(0)
    answers = [rng.integers(0, 6, size=rng.integers(1, 30)).tolist() for _ in range(40)]
    index = CorpusIndex.from_answers(answers, max_ngram=4)
    flat = [(a, i) for a in answers for i in range(len(a))]
    for _ in range(200):
        context = rng.integers(0, 6, size=rng.integers(1, 7)).tolist()
        ends, n = index.matches(np.array(context))
        want_n, want = 0, []
        for m in range(min(4, len(context)), 0, -1):
            want = [(id(a), i) for a, i in flat if i >= m - 1 and a[i - m + 1 : i + 1] == context[-m:]]
            if want:
                want_n = m
                break
        assert n == want_n and len(ends) == len(want)
        assert all(index.tokens[e - k] == context[-1 - k] for e in ends for k in range(n))


def test_many_matches_are_read_evenly_over_the_corpus():
    answers = [[1, 2]] * 100 + [[1, 3]] * 100  # the later half continues "1" otherwise
    index = CorpusIndex.from_answers(answers, max_matches=10)
    ends, n = index.matches(np.array([1]))
    assert n == 1 and len(ends) == 10 and len(set(ends.tolist())) == 10
    assert sorted(set(index.tokens[ends + 1].tolist())) == [2, 3]


def test_merged_chain_keeps_its_own_arcs_and_source():
    tree = DraftTree.from_paths(0, [(1, 2), (3,)], 8)
    arcs = [Arc(0.0, HEADS), Arc(math.log(0.9), HEADS), Arc(math.log(0.1), HEADS), Arc(math.log(0.05), HEADS)]
    chain_arcs = [Arc(math.log(0.95), corpus_source(4)), Arc(math.log(0.6), corpus_source(4))]
    merged, merged_arcs = merge_chain(tree, arcs, [1, 4], chain_arcs, AcceptanceCalibration(), 8)
    paths = merged.node_paths()
    assert set(paths) == {(), (1,), (1, 2), (3,), (1, 4)}
    assert merged_arcs[paths.index((1,))].source == corpus_source(4)  # 0.95 beats the heads' 0.9
    assert merged_arcs[paths.index((1, 4))].logprob == math.log(0.6)
    assert all(merged.parents[i] < i for i in range(1, len(merged)))


def test_a_drafter_with_a_corpus_drafts_its_chain_and_decodes_exactly():
    model = tiny_model("llama", eos_token_id=None)
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=2)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1][:, -1]
    index = CorpusIndex.from_answers([[7, 8, 20, 21, 22, 23], [3, 8, 20, 21, 30]])
    for corpus, holds in ((index, True), (None, False)):
        drafter = BlockDrafter(heads, top_k=2, max_tree_tokens=12, context_lookup=0, calibrate=False, corpus=corpus)
        hf_bpd.prepare(drafter, model)
        (tree,) = drafter.draft(hidden, ids)
        assert ((20, 21, 22, 23) in tree.node_paths()) is holds
    ref = model.generate(ids, do_sample=False, max_new_tokens=20)
    drafter = BlockDrafter(heads, top_k=2, max_tree_tokens=12, corpus=index)
    out = model.generate(ids, do_sample=False, max_new_tokens=20, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist()


def test_a_saved_drafter_loads_its_corpus_back(tmp_path):
    model = tiny_model("llama", eos_token_id=None)
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=2)
    index = CorpusIndex.from_answers([[7, 8, 20, 21, 22, 23], [3, 8, 20, 21, 30]], max_ngram=3)
    folder = BlockDrafter(heads, top_k=2, corpus=index, corpus_nodes=5).save_pretrained(tmp_path / "d")
    loaded = BlockDrafter.from_pretrained(folder)
    assert loaded.corpus_nodes == 5 and loaded.corpus.max_ngram == 3
    assert loaded.corpus.tokens.tolist() == index.tokens.tolist()
    assert loaded.corpus.continuations([8], 4, 5) == index.continuations([8], 4, 5)
    plain = BlockDrafter(heads, top_k=2).save_pretrained(tmp_path / "plain")
    assert BlockDrafter.from_pretrained(plain).corpus is None
    index.save(tmp_path / "corpus.npz")  # a path is loaded at once; anything else is refused at once
    assert BlockDrafter(heads, corpus=str(tmp_path / "corpus.npz")).corpus.tokens.tolist() == index.tokens.tolist()
    with pytest.raises(TypeError, match="corpus must be a CorpusIndex"):
        BlockDrafter(heads, corpus=[[7, 8, 20]])


def test_a_corpus_must_end_its_answers():
    with pytest.raises(ValueError, match="SEPARATOR"):
        CorpusIndex(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match=">= 0"):
        CorpusIndex(np.array([1, -5, -1]))


def test_corpus_drafts_keep_seeded_sampling_and_batches_exact():
    model = tiny_model("llama", eos_token_id=None)
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=2)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    greedy = model.generate(ids, do_sample=False, max_new_tokens=20)[0].tolist()
    index = CorpusIndex.from_answers([greedy[3:], greedy[5:12], [8, 3, 2, 1]])  # its own continuation, and noise
    drafter = BlockDrafter(heads, top_k=2, max_tree_tokens=12, corpus=index)
    kw = dict(max_new_tokens=20, custom_generate=hf_bpd.generate, assistant=drafter)
    for seed in range(3):
        torch.manual_seed(seed)
        ref = model.generate(ids[:1], do_sample=True, max_new_tokens=20)
        torch.manual_seed(seed)
        assert model.generate(ids[:1], do_sample=True, **kw).tolist() == ref.tolist()
    ref = model.generate(ids, do_sample=False, max_new_tokens=20, attention_mask=torch.ones_like(ids))
    out = model.generate(ids, do_sample=False, attention_mask=torch.ones_like(ids), **kw)
    assert out.tolist() == ref.tolist()
    drafter = BlockDrafter(heads, top_k=2, max_tree_tokens=12, context_lookup=0, corpus=index)
    assert model.generate(ids[:1], do_sample=False, **kw | {"assistant": drafter})[0].tolist() == greedy
    assert max(drafter.stats.accepted_lengths) > 3  # two heads draft at most 2 tokens: the corpus chain was taken


def test_a_packaged_drafter_loads_the_corpus_its_drafter_json_names(tmp_path, monkeypatch):
    import json

    import hf_bpd.io.packaged as packaged

    model = tiny_model("llama", eos_token_id=None)
    hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=2).save_pretrained(tmp_path / "heads")
    CorpusIndex.from_answers([[7, 8, 20, 21]], max_ngram=2).save(tmp_path / "corpus.npz")
    (tmp_path / "drafter.json").write_text(json.dumps({"top_k": 2, "corpus": "corpus.npz", "corpus_nodes": 3}))
    monkeypatch.setattr(packaged, "packaged_heads_dir", lambda model=None, kind="default": tmp_path / "heads")
    drafter = hf_bpd.load_packaged_drafter()
    assert drafter.corpus_nodes == 3 and drafter.corpus.tokens.tolist() == [7, 8, 20, 21, -1]
    assert hf_bpd.load_packaged_drafter(corpus=None).corpus is None  # an argument still overrides drafter.json
