"""Device-to-host synchronisations per decoding step (`hf_bpd.decode.syncs`, `stats.host_syncs`), and the greedy
accept phase that makes one: the same tokens as the per-node walk, with eos and max length inside drafts."""

import pytest
import torch
from conftest import tiny_model
from test_decoding import copying_heads
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

import hf_bpd
from hf_bpd.decode.accept import HostStop
from hf_bpd.decode.syncs import HostSyncCounter


def test_the_counter_counts_each_kind_of_host_copy_by_phase():
    counter = HostSyncCounter()
    t = torch.tensor([1, 2, 3])
    with counter.phase("a"):
        t.tolist(), int(t[0]), bool(t[1]), t.sum().item(), float(t[2]), t.cpu(), t.numpy()
        with counter.phase("b"):
            t.tolist()
    t.tolist()  # outside: not counted
    assert counter.counts == {"a": 7, "b": 1}


def _drafter(model, kind: str) -> hf_bpd.BlockDrafter:
    if kind == "lattice":
        heads = copying_heads(model, 4)
    else:
        heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3, token_input="previous")
    drafter = hf_bpd.BlockDrafter(heads, top_k=3, max_tree_tokens=8)
    drafter.count_host_syncs = True
    return drafter


def test_greedy_steps_accept_with_one_sync_and_the_counts_are_in_stats():
    model = tiny_model("llama", eos_token_id=None)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=40)
    for kind in ("lattice", "previous"):
        drafter = _drafter(model, kind)
        out = model.generate(
            ids, do_sample=False, max_new_tokens=40, custom_generate=hf_bpd.generate, assistant=drafter
        )
        assert out.tolist() == ref.tolist()
        per_step = drafter.stats.host_syncs_per_step()
        assert per_step["accept"] == 1.0, per_step  # one argmax over all nodes, one copy
        assert per_step.get("verify", 0) == 0 and per_step.get("cache", 0) == 0, per_step
        if kind == "previous":  # the next tree is grown on the device and read in the accept's copy
            assert drafter.stats.host_syncs["draft"] == 1, drafter.stats.host_syncs  # the first tree only
        else:  # lattice heads: the lattice is read in a copy of its own
            assert per_step["draft"] == 1.0, per_step


@pytest.mark.parametrize("max_tree_tokens", [8, 24, "auto"])
def test_greedy_decoding_with_previous_heads_synchronises_once_per_step(max_tree_tokens):
    """The shipped kind of heads ("previous", grown on the device): every drafted step after the first
    makes exactly one device-to-host copy (its accepted tokens and the next tree together), drafting and
    cache included; plain steps (the roots alone) make one too."""
    from hf_bpd.decode.cost import ForwardCost

    model = tiny_model("llama", eos_token_id=None)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=60)
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3, token_input="previous")
    flat = ForwardCost((1, 64), (0.01, 0.01)) if max_tree_tokens == "auto" else None
    drafter = hf_bpd.BlockDrafter(heads, top_k=3, max_tree_tokens=max_tree_tokens, forward_cost=flat)
    drafter.count_host_syncs = True
    out = model.generate(ids, do_sample=False, max_new_tokens=60, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist()
    syncs, steps = drafter.stats.host_syncs, drafter.stats.steps
    per_step = sum(v for k, v in syncs.items() if k != "prefill") - 1  # less the first tree's own copy
    assert steps > 10 and per_step <= steps, syncs


class HostSearchDrafter(hf_bpd.BlockDrafter):
    grows_on_device = False  # the host search (`expansion.expand_tree`) and its copies per round


def test_trees_grown_on_the_device_are_the_host_search_s_trees():
    """Fused drafting changes when the tree is read, not which tree: with calibration off (no lag to
    differ by) the steps verify trees of the same sizes and accept the same lengths as the host search."""
    model = tiny_model("llama", eos_token_id=None)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8]])
    runs = []
    for on_device in (True, False):
        heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3, token_input="previous")
        kind = hf_bpd.BlockDrafter if on_device else HostSearchDrafter
        drafter = kind(heads, top_k=3, max_tree_tokens=10, calibrate=False)
        out = model.generate(
            ids, do_sample=False, max_new_tokens=50, custom_generate=hf_bpd.generate, assistant=drafter
        )
        runs.append((out.tolist(), drafter.stats.tree_sizes, drafter.stats.accepted_lengths))
    assert runs[0] == runs[1]


def test_sampling_counts_its_syncs_too():
    model = tiny_model("llama", eos_token_id=None)
    drafter = _drafter(model, "lattice")
    torch.manual_seed(0)
    ref = model.generate(torch.tensor([[5, 6, 7]]), do_sample=True, max_new_tokens=20)
    torch.manual_seed(0)
    out = model.generate(
        torch.tensor([[5, 6, 7]]), do_sample=True, max_new_tokens=20, custom_generate=hf_bpd.generate, assistant=drafter
    )
    assert out.tolist() == ref.tolist()
    assert drafter.stats.host_syncs_per_step()["accept"] >= 1  # one draw per reached node, each read back


def test_host_stop_decides_as_the_criteria_do():
    eos = EosTokenCriteria(eos_token_id=[3, 7])
    stop = HostStop.of(StoppingCriteriaList([MaxLengthCriteria(max_length=10), eos]))
    assert stop == HostStop(10, frozenset({3, 7}))
    for length in (5, 9, 10, 11):
        for token in (1, 3, 7):
            ids = torch.tensor([[0] * (length - 1) + [token]])
            expected = bool(MaxLengthCriteria(max_length=10)(ids, None).any() or eos(ids, None).any())
            assert stop(length, token) == expected

    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    assert HostStop.of(StoppingCriteriaList([eos, Never()])) is None  # another criterion: the tensor path


def test_eos_and_max_length_inside_an_accepted_draft_stop_there_on_the_one_sync_path():
    model = tiny_model("llama", eos_token_id=None)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6]])
    plain = model.generate(ids, do_sample=False, max_new_tokens=30)[0, ids.shape[1] :].tolist()
    eos = plain[11]  # a token the model produces mid-answer
    for kwargs in ({"eos_token_id": eos, "max_new_tokens": 30}, {"max_new_tokens": 13}):
        ref = model.generate(ids, do_sample=False, **kwargs)
        drafter = _drafter(model, "lattice")
        out = model.generate(ids, do_sample=False, custom_generate=hf_bpd.generate, assistant=drafter, **kwargs)
        assert out.tolist() == ref.tolist()
        assert drafter.stats.host_syncs_per_step()["accept"] == 1.0
