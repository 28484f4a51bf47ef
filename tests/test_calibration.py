"""Online calibration of acceptance estimates and of forward costs (hf_bpd/drafting/calibration.py, cost.py)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_model

import hf_bpd
from hf_bpd import BlockDrafter
from hf_bpd.decode.binding import ModelBinding
from hf_bpd.decode.cost import ForwardCost, LearnedForwardCost, best_tree_size
from hf_bpd.drafting.calibration import GREEDY, HEADS, RESCORER, SAMPLED, AcceptanceCalibration, Arc, SamplingWarp
from hf_bpd.drafting.tree import DraftTree


def test_calibration_starts_at_one_and_converges_to_the_measured_rate():
    cal = AcceptanceCalibration(prior=2.0)
    assert cal.scale(HEADS, 1) == 1.0 and cal.summary() == {}
    arc = Arc(math.log(0.5), HEADS)
    for i in range(400):  # estimated 0.5, accepted one time in four
        cal.observe(arc, 1, accepted=i % 4 == 0)
    assert cal.scale(HEADS, 1) == pytest.approx(0.5, abs=0.02)
    assert cal.scale(HEADS, 2) == 1.0 and cal.scale(RESCORER, 1) == 1.0  # keys are separate
    assert cal.calibrated(arc, 1) == pytest.approx(math.log(0.25), abs=0.05)
    # never above probability 1, even for an underconfident source
    for _ in range(50):
        cal.observe(Arc(math.log(0.1), RESCORER), 1, accepted=True)
    assert cal.calibrated(Arc(math.log(0.9), RESCORER), 1) == 0.0
    # deep arcs share the last key
    cal.observe(arc, 9, accepted=False)
    assert cal.scale(HEADS, 9) == cal.scale(HEADS, cal.max_depth) < 1.0
    before = dict(cal.predicted), dict(cal.accepted)
    cal.observe(Arc(-math.inf, HEADS), 1, accepted=True)  # no estimate: would inflate the multiplier
    assert (dict(cal.predicted), dict(cal.accepted)) == before


def test_node_arcs_pick_the_better_calibrated_source():
    tree = DraftTree.from_paths(7, [(1, 2), (3,)], max_nodes=8)  # nodes: 0 root, 1 (tok 1), 2 (tok 2), 3 (tok 3)
    tables = [{1: math.log(0.6), 3: math.log(0.3)}, {2: math.log(0.5)}]
    estimates = {(1,): math.log(0.4), (1, 2): math.log(0.9)}
    arcs = tree.node_arcs(tables, estimates)
    assert [a.source for a in arcs] == [HEADS, HEADS, RESCORER, HEADS]
    assert tree.node_logprobs(tables, estimates)[2] == pytest.approx(math.log(0.6 * 0.9))
    cal = AcceptanceCalibration()
    for _ in range(100):  # the heads turn out right one time in ten at depth 1
        cal.observe(Arc(math.log(0.5), HEADS), 1, accepted=False)
    arcs = tree.node_arcs(tables, estimates, cal)
    assert arcs[1].source == RESCORER  # 0.4 (trusted) now beats 0.6 x ~0.04
    assert tree.node_logprobs(tables, estimates, cal)[1] == pytest.approx(math.log(0.4))


def test_learned_forward_cost_follows_timed_forwards_per_bucket():
    curve = ForwardCost((1, 2, 4, 8, 16), (0.06, 0.12, 0.12, 0.12, 0.13))
    cost = LearnedForwardCost(curve, rate=0.5)
    assert cost(1) == 0.06 and cost(11) == curve(11) and cost.max_size == 16
    cost.observe(11, 2 * curve(11))  # bucket 16 runs twice as slow as measured at start-up
    assert cost(16) == pytest.approx(0.26) and cost(9) == pytest.approx(2 * curve(9))
    assert cost(1) == pytest.approx(0.12)  # an untimed bucket follows the machine's drift
    cost.observe(12, curve(12))  # the running mean moves half way back
    assert cost(16) == pytest.approx(1.5 * 0.13)
    cost.observe(1, 0.06)
    assert cost(1) == 0.06 and cost(2) == pytest.approx(curve(2) * cost.overall)
    # a tree that paid off at the start-up curve no longer does once trees are found to cost more
    probs = [1.0, 0.8, 0.3]
    assert best_tree_size(probs, curve) == 3
    for _ in range(20):
        cost.observe(3, 3 * curve(3))
        cost.observe(1, curve(1))
    assert best_tree_size(probs, cost) == 1
    with pytest.raises(ValueError, match="rate"):
        LearnedForwardCost(curve, rate=0)


def test_drafter_learns_from_rejections_and_stays_lossless(monkeypatch):
    """Confident heads that are always wrong: the calibrated drafter stops paying for trees, the
    uncalibrated one keeps verifying them; both decode exactly like generate."""
    # the tiny model's real forwards cost the same at every size: keep the CPU-like curve as it is
    monkeypatch.setattr(LearnedForwardCost, "observe", lambda self, n, seconds: None)
    model = tiny_model("llama", eos_token_id=None)
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3)
    with torch.no_grad():  # residuals that push every head to one fixed, confident, wrong token
        for head in heads.heads:
            for block in head:
                block.linear.weight.zero_()
                block.linear.bias.fill_(0.0)
                block.linear.bias[0] = 50.0
    cpu_like = ForwardCost((1, 2, 4, 8, 16), (0.066, 0.127, 0.131, 0.140, 0.140))
    ids = torch.tensor([[5, 6, 7]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=40)
    sizes = {}
    for calibrate in (False, True):
        drafter = BlockDrafter(heads, top_k=2, max_tree_tokens=16, forward_cost=cpu_like, calibrate=calibrate)
        out = model.generate(
            ids, do_sample=False, max_new_tokens=40, custom_generate=hf_bpd.generate, assistant=drafter
        )
        assert out.tolist() == ref.tolist()
        sizes[calibrate] = drafter.stats.tree_sizes
    assert drafter.calibration is not None and drafter.calibration.scale(HEADS, 1) < 0.5
    assert sum(s > 1 for s in sizes[True][-10:]) < sum(s > 1 for s in sizes[False][-10:])
    assert drafter.with_rescorer(None).calibration is not None  # a fresh one: rescorers change the sources
    assert BlockDrafter(heads, calibrate=False).calibration is None


def test_tree_sizes_recover_after_a_burst_of_load():
    """Trees timed while something else loaded the machine look expensive; once only single tokens are
    verified, that stale bucket drifts back to the machine's overall rate, so trees come back."""
    curve = ForwardCost((1, 8), (0.06, 0.07))
    cost = LearnedForwardCost(curve, rate=0.5)
    probs = [1.0, 0.6, 0.5, 0.4]
    assert best_tree_size(probs, cost) == 4
    for _ in range(5):  # a burst: trees cost four times the curve, single tokens as measured
        cost.observe(4, 4 * curve(4))
        cost.observe(1, curve(1))
    assert best_tree_size(probs, cost) == 1
    for _ in range(300):  # quiet again, and only single tokens are verified
        cost.observe(1, curve(1))
    assert cost(8) == pytest.approx(curve(8), rel=0.05)
    assert best_tree_size(probs, cost) == 4
    with pytest.raises(ValueError, match="stale_rate"):
        LearnedForwardCost(curve, stale_rate=1.0)


def test_sampling_warp_matches_generates_warpers_on_a_whole_vocabulary():
    """With every token in the table, the warp is exactly the distribution plain sampling draws from
    (transformers' temperature then top-p warpers), tokens outside the nucleus at -inf."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(5, 8) * 2
    for temperature, top_p in ((0.7, 0.9), (1.0, 0.8), (1.3, 1.0), (0.5, 1.0)):
        scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(None, scores)
        expected, order = scores.log_softmax(-1).sort(-1, descending=True)
        table = logits.log_softmax(-1).gather(-1, order)  # every token, sorted like a top-k table
        warped = SamplingWarp(temperature, top_p)(table)
        assert torch.equal(warped.isinf(), expected.isinf())
        finite = expected.isfinite()
        assert torch.allclose(warped[finite], expected[finite], atol=1e-5)


def test_sampling_warp_on_a_top_k_table_stays_a_cautious_estimate():
    """From the top-k only, below temperature 1 the rest of the vocabulary is over-counted, so no token
    is promised more than its real warped probability and the estimates sum to at most 1."""
    torch.manual_seed(1)
    logits = torch.randn(20, 50) * 3
    full = SamplingWarp(0.7)(logits.log_softmax(-1).sort(-1, descending=True).values)
    top4 = SamplingWarp(0.7)(logits.log_softmax(-1).topk(4, dim=-1).values)
    assert (top4 <= full[:, :4] + 1e-6).all()
    assert (top4.exp().sum(-1) <= 1 + 1e-6).all()
    assert (top4.exp().sum(-1) > 0.5 * full[:, :4].exp().sum(-1)).all()  # and not uselessly so
    # a near tie shares its acceptance, a clear favourite gets more than its greedy-style estimate
    tie, favourite = torch.tensor([[0.45, 0.44, 0.11]]).log(), torch.tensor([[0.8, 0.15, 0.05]]).log()
    assert SamplingWarp(0.7)(tie).exp()[0, 1] > 0.4
    assert SamplingWarp(0.7)(favourite).exp()[0, 0] > 0.9


def test_sampling_warp_comes_from_the_call_and_greedy_calls_have_none():
    from transformers import GenerationConfig

    assert SamplingWarp.from_config(GenerationConfig(do_sample=False, temperature=0.7)) is None
    assert SamplingWarp.from_config(GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9)) == SamplingWarp(
        0.7, 0.9
    )
    assert SamplingWarp.from_config(GenerationConfig(do_sample=True)) == SamplingWarp(1.0, 1.0)


def test_sampled_and_greedy_calls_calibrate_apart():
    cal = AcceptanceCalibration()
    arc = Arc(math.log(0.5), HEADS)
    cal.regime = SAMPLED
    for _ in range(100):
        cal.observe(arc, 1, accepted=False)
    assert cal.scale(HEADS, 1) < 0.1
    cal.regime = GREEDY
    assert cal.scale(HEADS, 1) == 1.0  # greedy estimates untouched by sampled evidence
    cal.observe(arc, 1, accepted=True)
    assert set(cal.summary()) == {"heads@1", "heads@1 sampled"}


def test_a_drafter_serving_greedy_and_sampled_calls_keeps_both_exact(monkeypatch):
    """One drafter, greedy then sampled then greedy calls: each equals plain generate (seeded for
    sampling), and the calibration keeps one set of multipliers per regime."""
    # every step drafts: on a tiny model timed plain steps beat drafted ones (`cost.StepChooser`), and
    # how many drafted steps a call keeps would then depend on the machine's timing
    monkeypatch.setattr(ModelBinding, "step_chooser", lambda self, drafter, *args: None)
    model = tiny_model("llama", eos_token_id=None)
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3)
    # a flat curve: trees pay whatever the tiny model's timed forwards teach the learned cost, so both
    # regimes verify drafted nodes (a CPU-like curve, corrected by timings, could cut every tree to its root)
    flat = ForwardCost((1, 2, 4, 8, 16), (0.066, 0.066, 0.066, 0.066, 0.066))
    drafter = BlockDrafter(heads, top_k=3, max_tree_tokens="auto", forward_cost=flat)
    ids = torch.tensor([[5, 6, 7, 5, 6]])
    for do_sample in (False, True, False):
        options = {"do_sample": do_sample, "max_new_tokens": 30}
        if do_sample:
            options.update(temperature=0.7, top_p=0.9)
        torch.manual_seed(3)
        ref = model.generate(ids, **options)
        torch.manual_seed(3)
        out = model.generate(ids, **options, custom_generate=hf_bpd.generate, assistant=drafter)
        assert out.tolist() == ref.tolist()
    regimes = {regime for regime, _, _ in drafter.calibration.predicted}
    assert regimes == {GREEDY, SAMPLED}
