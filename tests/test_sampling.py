"""`do_sample=True`: exact sampling over the draft tree (`accept.accept_tree`).

The exactness tests enumerate every possible draw of `accept_tree` itself (no Monte Carlo): the law of what
one step emits, pushed to the first one and two tokens, must equal plain sampling's law within 1e-9, with
path-aware processors and warpers. The stream tests check that a seed gives the same tokens as plain
`model.generate(do_sample=True)`.
"""

import itertools
import math

import pytest
import torch
from conftest import random_heads, tiny_model
from transformers import (
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hf_bpd
import hf_bpd.decode.accept
import hf_bpd.decode.call
from hf_bpd import BlockDrafter
from hf_bpd.drafting.tree import DraftTree

VOCAB = 6


def toy_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    """A toy LM over 6 tokens: fixed pseudo-random logits for every prefix."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.randn(VOCAB, generator=g, dtype=torch.float64).float() * 2.0


def processed_probs(processors, sequence: tuple[int, ...], logits: torch.Tensor) -> torch.Tensor:
    scores = processors(torch.tensor([sequence]), logits[None].clone())
    return torch.softmax(scores.double(), dim=-1)[0]


class _Branch(Exception):
    def __init__(self, probs):
        self.probs = probs


def emission_law(tree, prompt, processors, monkeypatch) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens one `accept_tree` step emits, by enumerating every draw it can make."""
    node_logits = torch.stack([toy_logits(tuple(prompt) + tuple(p)) for p in tree.node_paths()])
    law: dict[tuple[int, ...], float] = {}

    def run(script: list[int]) -> None:
        probs_seen = []

        def scripted(scores, do_sample):
            assert do_sample
            probs = torch.softmax(scores.double(), dim=-1)[0]  # the law of the draw, in float64
            if len(probs_seen) == len(script):
                raise _Branch(probs)
            probs_seen.append(probs[script[len(probs_seen)]].item())
            return torch.tensor([script[len(probs_seen) - 1]])

        monkeypatch.setattr(hf_bpd.decode.accept, "choose_tokens", scripted)
        try:
            result = hf_bpd.decode.accept.accept_tree(
                tree, node_logits, torch.tensor([prompt]), processors, StoppingCriteriaList(), do_sample=True
            )
        except _Branch as branch:
            for y in range(VOCAB):
                if branch.probs[y] > 0:
                    run([*script, y])
            return
        assert result.tokens == script
        law[tuple(script)] = law.get(tuple(script), 0.0) + math.prod(probs_seen)

    run([])
    return law


PROCESSORS = {
    "none": LogitsProcessorList(),
    "temperature+top_k": LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(4)]),
    "repetition+no_repeat+top_p": LogitsProcessorList(
        [RepetitionPenaltyLogitsProcessor(1.8), NoRepeatNGramLogitsProcessor(2), TopPLogitsWarper(0.85)]
    ),
}
TREES = {
    "chain": [(1, 2, 3)],
    "every token a child, deeper branches": [(0,), (1, 2), (1, 4, 0), (2,), (3,), (4,), (5, 5)],
    "root only (leaf bonus)": [],
}


@pytest.mark.parametrize("tree_name", TREES)
@pytest.mark.parametrize("proc_name", PROCESSORS)
def test_first_two_tokens_have_plain_sampling_law(tree_name, proc_name, monkeypatch):
    prompt = (0, 1, 2)
    processors = PROCESSORS[proc_name]
    tree = DraftTree.from_paths(2, TREES[tree_name], 64)
    sequence = (*prompt[:-1], 2)  # the root is the last accepted token
    law = emission_law(tree, sequence, processors, monkeypatch)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-9)

    def target(prefix: tuple[int, ...]) -> torch.Tensor:  # plain sampling's next-token law after `prefix`
        return processed_probs(processors, (*sequence, *prefix), toy_logits((*sequence, *prefix)))

    first, two = torch.zeros(VOCAB, dtype=torch.float64), torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for emitted, p in law.items():
        first[emitted[0]] += p
        if len(emitted) >= 2:
            two[emitted[0], emitted[1]] += p
        else:  # the step ended: the next step's root draws the second token from the model itself
            two[emitted[0]] += p * target(emitted)
    plain_first = target(())
    assert torch.allclose(first, plain_first, atol=1e-9, rtol=0)
    plain_two = torch.stack([plain_first[a] * target((a,)) for a in range(VOCAB)])
    assert torch.allclose(two, plain_two, atol=1e-9, rtol=0)
    if tree_name.startswith("every token"):
        assert any(len(e) > 1 for e in law)  # drafts were accepted with positive probability


def test_duplicate_drafts_merge_into_one_child():
    """Two drafts proposing the same token under one parent are one node: the draw cannot count it twice."""
    tree = DraftTree.from_paths(2, [(1, 2), (1, 3), (1, 2, 4)], 64)
    assert len(tree) == 5 and sorted(t for t, p in zip(tree.tokens, tree.parents) if p == 1) == [2, 3]


SAMPLING = [
    dict(temperature=0.8),
    dict(temperature=1.3, top_k=20, top_p=0.9),
    dict(temperature=0.7, repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=5),
    dict(top_p=0.8, typical_p=0.9, epsilon_cutoff=3e-4),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("options", SAMPLING, ids=lambda o: "+".join(o))
def test_same_seed_gives_plain_sampling_tokens(arch, options):
    model = tiny_model(arch, eos_token_id=None)
    drafter = BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=12)
    ids = torch.tensor([[5, 6, 7, 8]])
    accepted = 0
    for seed in range(4):
        torch.manual_seed(seed)
        ref = model.generate(ids, do_sample=True, max_new_tokens=30, **options)
        torch.manual_seed(seed)
        out = model.generate(
            ids, do_sample=True, max_new_tokens=30, custom_generate=hf_bpd.generate, assistant=drafter, **options
        )
        assert out.tolist() == ref.tolist(), (seed, options)
        accepted += sum(n - 1 for n in drafter.stats.accepted_lengths)
    assert accepted > 0  # the tree did work: drafted tokens were accepted under sampling


def test_generation_config_that_samples_is_followed():
    model = tiny_model("llama", eos_token_id=None)
    model.generation_config.do_sample = True
    model.generation_config.temperature = 0.9
    drafter = BlockDrafter(random_heads(model), top_k=3, max_tree_tokens=8)
    ids = torch.tensor([[3, 4, 5]])
    torch.manual_seed(7)
    ref = model.generate(ids, max_new_tokens=20)
    torch.manual_seed(7)
    out = model.generate(ids, max_new_tokens=20, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist()
    torch.manual_seed(7)
    greedy = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert greedy.tolist() != ref.tolist()  # it really sampled


def test_sampled_scores_and_logits_match_plain_sampling():
    model = tiny_model("qwen2", eos_token_id=None)
    drafter = BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8)
    ids = torch.tensor([[9, 8, 7]])
    kw = dict(do_sample=True, top_k=10, max_new_tokens=12, return_dict_in_generate=True)
    kw.update(output_scores=True, output_logits=True)
    torch.manual_seed(3)
    ref = model.generate(ids, **kw)
    torch.manual_seed(3)
    out = model.generate(ids, custom_generate=hf_bpd.generate, assistant=drafter, **kw)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert len(out.scores) == len(ref.scores) == 12
    for a, b in itertools.chain(zip(out.scores, ref.scores), zip(out.logits, ref.logits)):
        finite = b.isfinite()
        assert torch.equal(a.isfinite(), finite) and torch.allclose(a[finite], b[finite], atol=1e-4)


def test_several_return_sequences_are_refused_by_name():
    model = tiny_model("llama")
    drafter = BlockDrafter(random_heads(model), top_k=2, max_tree_tokens=4)
    with pytest.raises(ValueError, match="num_return_sequences"):
        model.generate(
            torch.tensor([[1, 2]]),
            do_sample=True,
            num_return_sequences=3,
            custom_generate=hf_bpd.generate,
            assistant=drafter,
        )


def test_preparing_a_drafter_leaves_the_global_random_stream_alone():
    """Binding heads, the packed-linear self-check and measuring the forward-cost curve use private
    generators: a user's `torch.manual_seed` before `generate` must drive the draws alone."""
    model = tiny_model("llama")
    drafter = BlockDrafter(random_heads(model), top_k=2, max_tree_tokens="auto")
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    hf_bpd.prepare(drafter, model)
    assert torch.equal(torch.rand(3), expected)
    torch.manual_seed(0)  # loading heads (and dropping their pointer) draws nothing either
    hf_bpd.load_packaged_drafter()
    assert torch.equal(torch.rand(3), expected)


# --- statistical check through `generate`: 20,000 seeded runs, chi-squared against the exact law ----------

RUNS = 20_000
CONTROL_RUNS = 2_000  # the wrong rule is rejected with far fewer runs: that is the power being shown
STAT_OPTIONS = dict(do_sample=True, temperature=0.8, top_k=3, top_p=0.95, repetition_penalty=1.5)


def exact_three_token_law(model, prompt: list[int]) -> dict[tuple[int, int, int], float]:
    """Plain sampling's law of the first three tokens, from the model's own processed distributions."""
    from transformers import GenerationConfig

    config = GenerationConfig(**STAT_OPTIONS)
    processors = model._get_logits_processor(config, input_ids_seq_length=len(prompt))

    def probs(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[:, -1].float()
        return torch.softmax(processors(torch.tensor([seq]), logits).double(), dim=-1)[0]

    law = {}
    p1 = probs(prompt)
    for a in p1.nonzero().flatten().tolist():
        p2 = probs([*prompt, a])
        for b in p2.nonzero().flatten().tolist():
            p3 = probs([*prompt, a, b])
            for c in p3.nonzero().flatten().tolist():
                law[(a, b, c)] = (p1[a] * p2[b] * p3[c]).item()
    return law


def chi_squared_p(counts: dict, law: dict, runs: int) -> float:
    """p-value of observed `counts` under `law` (cells expected below 5 pooled into one); 0 when an outcome
    falls outside the law's support (impossible under it)."""
    if not set(counts) <= set(law):
        return 0.0
    small = [k for k, p in law.items() if p * runs < 5]
    observed = [counts.get(k, 0) for k in law if k not in small] + [sum(counts.get(k, 0) for k in small)]
    expected = [law[k] * runs for k in law if k not in small] + [sum(law[k] for k in small) * runs]
    if not small:
        observed, expected = observed[:-1], expected[:-1]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(observed) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)).item()


def root_only_accept(tree, logits, sequence, processors, stopping, do_sample=False, typical=None, stop=None):
    """A WRONG rule (negative control): processors and warpers run at the root node only; deeper nodes
    draw from the raw distribution."""
    root = sequence.shape[1]

    def at_root_only(seq, scores):
        return processors(seq, scores) if seq.shape[1] == root else scores

    return _real_accept_tree(tree, logits, sequence, at_root_only, stopping, do_sample, typical, stop)


_real_accept_tree = hf_bpd.decode.accept.accept_tree


def sampled_three_tokens(model, drafter, prompt: list[int], runs: int = RUNS, **kw) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    ids = torch.tensor([prompt])
    accepted = 0
    for seed in range(runs):
        torch.manual_seed(seed)
        options = dict(max_new_tokens=3, custom_generate=hf_bpd.generate, assistant=drafter, **STAT_OPTIONS, **kw)
        out = model.generate(ids, **options)
        key = tuple(out[0, len(prompt) :].tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(n - 1 for n in drafter.stats.accepted_lengths)
    assert accepted > runs // 10  # drafted tokens were accepted in many runs: the tree rule is exercised
    return counts


@pytest.fixture(scope="module")
def small_vocab_model():
    model = tiny_model("llama", vocab_size=8, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    drafter = BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=2), top_k=3, max_tree_tokens=8)
    return model, drafter, [1, 2, 3, 1]


def test_chi_squared_sampling_law_through_generate(small_vocab_model):
    model, drafter, prompt = small_vocab_model
    law = exact_three_token_law(model, prompt)
    p = chi_squared_p(sampled_three_tokens(model, drafter, prompt), law, RUNS)
    assert p > 1e-3, p


def test_chi_squared_has_power_against_processing_at_the_root_only(small_vocab_model, monkeypatch):
    model, drafter, prompt = small_vocab_model
    monkeypatch.setattr(hf_bpd.decode.call, "accept_tree", root_only_accept)
    law = exact_three_token_law(model, prompt)
    p = chi_squared_p(sampled_three_tokens(model, drafter, prompt, CONTROL_RUNS), law, CONTROL_RUNS)
    assert p < 1e-6, p


def test_chi_squared_rejects_the_lossy_typical_acceptance(small_vocab_model):
    """Medusa's typical acceptance (the opt-in lossy option) fails the test the exact rule passes."""
    model, drafter, prompt = small_vocab_model
    law = exact_three_token_law(model, prompt)
    counts = sampled_three_tokens(model, drafter, prompt, CONTROL_RUNS, lossy_typical_acceptance=True)
    assert chi_squared_p(counts, law, CONTROL_RUNS) < 1e-6


def test_typical_child_follows_medusas_rule():
    tree = DraftTree.from_paths(0, [(1, 2), (3,)], max_nodes=8)  # root's children: 1 (node 1) and 3 (node 3)
    # entropy of this distribution is about 1.14 nats: threshold min(0.09, 0.3 * exp(-1.14)) = 0.09
    probs = torch.tensor([0.5, 0.3, 0.0, 0.05, 0.15])
    scores = probs.log()
    assert hf_bpd.decode.accept.typical_child(tree, 0, scores, 0.09, 0.3) == 1  # token 1 (p 0.3) beats token 3 (p 0.05)
    assert hf_bpd.decode.accept.typical_child(tree, 0, scores, 0.5, 10.0) is None  # threshold 0.5: no child qualifies
    assert hf_bpd.decode.accept.typical_child(tree, 3, scores, 0.09, 0.3) is None  # a leaf has no child to accept
    only_low = DraftTree.from_paths(0, [(3,)], max_nodes=8)
    assert hf_bpd.decode.accept.typical_child(only_low, 0, scores, 0.09, 0.3) is None  # p 0.05 is below the threshold


def test_typical_acceptance_needs_sampling_and_a_valid_setting():
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=2), top_k=3, max_tree_tokens=8)
    ids = torch.tensor([[1, 2, 3]])
    call = dict(max_new_tokens=4, custom_generate=hf_bpd.generate, assistant=drafter)
    with pytest.raises(ValueError, match="needs do_sample=True"):
        model.generate(ids, do_sample=False, lossy_typical_acceptance=True, **call)
    with pytest.raises(ValueError, match="epsilon, delta"):
        model.generate(ids, do_sample=True, lossy_typical_acceptance=(0.1,), **call)
    with pytest.raises(ValueError, match="0 < epsilon <= 1"):
        model.generate(ids, do_sample=True, lossy_typical_acceptance=(2.0, 0.3), **call)


def test_lattice_heads_with_a_rescorer_sample_exactly_under_a_tight_nucleus():
    """Lattice heads' warped estimates keep a finite floor outside the nucleus (k-best searches subtract
    scores), and decoding with a rescorer over them stays seeded plain sampling."""
    from hf_bpd.drafting.calibration import SamplingWarp
    from hf_bpd.drafting.drafter import LATTICE_FLOOR

    model = tiny_model("llama", eos_token_id=None)
    rescorer = hf_bpd.NgramRescorer(context_weight=0.5, num_paths=2, beam=4)
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3)
    drafter = BlockDrafter(heads, top_k=4, max_tree_tokens=12, rescorer=rescorer)
    hf_bpd.prepare(drafter, model)
    torch.manual_seed(0)
    hidden = torch.randn(2, model.config.hidden_size) * 10
    lattice = drafter.lattice(hidden, torch.tensor([5, 6]), warp=SamplingWarp(0.7, 0.3))
    assert lattice.logprobs.isfinite().all() and (lattice.logprobs == LATTICE_FLOOR).any()
    assert (lattice.logprobs[..., 0] > LATTICE_FLOOR).all()  # the favourite is always in the nucleus
    ids = torch.tensor([[5, 6, 7, 5, 6]])
    for seed in range(4):
        options = dict(do_sample=True, temperature=0.7, top_p=0.3, max_new_tokens=30)
        torch.manual_seed(seed)
        ref = model.generate(ids, **options)
        torch.manual_seed(seed)
        out = model.generate(ids, **options, custom_generate=hf_bpd.generate, assistant=drafter)
        assert out.tolist() == ref.tolist(), seed
