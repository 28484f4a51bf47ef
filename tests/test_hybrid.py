"""Hybrid and recurrent models (`hf_bpd/decode/recurrent.py`): every served family continues a cached state over a
several-token forward as one token at a time does, and decodes token for token as plain `generate` does
(greedy, seeded sampling, left-padded batches), with chains that are accepted whole (the state kept) and
cut short (the state restored, the accepted tokens replayed); the other stateful families are refused by
name before any forward."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from all_architectures import build as build_default
from support_matrix import Row
from support_matrix import build as build_row
from transformers import DynamicCache

import hf_bpd
from hf_bpd import BlockDrafter, BlockDraftHeads, ScoredPath
from hf_bpd.compat import cache_argument
from hf_bpd.decode.call import prefill, prompt_mask
from hf_bpd.decode.support import RECURRENT_SERVED as SERVED
from hf_bpd.decode.verify import verify_chain
from hf_bpd.tools.forward_counter import ForwardCounter

# family -> (model type, overrides of the shared tiny sizes), or None: transformers' own default config
# shrunk as docs/support.md builds it (tests/all_architectures.py), which keeps both kinds of layers
LINEAR_HEADS = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
MAMBA_HEADS = dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1)
FAMILIES = {
    "Qwen3-Next": ("qwen3_next", dict(layer_types=["linear_attention", "full_attention"], head_dim=8, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32, **LINEAR_HEADS)),
    "Qwen3.5": ("qwen3_5_text", dict(layer_types=["linear_attention", "full_attention"], head_dim=8, **LINEAR_HEADS)),
    "Qwen3.5-MoE": ("qwen3_5_moe_text", None),
    "LFM2": ("lfm2", dict(layer_types=["conv", "full_attention"])),
    "LFM3": ("lfm3", None),
    "Falcon-H1": ("falcon_h1", dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
                                    mamba_n_groups=1, head_dim=8)),
    "Mamba-2": ("mamba2", dict(num_heads=8, head_dim=8, state_size=8, n_groups=1, expand=2)),
    "Nemotron-H": ("nemotron_h", dict(layers_block_type=["mamba", "attention"], mamba_num_heads=8, mamba_head_dim=8,
                                      ssm_state_size=8, n_groups=1, head_dim=8)),
    "Bamba": ("bamba", dict(attn_layer_indices=[1], **MAMBA_HEADS)),
    "Granite-4 hybrid": ("granitemoehybrid", dict(layer_types=["mamba", "attention"], num_local_experts=4,
                                                  num_experts_per_tok=2, **MAMBA_HEADS)),
    "OLMo-hybrid": ("olmo_hybrid", None),
    "ZAYA": ("zaya", None),
    "Lara-mini": ("lara_mini", None),
    "Inkling": ("inkling_text", None),
}  # fmt: skip
# refused by name: (model type, overrides, what the refusal says)
REFUSED = {
    "Mamba": ("mamba", {}, "zero recurrent state"),
    "Falcon-Mamba": ("falcon_mamba", {}, "zero recurrent state"),
    "Jamba": ("jamba", None, "zero recurrent state"),
    "MiniMax": ("minimax", None, "MiniMaxCache"),
    "RWKV": ("rwkv", None, "`state` tensors"),
    "xLSTM": ("xlstm", None, "xLSTMCache"),
    "RecurrentGemma": ("recurrent_gemma", None, "inside its modules"),
}  # fmt: skip

_models: dict[str, torch.nn.Module] = {}


def build(family: str, table=FAMILIES):
    if family not in _models:
        model_type, overrides = table[family][:2]
        model = (
            build_default(model_type)
            if overrides is None
            else build_row(Row(family, model_type, "", overrides=overrides))
        )
        _models[family] = model
    return _models[family]


class NoisyOracle(BlockDrafter):
    """Drafts each row's true continuation (`reference`, as plain `generate` produced it, left padding
    included), a random draft token replaced by a wrong one half the time: chains accepted whole and chains
    cut short both occur. Rows are matched by their text without padding."""

    def __init__(self, model, reference: torch.Tensor, pad: int = 0, seed: int = 0, **kw):
        heads = BlockDraftHeads.for_base_model(model, num_heads=4)
        # no context lookup: its chain would compete with the (noisy) true path for the verified chain
        kw.setdefault("context_lookup", 0)
        super().__init__(heads, rescorer=self._true_paths, top_k=2, max_tree_tokens=kw.pop("max_tree_tokens", 8), **kw)
        self.reference = [[t for t in row if t != pad] for row in reference.tolist()]
        self.pad, self.rng = pad, random.Random(seed)

    def _true_paths(self, lattice, context):
        paths = []
        for row in context.tolist():
            text = [t for t in row if t != self.pad]
            known = next((r for r in self.reference if r[: len(text)] == text), [])  # none: a wrong text
            truth = known[len(text) : len(text) + 6]
            if truth and self.rng.random() < 0.5:
                truth[self.rng.randrange(len(truth))] = 3 + (truth[0] + 1) % 80
            paths.append([ScoredPath(tuple(truth), 0.0)] if truth else [])
        return paths


def plain(model, ids, **kw):
    return model.generate(ids, eos_token_id=None, pad_token_id=0, **kw)


def ours(model, ids, drafter, **kw):
    return plain(model, ids, custom_generate=hf_bpd.generate, assistant=drafter, **kw)


def test_every_served_type_has_a_family_here():
    assert {model_type for model_type, _ in FAMILIES.values()} <= SERVED
    tested = {model_type for model_type, _ in FAMILIES.values()}
    # the rest of SERVED are variants of a tested family (the same modeling code) or built by the sweep
    assert SERVED - tested <= {"qwen3_5", "qwen3_5_moe", "inkling2_text", "inkling2_loop_text"}


def _continue(model, ids, cache, past_mask, new):
    logits = verify_chain(model, new, cache, past_mask).logits.float()
    return logits, torch.cat([past_mask, past_mask.new_ones(new.shape)], dim=-1)


@pytest.mark.parametrize("family", [*FAMILIES, "Mamba", "Falcon-Mamba", "Jamba"])
def test_a_warm_state_continues_over_several_tokens_as_one_at_a_time(family):
    """What the chain loop relies on, checked on transformers' torch path: after a prefill, one forward of
    five tokens gives the logits (and leaves the state) five one-token forwards give. Mamba's and Jamba's
    (and Falcon-Mamba's) scans start such a forward from a zero state instead: why they are refused."""
    model = build(family, FAMILIES if family in FAMILIES else REFUSED)
    g = torch.Generator().manual_seed(1)
    ids, new, after = (torch.randint(3, 90, (1, n), generator=g) for n in (6, 5, 1))
    with torch.no_grad():
        kwargs = {"attention_mask": torch.ones_like(ids), "use_cache": True}
        kwargs[cache_argument(model)] = DynamicCache(config=model.config)
        _, _, cache = prefill(model, ids, kwargs)
        one, many = copy.deepcopy(cache), cache
        mask_one = mask_many = prompt_mask(ids, {})
        steps = []
        for i in range(5):
            logits, mask_one = _continue(model, ids, one, mask_one, new[:, i : i + 1])
            steps.append(logits[:, -1])
        together, mask_many = _continue(model, ids, many, mask_many, new)
        gap = max(
            float((torch.stack(steps, 1) - together).abs().max()),
            float(
                (_continue(model, ids, one, mask_one, after)[0] - _continue(model, ids, many, mask_many, after)[0])
                .abs()
                .max()
            ),
        )
    if family in FAMILIES:
        assert gap < 1e-5, gap
    else:
        assert gap > 1e-4, gap


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_and_seeded_sampling_are_plain_generates(family):
    model = build(family)
    g = torch.Generator().manual_seed(2)
    replayed, full = 0, 0
    for prompt_len, new in ((1, 24), (9, 30)):
        ids = torch.randint(3, 90, (1, prompt_len), generator=g)
        ref = plain(model, ids, do_sample=False, max_new_tokens=new)
        drafter = NoisyOracle(model, ref)
        assert ours(model, ids, drafter, do_sample=False, max_new_tokens=new).tolist() == ref.tolist()
        replayed += drafter.stats.replayed
        full += sum(n > 1 for n in drafter.stats.accepted_lengths)
        torch.manual_seed(prompt_len)
        ref = plain(model, ids, do_sample=True, temperature=1.3, top_k=20, max_new_tokens=new)
        drafter = NoisyOracle(model, ref, seed=1)
        torch.manual_seed(prompt_len)
        out = ours(model, ids, drafter, do_sample=True, temperature=1.3, top_k=20, max_new_tokens=new)
        assert out.tolist() == ref.tolist(), "sampled"
    assert replayed > 0 and full > 0  # states were both kept and restored


@pytest.mark.parametrize("family", ["Qwen3-Next", "LFM2", "Falcon-H1", "Mamba-2", "Nemotron-H", "Lara-mini"])
def test_left_padded_batches_are_plain_batched_greedy(family):
    model = build(family)
    g = torch.Generator().manual_seed(3)
    lengths = (3, 8, 5)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, -n:] = torch.randint(3, 90, (n,), generator=g)
        mask[b, -n:] = 1
    ref = plain(model, ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    drafter = NoisyOracle(model, ref)
    out = ours(model, ids, drafter, attention_mask=mask, do_sample=False, max_new_tokens=20)
    assert out.tolist() == ref.tolist()
    assert drafter.stats.replayed > 0


def test_copying_heads_with_auto_trees_and_lookup_are_exact():
    """The shipped settings' path: tree sizes by a forward-cost curve, context lookup, plain steps."""
    from hf_bpd.decode.cost import ForwardCost

    model = build("Qwen3-Next")
    curve = ForwardCost((1, 2, 4, 8, 16, 32), (0.047, 0.068, 0.071, 0.075, 0.088, 0.117))
    drafter = BlockDrafter(
        BlockDraftHeads.for_base_model(model, num_heads=3), max_tree_tokens="auto", forward_cost=curve
    )
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    ref = plain(model, ids, do_sample=False, max_new_tokens=40)
    assert ours(model, ids, drafter, do_sample=False, max_new_tokens=40).tolist() == ref.tolist()


@pytest.mark.parametrize("family", ["Qwen3-Next", "Mamba-2"])
def test_auto_trees_measure_a_stateful_model_s_forward_cost_and_leave_its_state_alone(family, monkeypatch, tmp_path):
    """ "auto" with no curve given times the model's chain forwards at first use (as the shipped drafter
    does): a recurrent state cannot be cropped, so each timed forward is undone from a snapshot."""
    from hf_bpd.decode.cost import ForwardTimer
    from hf_bpd.kv import state_tensors

    monkeypatch.setenv("HF_BPD_CACHE", str(tmp_path))
    model = build(family)
    timer = ForwardTimer(model, context=12)

    def cache_contents():
        states = [states[i].clone() for states, i in state_tensors(timer.cache)]
        keys = [layer.keys.shape[-2] for layer in timer.cache.layers if getattr(layer, "keys", None) is not None]
        return states, keys

    states, keys = cache_contents()
    assert states and timer.median(4, torch.no_grad(), repeats=2) > 0
    after, after_keys = cache_contents()
    assert after_keys == keys and all(torch.equal(a, b) for a, b in zip(after, states))
    drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=3), max_tree_tokens="auto")
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    ref = plain(model, ids, do_sample=False, max_new_tokens=24)
    assert ours(model, ids, drafter, do_sample=False, max_new_tokens=24).tolist() == ref.tolist()
    assert drafter.forward_cost is not None  # measured on this model, not given


@pytest.mark.parametrize("family", REFUSED)
def test_other_stateful_families_are_refused_by_name_before_any_forward(family):
    model = build(family, REFUSED)
    drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=2), top_k=2, max_tree_tokens=4)
    with ForwardCounter(model) as counter, pytest.raises(ValueError, match=REFUSED[family][2]):
        ours(model, torch.tensor([[5, 6, 7]]), drafter, max_new_tokens=5)
    assert counter.count == 0


def test_an_unchecked_stateful_family_is_refused_by_name(monkeypatch):
    monkeypatch.setattr("hf_bpd.decode.support.RECURRENT_SERVED", SERVED - {"mamba2"})
    model = build("Mamba-2")
    drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=2), top_k=2, max_tree_tokens=4)
    with ForwardCounter(model) as counter, pytest.raises(ValueError, match="'mamba2' is not one of them"):
        ours(model, torch.tensor([[5, 6, 7]]), drafter, max_new_tokens=5)
    assert counter.count == 0


def test_the_chain_loop_hands_the_chooser_the_expectation_of_the_chain_it_verifies(monkeypatch):
    from hf_bpd.decode import cost
    from hf_bpd.decode.cost import ForwardCost

    model = build("Qwen3-Next")
    curve = ForwardCost((1, 2, 4, 8, 16, 32), (0.047, 0.068, 0.071, 0.075, 0.088, 0.117))
    drafter = BlockDrafter(
        BlockDraftHeads.for_base_model(model, num_heads=3), max_tree_tokens="auto", forward_cost=curve
    )
    seen, chains = [], []
    observe, expected_tokens = cost.StepChooser.observe, BlockDrafter.expected_tokens

    def recording_observe(self, drafted, tokens, seconds, expected=None):
        seen.append((drafted, expected))
        return observe(self, drafted, tokens, seconds, expected)

    def recording_expected(self):
        chains.append(len(self._verified[0][0]) if self._verified and self._verified[0] is not None else None)
        return expected_tokens(self)

    monkeypatch.setattr(cost.StepChooser, "observe", recording_observe)
    monkeypatch.setattr(BlockDrafter, "expected_tokens", recording_expected)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    ref = plain(model, ids, do_sample=False, max_new_tokens=40)
    assert ours(model, ids, drafter, do_sample=False, max_new_tokens=40).tolist() == ref.tolist()
    drafted = [(expected, length) for (was_drafted, expected), length in zip([s for s in seen if s[0]], chains)]
    assert drafted and len(chains) == len(drafted)  # asked once per drafted step
    assert all(expected is not None and 1.0 <= expected <= length for expected, length in drafted)
    assert all(expected is None for was_drafted, expected in seen if not was_drafted)
