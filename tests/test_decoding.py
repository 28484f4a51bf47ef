"""The decoding loop: exact equality with `model.generate(do_sample=False)`, cache bookkeeping (oracle
tau = h + 1), stopping, outputs, call styles and errors."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from conftest import random_heads, tiny_model
from transformers import RepetitionPenaltyLogitsProcessor

import hf_bpd
from hf_bpd import BlockDrafter, Lattice, ScoredPath
from hf_bpd.kv import compact_cache, contiguous_kv


def run_both(model, drafter, input_ids, **kw):
    ref = model.generate(input_ids, do_sample=False, **kw)
    out = model.generate(input_ids, do_sample=False, custom_generate=hf_bpd.generate, assistant=drafter, **kw)
    return ref, out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_greedy_identical_tiny_models(arch, attn):
    model = tiny_model(arch, attn=attn, eos_token_id=None)
    drafter = BlockDrafter(random_heads(model, num_heads=3), top_k=4, max_tree_tokens=12)
    g = torch.Generator().manual_seed(1)
    for trial in range(6):
        prompt_len = int(torch.randint(1, 20, (1,), generator=g))
        ids = torch.randint(3, 97, (1, prompt_len), generator=g)
        for max_new in (1, 2, 7, 33):
            ref, out = run_both(model, drafter, ids, max_new_tokens=max_new)
            assert out.shape == ref.shape == (1, prompt_len + max_new)
            assert out.tolist() == ref.tolist(), (arch, attn, trial, max_new)
            assert drafter.stats.new_tokens == max_new


def copying_heads(model, num_heads=3):
    """Heads that always predict the base model's own next token (zero residuals = the initialisation):
    on a repetitive random model these drafts are often accepted, exercising multi-token acceptance."""
    return hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=num_heads)


def test_multi_token_acceptance_happens_and_is_exact():
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(copying_heads(model, 4), top_k=3, max_tree_tokens=16)
    ids = torch.tensor([[5, 6, 7]])
    ref, out = run_both(model, drafter, ids, max_new_tokens=60)
    assert out.tolist() == ref.tolist()
    assert max(drafter.stats.accepted_lengths) > 1  # drafts were accepted, not just bonus tokens


def test_eos_inside_accepted_draft_stops_exactly():
    model = tiny_model("llama", eos_token_id=None)
    ids = torch.tensor([[5, 6, 7]])
    drafter = BlockDrafter(copying_heads(model, 4), top_k=3, max_tree_tokens=16)
    ref_long = model.generate(ids, do_sample=False, max_new_tokens=60)
    _ = model.generate(ids, do_sample=False, max_new_tokens=60, custom_generate=hf_bpd.generate, assistant=drafter)
    # Pick as eos a token that the drafter produced INSIDE a multi-token step (not as a step's first token).
    gen = ref_long[0, 3:].tolist()
    pos, step_starts = 1, set()
    for n in drafter.stats.accepted_lengths:
        step_starts.add(pos)
        pos += n
    inside = [i for i in range(1, len(gen)) if i not in step_starts and gen[i] not in gen[:i]]
    assert inside, "test needs a token first generated inside an accepted block"
    eos = gen[inside[0]]
    ref, out = run_both(model, drafter, ids, max_new_tokens=60, eos_token_id=eos, pad_token_id=0)
    assert out.tolist() == ref.tolist()
    assert out[0, -1].item() == eos and out.shape[1] == 3 + inside[0] + 1


def test_repetition_penalty_processor_is_honoured():
    model = tiny_model("qwen2", eos_token_id=None)
    drafter = BlockDrafter(copying_heads(model, 3), top_k=4, max_tree_tokens=10)
    ids = torch.tensor([[9, 10, 11, 12]])
    for penalty in (1.3, 2.0):
        ref, out = run_both(model, drafter, ids, max_new_tokens=40, repetition_penalty=penalty)
        assert out.tolist() == ref.tolist()
    # an explicit processor list works too
    procs = [RepetitionPenaltyLogitsProcessor(1.5)]
    ref = model.generate(ids, do_sample=False, max_new_tokens=30, logits_processor=procs)
    out = model.generate(
        ids,
        do_sample=False,
        max_new_tokens=30,
        logits_processor=procs,
        custom_generate=hf_bpd.generate,
        assistant=drafter,
    )
    assert out.tolist() == ref.tolist()


def test_attention_mask_with_prompt_given_by_tokenizer_style_inputs():
    model = tiny_model("mistral", eos_token_id=None)
    drafter = BlockDrafter(random_heads(model), top_k=4, max_tree_tokens=8)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    mask = torch.ones_like(ids)
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=20,
        custom_generate=hf_bpd.generate,
        assistant=drafter,
    )
    assert out.tolist() == ref.tolist()


class OracleDrafter(BlockDrafter):
    """Knows the true greedy continuation: puts each true token at a random rank of the heads' top-k
    lattice, and (as its rescorer) picks the path of true tokens out of that lattice."""

    def __init__(self, heads, reference: torch.Tensor, **kw):
        # no context lookup: its chain would compete with the true path for the tree's nodes (on the random
        # heads' estimates) and could push the true path's deep nodes out of a fixed-size tree
        kw.setdefault("context_lookup", 0)
        super().__init__(heads, rescorer=self._pick_true_path, **kw)
        self.reference = reference[0].tolist()
        self.rng = torch.Generator().manual_seed(0)
        self._context_len = 0

    def lattice(self, hidden_last, root, context=None, warp=None):
        lattice = super().lattice(hidden_last, root, context, warp)
        tokens = lattice.tokens.clone()
        start = self._context_len
        for i in range(lattice.num_positions):
            if start + i < len(self.reference):
                true = self.reference[start + i]
                if true not in tokens[0, i].tolist():
                    tokens[0, i, int(torch.randint(0, lattice.top_k, (1,), generator=self.rng))] = true
        return Lattice(tokens, lattice.logprobs)

    def draft(self, hidden_last, context, max_depth=None, max_tokens=None, warp=None, **kwargs):
        self._context_len = context.shape[1]
        return super().draft(hidden_last, context, max_depth, max_tokens, warp=warp, **kwargs)

    def _pick_true_path(self, lattice, context):
        truth = torch.tensor([self.reference[context.shape[1] : context.shape[1] + lattice.num_positions]])
        n = int(lattice.oracle_length(truth)[0])
        return [[ScoredPath(tuple(truth[0, :n].tolist()), 0.0)]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_oracle_drafter_reaches_h_plus_one(arch):
    """Proof that tree, mask, positions and cache compaction are exact: with the true continuation in
    the lattice every full step accepts all h drafts plus the bonus token."""
    model = tiny_model(arch, eos_token_id=None)
    h, max_new = 4, 41
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    reference = model.generate(ids, do_sample=False, max_new_tokens=max_new)
    drafter = OracleDrafter(random_heads(model, num_heads=h), reference, top_k=5, max_tree_tokens=20)
    out = model.generate(
        ids, do_sample=False, max_new_tokens=max_new, custom_generate=hf_bpd.generate, assistant=drafter
    )
    assert out.tolist() == reference.tolist()
    lengths = drafter.stats.accepted_lengths
    assert lengths[:-1] == [h + 1] * (len(lengths) - 1)
    assert 1 <= lengths[-1] <= h + 1
    assert drafter.stats.steps == -(-(max_new - 1) // (h + 1))  # ceil((N - 1) / (h + 1))


def test_local_custom_generate_folder_matches_callable(tmp_path):
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(copying_heads(model, 3), top_k=4, max_tree_tokens=10)
    ids = torch.tensor([[5, 6, 7, 8]])
    folder = Path(hf_bpd.__file__).parent  # holds custom_generate/
    callable_out = model.generate(
        ids, do_sample=False, max_new_tokens=25, custom_generate=hf_bpd.generate, assistant=drafter
    )
    callable_steps = drafter.stats.accepted_lengths
    folder_out = model.generate(
        ids, do_sample=False, max_new_tokens=25, custom_generate=str(folder), trust_remote_code=True, assistant=drafter
    )
    assert folder_out.tolist() == callable_out.tolist()
    assert drafter.stats.accepted_lengths == callable_steps


class RecordingStreamer:
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_prompt_then_every_token_then_end():
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(copying_heads(model, 3), top_k=3, max_tree_tokens=8)
    ids = torch.tensor([[5, 6, 7]])
    plain, ours = RecordingStreamer(), RecordingStreamer()
    ref = model.generate(ids, do_sample=False, max_new_tokens=20, streamer=plain)
    out = model.generate(
        ids,
        do_sample=False,
        max_new_tokens=20,
        assistant=drafter,
        custom_generate=functools.partial(hf_bpd.generate, streamer=ours),
    )
    assert out.tolist() == ref.tolist()
    assert ours.puts == plain.puts and ours.ended and plain.ended
    folder_streamer = RecordingStreamer()
    model.generate(
        ids,
        do_sample=False,
        max_new_tokens=20,
        assistant=drafter,
        streamer=folder_streamer,
        custom_generate=str(Path(hf_bpd.__file__).parent),
        trust_remote_code=True,
    )
    assert folder_streamer.puts == plain.puts and folder_streamer.ended


def test_return_dict_scores_and_logits_match_generate():
    model = tiny_model("qwen2", eos_token_id=None)
    drafter = BlockDrafter(copying_heads(model, 3), top_k=3, max_tree_tokens=8)
    ids = torch.tensor([[5, 6, 7]])
    kw = dict(
        do_sample=False,
        max_new_tokens=15,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        repetition_penalty=1.2,
    )
    ref = model.generate(ids, **kw)
    out = model.generate(ids, custom_generate=hf_bpd.generate, assistant=drafter, **kw)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert len(out.scores) == len(ref.scores) == 15 and len(out.logits) == 15
    for a, b in zip(out.scores, ref.scores):
        assert a.shape == b.shape and a.argmax() == b.argmax()
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    assert out.past_key_values.get_seq_length() >= ids.shape[1] + 14


def test_stats_are_consistent():
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(copying_heads(model, 4), top_k=3, max_tree_tokens=16)
    model.generate(
        torch.tensor([[5, 6, 7]]),
        do_sample=False,
        max_new_tokens=50,
        custom_generate=hf_bpd.generate,
        assistant=drafter,
    )
    s = drafter.stats
    assert s.new_tokens == 50 == 1 + sum(s.accepted_lengths)
    assert s.steps == len(s.accepted_lengths) and s.forwards == s.steps + 1
    assert s.block_efficiency == pytest.approx(50 / (s.steps + 1))
    assert all(1 <= n <= 16 for n in s.tree_sizes)
    assert set(s.time_per_step()) == {
        "heads",
        "rescore",
        "lattice_tree",
        "verify_forward",
        "accept",
        "cache_compaction",
    }


def test_growth_by_previous_heads_counts_as_heads_time_when_sampling(monkeypatch):
    """A sampled step grows its tree inside the drafter's tree phase; that growth is the heads' time (as in
    a fused greedy step), not the tree's. A fake clock in the drafter module makes each growth cost 1 s."""
    from types import SimpleNamespace

    from hf_bpd.drafting import drafter as drafter_module

    now = [0.0]

    def perf_counter():
        now[0] += 1e-6
        return now[0]

    monkeypatch.setattr(drafter_module, "time", SimpleNamespace(perf_counter=perf_counter))
    growths, grow = [], BlockDrafter.grow

    def costly_grow(self, *args, **kwargs):
        growths.append(1)
        now[0] += 1.0
        return grow(self, *args, **kwargs)

    monkeypatch.setattr(BlockDrafter, "grow", costly_grow)
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(random_heads(model, num_heads=3, token_input="previous", std=0.05), 3, 8)
    assert drafter.grows_on_device
    torch.manual_seed(0)
    model.generate(
        torch.tensor([[5, 6, 7]]), do_sample=True, max_new_tokens=20, custom_generate=hf_bpd.generate, assistant=drafter
    )
    s = drafter.stats
    assert len(growths) == s.steps > 0
    assert s.time_heads == pytest.approx(len(growths), abs=1e-3)
    assert 0 <= s.time_tree < 1e-3


def test_max_tree_tokens_one_is_plain_decoding():
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(random_heads(model), top_k=3, max_tree_tokens=1)
    ref, out = run_both(model, drafter, torch.tensor([[5, 6]]), max_new_tokens=12)
    assert out.tolist() == ref.tolist()
    assert drafter.stats.accepted_lengths == [1] * 11 and drafter.stats.block_efficiency == 1.0


def test_compact_cache_keeps_exactly_the_accepted_tree_entries():
    from transformers import DynamicCache

    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    keys = torch.arange(2 * 1 * 9 * 4, dtype=torch.float32).view(1, 2, 9, 4)
    cache.update(keys.clone(), -keys.clone(), layer_idx=0)  # 5 cached + 4 tree entries
    compact_cache(cache, num_tree=4, keep=torch.tensor([0, 2, 3]))
    k, v = cache.layers[0].keys, cache.layers[0].values
    assert k.shape == (1, 2, 8, 4)
    assert torch.equal(k, keys[:, :, [0, 1, 2, 3, 4, 5, 7, 8]]) and torch.equal(v, -k)
    assert not k.is_contiguous()  # a view of the old tensor: no copy of the context
    # for a compiled forward (it guards on strides) `verify_tree` copies the kept entries out, contiguous
    cache = DynamicCache(config=model.config)
    cache.update(keys.clone(), -keys.clone(), layer_idx=0)
    compact_cache(cache, num_tree=4, keep=torch.tensor([0, 2, 3]))
    contiguous_kv(cache)
    assert torch.equal(cache.layers[0].keys, k) and cache.layers[0].keys.is_contiguous()
    assert cache.layers[0].values.is_contiguous()


# ---- errors -------------------------------------------------------------------------------------------


def test_bad_drafter_arguments_raise():
    model = tiny_model("llama")
    heads = random_heads(model)
    with pytest.raises(ValueError, match="top_k"):
        BlockDrafter(heads, top_k=0)
    with pytest.raises(ValueError, match="top_k"):
        BlockDrafter(heads, top_k=10_000)
    with pytest.raises(ValueError, match="max_tree_tokens"):
        BlockDrafter(heads, max_tree_tokens=0)
    with pytest.raises(TypeError, match="rescorer"):
        BlockDrafter(heads, rescorer="ngram")


def test_heads_for_another_model_raise():
    model = tiny_model("llama")
    other = tiny_model("llama", seed=1)
    drafter = BlockDrafter(random_heads(other))
    with pytest.raises(ValueError, match="fingerprint"):
        model.generate(torch.tensor([[5, 6]]), max_new_tokens=3, custom_generate=hf_bpd.generate, assistant=drafter)
    wider = tiny_model("llama", hidden_size=48)
    with pytest.raises(ValueError, match="hidden size"):
        model.generate(
            torch.tensor([[5, 6]]),
            max_new_tokens=3,
            custom_generate=hf_bpd.generate,
            assistant=BlockDrafter(random_heads(wider)),
        )


def test_a_model_cast_after_a_call_is_bound_again_and_its_heads_follow_it():
    # the binding is kept across calls; `model.to(dtype)` in between must not leave the heads behind
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(random_heads(model, token_input="previous"), top_k=3, max_tree_tokens=8)
    ids = torch.tensor([[5, 6, 7, 5, 6]])
    for dtype in (torch.float32, torch.float64):
        model.to(dtype)
        ref, out = run_both(model, drafter, ids, max_new_tokens=20)
        assert out.tolist() == ref.tolist()
        assert next(drafter.heads.parameters()).dtype == dtype


def test_input_longer_than_context_raises():
    model = tiny_model("llama", max_position_embeddings=32)
    drafter = BlockDrafter(random_heads(model))
    with pytest.raises(ValueError, match="context"):
        model.generate(
            torch.randint(3, 90, (1, 40)), max_new_tokens=3, custom_generate=hf_bpd.generate, assistant=drafter
        )


def test_model_rejecting_4d_masks_raises():
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"  # cannot take an arbitrary tree mask
    with pytest.raises(ValueError, match="4D"):
        hf_bpd.decode.support.check_model_supported(model)

    class NoMaskLM(torch.nn.Module):
        config = model.config

        def forward(self, input_ids, past_key_values=None):
            raise AssertionError("never called")

    with pytest.raises(ValueError, match="attention_mask"):
        hf_bpd.decode.support.check_model_supported(NoMaskLM())


def test_missing_or_wrong_assistant_and_beam_search_raise():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="BlockDrafter"):
        model.generate(torch.tensor([[5, 6]]), max_new_tokens=3, custom_generate=hf_bpd.generate)
    drafter = BlockDrafter(random_heads(model))
    with pytest.raises(ValueError, match="beam search"):
        model.generate(
            torch.tensor([[5, 6]]), max_new_tokens=3, num_beams=2, custom_generate=hf_bpd.generate, assistant=drafter
        )


def test_forward_cost_sizes_trees_and_stays_lossless():
    from hf_bpd.decode.cost import ForwardCost, best_tree_size

    cpu_like = ForwardCost((1, 2, 4, 8, 16), (0.066, 0.127, 0.131, 0.140, 0.140))
    assert cpu_like(3) == pytest.approx(0.129) and cpu_like(32) == pytest.approx(0.140)
    assert best_tree_size([1.0, 0.2, 0.1], cpu_like) == 1  # unsure heads: plain step
    assert best_tree_size([1.0, 0.9, 0.8, 0.7, 0.6], cpu_like) == 5  # sure heads: the whole tree
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(copying_heads(model, 4), top_k=3, max_tree_tokens=16, forward_cost=cpu_like)
    ref, out = run_both(model, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=40)
    assert out.tolist() == ref.tolist()
    assert 1 in drafter.stats.tree_sizes or max(drafter.stats.tree_sizes) <= 16


def test_auto_tree_size_measures_the_model():
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(copying_heads(model, 3), top_k=3, max_tree_tokens="auto")
    ref, out = run_both(model, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=12)
    assert out.tolist() == ref.tolist()
    assert drafter.forward_cost is not None and drafter.forward_cost.sizes[0] == 1
    assert all(t > 0 for t in drafter.forward_cost.seconds)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_next_token_heads_read_each_step_root_and_stay_exact(arch):
    """Heads with `use_next_token` get, each step, the base model's last accepted token (the tree root)."""
    model = tiny_model(arch, eos_token_id=None)
    heads = random_heads(model, num_heads=3, use_next_token=True, std=0.05)
    roots = []
    forward = heads.forward

    def spy(hidden_states, next_tokens=None):
        roots.append(next_tokens.tolist())
        return forward(hidden_states, next_tokens)

    heads.forward = spy
    drafter = BlockDrafter(heads, top_k=3, max_tree_tokens=8)
    ids = torch.tensor([[5, 6, 7, 8]])
    ref, out = run_both(model, drafter, ids, max_new_tokens=30)
    assert out.tolist() == ref.tolist()
    q, want = ids.shape[1], []
    for n in [0, *drafter.stats.accepted_lengths[:-1]]:
        q += n
        want.append([int(out[0, q])])
    assert roots == want


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("max_tree_tokens", [1, 5, 12, "auto"])
@pytest.mark.parametrize("chain", ["", "state", "beside"])
def test_previous_heads_grow_trees_and_stay_exact(arch, max_tree_tokens, chain):
    """Heads that read the drafted token (chained or not) expand the tree node by node; the output is still
    greedy's."""
    model = tiny_model(arch, eos_token_id=None)
    heads = random_heads(model, num_heads=3, token_input="previous", std=0.05, chain=chain)
    drafter = BlockDrafter(heads, 3, max_tree_tokens)
    g = torch.Generator().manual_seed(3)
    for trial in range(3):
        ids = torch.randint(3, 97, (1, int(torch.randint(1, 12, (1,), generator=g))), generator=g)
        ref, out = run_both(model, drafter, ids, max_new_tokens=25)
        assert out.tolist() == ref.tolist(), (arch, max_tree_tokens, trial)
        budget = drafter.tree_budget
        assert all(1 <= n <= budget for n in drafter.stats.tree_sizes)
        if max_tree_tokens != "auto":
            assert max(drafter.stats.tree_sizes) == max_tree_tokens  # expansion fills the budget


def test_previous_heads_accept_multi_token_drafts():
    model = tiny_model("llama", eos_token_id=None)
    # zero residuals: every head repeats the base model's next-token guess, often right on a random model
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=4, token_input="previous")
    drafter = BlockDrafter(heads, top_k=3, max_tree_tokens=16)
    ref, out = run_both(model, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=60)
    assert out.tolist() == ref.tolist()
    assert max(drafter.stats.accepted_lengths) > 1


def test_previous_heads_grow_little_more_than_the_cost_curve_keeps(monkeypatch):
    """With a forward-cost curve, "previous" heads grow at most twice the largest recent tree (>= 8)."""
    from hf_bpd.decode.cost import ForwardCost
    from hf_bpd.drafting import drafter as drafter_module

    grown = []
    grow = drafter_module.grow_on_device

    def spy(heads, hidden, root, top_k, budget, *args, **kwargs):
        grown.append(budget)
        return grow(heads, hidden, root, top_k, budget, *args, **kwargs)

    monkeypatch.setattr(drafter_module, "grow_on_device", spy)
    model = tiny_model("llama", eos_token_id=None)
    costly = ForwardCost((1, 2, 64), (0.01, 0.1, 0.1))  # any tree beyond the root costs 10 plain steps
    heads = random_heads(model, num_heads=3, token_input="previous", std=0.05)
    drafter = BlockDrafter(heads, top_k=4, max_tree_tokens=64, forward_cost=costly)
    ref, out = run_both(model, drafter, torch.tensor([[5, 6, 7]]), max_new_tokens=12)
    assert out.tolist() == ref.tolist()
    assert set(drafter.stats.tree_sizes) == {1}
    assert grown[0] == 64 and set(grown[1:]) == {8}  # the first step grows the whole budget, then 2 x 1 -> 8


@pytest.mark.parametrize("max_tree_tokens", [12, "auto"])
@pytest.mark.parametrize("chain", ["", "state", "beside"])
def test_previous_heads_with_a_rescorer_stay_exact(max_tree_tokens, chain):
    """A rescorer sees the chain lattice of "previous" heads; its drafts (with acceptance estimates, from
    the context n-gram) join the expansion. The output is still greedy's."""
    from hf_bpd.drafting.rescoring.ngram import NgramRescorer

    model = tiny_model("llama", eos_token_id=None)
    heads = random_heads(model, num_heads=3, token_input="previous", std=0.05, chain=chain)
    calls = []

    class Spy(NgramRescorer):
        def __call__(self, lattice, context):
            calls.append(tuple(lattice.tokens.shape))
            return super().__call__(lattice, context)

    drafter = BlockDrafter(heads, 3, max_tree_tokens, rescorer=Spy(None, context_weight=0.5, num_paths=2))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])  # repetitive: the context n-gram proposes drafts
    ref, out = run_both(model, drafter, ids, max_new_tokens=30)
    assert out.tolist() == ref.tolist()
    assert calls and set(calls) == {(1, 3, 3)}  # one chain lattice per step: 3 depths x top-3
