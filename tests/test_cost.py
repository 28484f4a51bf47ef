"""The forward-cost curve that sizes `auto` trees is measured once per machine and model, then cached."""

import json
import math
import time
from pathlib import Path

import pytest
import torch
from conftest import random_heads, tiny_model

import hf_bpd
import hf_bpd.decode.cost as cost
from hf_bpd import BlockDrafter
from hf_bpd.decode.binding import binding_of


def _no_measuring(*args, **kwargs):
    raise AssertionError("measured again although a cached curve exists")


def test_auto_drafter_measures_once_then_reads_the_cache(monkeypatch, private_forward_cost_cache):
    model = tiny_model("llama", eos_token_id=None)
    first = BlockDrafter(random_heads(model), top_k=2, max_tree_tokens="auto")
    setup = hf_bpd.prepare(first, model).setup
    assert setup["measured"] is True
    stored = json.loads(Path(setup["forward_cost_file"]).read_text())
    assert stored["sizes"][0] == 1 and stored["key"]["dtype"] == "torch.float32"
    assert str(private_forward_cost_cache) in setup["forward_cost_file"]

    monkeypatch.setattr(cost, "measure_forward_cost", _no_measuring)
    second = BlockDrafter(random_heads(model), top_k=2, max_tree_tokens="auto")
    ids = torch.tensor([[5, 6, 7]])
    out = model.generate(ids, max_new_tokens=6, custom_generate=hf_bpd.generate, assistant=second)
    assert binding_of(second).setup["measured"] is False
    assert second.forward_cost == first.forward_cost
    assert out.shape[1] == 9


def test_cache_key_separates_models_and_settings(monkeypatch):
    llama, wider = tiny_model("llama"), tiny_model("llama", hidden_size=64)
    key = cost.forward_cost_key(llama, packed_linear=False)
    assert key == cost.forward_cost_key(tiny_model("llama", seed=3), packed_linear=False)  # weights do not matter
    assert key != cost.forward_cost_key(wider, packed_linear=False)
    assert key != cost.forward_cost_key(llama.to(torch.bfloat16), packed_linear=False)
    assert cost.forward_cost_cache_file(key) != cost.forward_cost_cache_file({**key, "threads": 99})


def test_unreadable_cache_file_is_measured_again(private_forward_cost_cache):
    model = tiny_model("qwen2")
    key = cost.forward_cost_key(model, packed_linear=False, sizes=(1, 2))
    path = cost.forward_cost_cache_file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    curve, where, measured = cost.cached_forward_cost(model, packed_linear=False, sizes=(1, 2))
    assert measured and where == path and curve.sizes == (1, 2)
    assert cost.cached_forward_cost(model, packed_linear=False, sizes=(1, 2))[2] is False
    assert cost.cached_forward_cost(model, packed_linear=False, sizes=(1, 2), refresh=True)[2] is True


STALE = [{"sizes": [1], "seconds": [0.1]}, {"key": {"other": 1}, "sizes": [1], "seconds": [1]}]


@pytest.mark.parametrize("stale", STALE)
def test_cache_file_of_another_key_is_not_trusted(stale, private_forward_cost_cache):
    model = tiny_model("llama")
    key = cost.forward_cost_key(model, packed_linear=False, sizes=(1, 2))
    path = cost.forward_cost_cache_file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stale))
    assert cost.cached_forward_cost(model, packed_linear=False, sizes=(1, 2))[2] is True


def test_a_curve_reads_between_below_and_past_its_sizes_and_one_size_is_flat():
    curve = cost.ForwardCost((2, 8), (1.0, 4.0))
    assert (curve(1), curve(2), curve(5), curve(8), curve(14)) == (1.0, 1.0, 2.5, 4.0, 7.0)
    one = cost.ForwardCost((4,), (0.5,))
    assert (one(1), one(4), one(64)) == (0.5, 0.5, 0.5)


def test_batch_width_trades_every_rows_expected_tokens_against_the_batch_forward():
    curve = cost.ForwardCost((1, 8, 64), (1.0, 1.0, 8.0))  # flat up to 8 tokens, then linear
    sure, unsure = [1.0, 0.9, 0.9, 0.9], [1.0, 0.1, 0.1, 0.1]
    # 2 rows x 4 tokens still cost one flat forward: the whole trees
    assert cost.best_batch_width([sure, unsure], 2, curve) == 4
    # the same 2 rows among 8 (6 finished rows padded to the width): 8 x 4 tokens cost 4 such forwards
    assert cost.best_batch_width([sure, unsure], 8, curve) == 1
    # one row: the same choice as sizing that row's tree alone
    assert cost.best_batch_width([sure], 1, curve) == cost.best_tree_size(sure, curve)
    assert cost.best_batch_width([[1.0], [1.0]], 2, curve) == 1


def test_batch_width_above_the_roots_must_beat_them_by_the_margin():
    # 2 tokens per row cost 1.2 roots-only forwards: rows expecting 1.25 tokens gain 4 %, 1.5 tokens 25 %
    curve = cost.ForwardCost((1, 2, 64), (1.0, 1.2, 32.0))
    close, clear = [[1.0, 0.25]], [[1.0, 0.5]]
    assert cost.best_batch_width(close, 1, curve) == 2  # without a margin the expected 4 % wins
    assert cost.best_batch_width(close, 1, curve, margin=0.05) == 1  # within the margin: the roots alone
    assert cost.best_batch_width(clear, 1, curve, margin=0.05) == 2
    assert cost.best_batch_width(clear, 1, curve, margin=0.3) == 1


def test_batch_cost_uses_the_calls_own_timings_and_scales_untimed_widths_by_the_curve():
    curve = cost.ForwardCost((1, 8, 64), (1.0, 1.0, 8.0))
    batch = cost.BatchForwardCost(curve, rows=8)
    assert batch(8 * 4) == curve(32)  # nothing timed yet: the curve
    batch.observe(1, 3.0)  # long contexts: a plain step of the batch takes 3x what the curve says
    assert batch(8) == 3.0
    assert batch(8 * 4) == pytest.approx(3.0 * curve(32) / curve(8))  # scaled from the nearest timed width
    batch.observe(4, 20.0)
    assert batch(8 * 4) == 20.0 and batch(8 * 3) == pytest.approx(20.0 * curve(24) / curve(32))
    batch.observe(4, 10.0)  # a running mean over the call's forwards of that width
    assert 10.0 < batch(8 * 4) < 20.0


def test_batch_widths_ramp_up_from_the_widest_timed_one():
    # the curve says wide trees are nearly free; an untimed width may still cost far more in a batch at
    # long contexts, so a call verifies at most twice the widest width it has timed
    curve = cost.ForwardCost((1, 64), (1.0, 1.01))
    batch = cost.BatchForwardCost(curve, rows=4)
    sure = [[1.0] * 16] * 4
    assert cost.best_batch_width(sure, 4, batch) == 16  # unbounded: the curve's choice
    batch.observe(1, 1.0)  # the batch's first, plain step
    assert batch.max_width() == 2 and cost.best_batch_width(sure, 4, batch, batch.max_width()) == 2
    batch.observe(2, 1.0)
    batch.observe(4, 1.0)
    assert batch.max_width() == 8


def test_step_chooser_takes_plain_steps_while_they_are_faster_and_probes_drafting():
    plain = {"seconds": 0.010}
    chooser = cost.StepChooser(lambda: plain["seconds"], probe_every=3)
    assert chooser.draft_next()  # nothing measured yet: draft
    chooser.observe(True, tokens=1, seconds=0.020)  # 50 tok/s drafted against 100 tok/s plain
    decisions = [chooser.draft_next() for _ in range(4)]
    assert decisions == [False, False, False, True]  # plain, then a drafted probe after 3 plain steps
    chooser.observe(True, tokens=5, seconds=0.020)  # the probe pays: 0.3 weight -> 50 + 0.3 * 200 = 110 tok/s
    assert chooser.drafted_rate == pytest.approx(110.0)
    assert chooser.draft_next() and chooser.plain_taken == 3
    chooser.observe(False, tokens=1, seconds=0.004)  # a timed plain step replaces the estimate: 250 tok/s
    assert chooser.plain_step_seconds == 0.004 and not chooser.draft_next()
    assert cost.StepChooser(lambda: 0.010).draft_next()  # first step always drafts
    assert cost.StepChooser(lambda: None, drafted_rate=1.0).draft_next()  # no plain estimate: draft
    many = cost.StepChooser(lambda: 0.010, drafted_rate=150.0)
    assert many.draft_next(rows=1) and not many.draft_next(rows=2)  # a batch's plain step makes a token per row


def test_step_chooser_probes_less_often_while_drafting_keeps_losing():
    chooser = cost.StepChooser(lambda: 0.010, probe_every=2, max_probe_every=8)
    assert chooser.draft_next()
    chooser.observe(True, tokens=1, seconds=0.040)  # 25 tok/s drafted against 100 tok/s plain
    probes = []
    for step in range(40):
        if chooser.draft_next():
            probes.append(step)
            chooser.observe(True, tokens=1, seconds=0.040)  # every probe loses again
        else:
            chooser.observe(False, tokens=1, seconds=0.010)
    assert probes == [2, 7, 16, 25, 34]  # 2, 4, then 8 plain steps between probes (the cap)
    chooser.observe(True, tokens=20, seconds=0.040)  # a probe that pays: 0.7 * 25 + 0.3 * 500 = 167.5 tok/s
    assert chooser.draft_next() and chooser.probe_wait == 2  # drafting again, and quick to probe if it stops


def test_plain_steps_where_drafting_does_not_pay_keep_the_output_exact():
    from test_decoding import copying_heads

    model = tiny_model("llama", eos_token_id=None)
    # a one-token forward that looks nearly free: drafted steps can never match it, so "auto" steps go plain
    free = cost.ForwardCost((1, 64), (1e-7, 1e-6))
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=40)
    # calibrate=False: the curve is not corrected by timed forwards, so the choice does not depend on timing
    drafter = BlockDrafter(copying_heads(model, 4), top_k=3, max_tree_tokens="auto", forward_cost=free, calibrate=False)
    out = model.generate(ids, do_sample=False, max_new_tokens=40, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist()
    assert 0 < drafter.stats.plain_steps < drafter.stats.steps  # mostly plain, with drafted probes
    batch = torch.tensor([[1, 5, 6, 7], [5, 6, 7, 8]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    kwargs = {"attention_mask": mask, "do_sample": False, "max_new_tokens": 24, "pad_token_id": 1}
    ref = model.generate(batch, **kwargs)
    out = model.generate(batch, **kwargs, custom_generate=hf_bpd.generate, assistant=drafter)
    assert out.tolist() == ref.tolist()
    assert drafter.stats.plain_steps > 0


def test_step_chooser_measures_a_slow_first_plain_step_again():
    # a batch's first step is plain and pays for first-call work: 0.050 s, against 0.010 s from then on
    chooser = cost.StepChooser(lambda: None)
    chooser.observe(False, tokens=4, seconds=0.050)  # 80 tok/s: provisional
    assert chooser.draft_next(rows=4)  # nothing drafted yet: draft
    chooser.observe(True, tokens=6, seconds=0.030)  # 200 tok/s drafted beats the provisional 80 tok/s
    assert not chooser.draft_next(rows=4)  # still, one more plain step, to measure it again
    chooser.observe(False, tokens=4, seconds=0.010)  # 400 tok/s: it replaces the first time, not averaged
    assert chooser.plain_step_seconds == 0.010
    assert not chooser.draft_next(rows=4)  # and plain steps now win
    chooser.observe(False, tokens=4, seconds=0.012)
    assert chooser.plain_step_seconds == pytest.approx(0.7 * 0.010 + 0.3 * 0.012)  # a running mean from here


def test_step_chooser_with_a_margin_drafts_only_where_drafting_clearly_pays():
    # plain steps make 100 tok/s; a margin of 5 % asks drafted steps for 105
    assert not cost.StepChooser(lambda: 0.010, drafted_rate=103.0, margin=0.05).draft_next()
    assert cost.StepChooser(lambda: 0.010, drafted_rate=110.0, margin=0.05).draft_next()
    assert cost.StepChooser(lambda: 0.010, drafted_rate=103.0).draft_next()  # no margin: any gain drafts
    rows = cost.StepChooser(lambda: 0.010, drafted_rate=410.0, margin=0.05)
    assert not rows.draft_next(rows=4)  # four rows' plain steps make 400 tok/s: 410 is not 5 % more


def test_step_chooser_measures_plain_steps_again_while_drafting_wins_narrowly():
    # plain steps timed once at 0.012 s (83 tok/s); drafted steps then make 100 tok/s: a win of 20 %,
    # inside `close`, so after 2 drafted steps a plain step is measured again, then after 4, 8 ...
    chooser = cost.StepChooser(lambda: None, probe_every=2, max_probe_every=8)
    chooser.observe(False, tokens=1, seconds=0.012)
    chooser.observe(False, tokens=1, seconds=0.012)  # measured (the second replaces the provisional first)
    plain_steps = []
    for step in range(30):
        drafts = chooser.draft_next()
        if not drafts:
            plain_steps.append(step)
        chooser.observe(drafts, tokens=2 if drafts else 1, seconds=0.020 if drafts else 0.012)
    assert plain_steps[:4] == [2, 7, 16, 25]  # after 2, 4, then 8 drafted steps (the cap)
    # the refreshed plain time is what the choice reads: plain steps now take 0.008 s (125 tok/s) and win
    chooser.observe(False, tokens=1, seconds=0.008)
    chooser.observe(False, tokens=1, seconds=0.008)
    chooser.observe(False, tokens=1, seconds=0.008)
    assert not chooser.draft_next()


def test_step_chooser_does_not_probe_plain_steps_where_drafting_clearly_wins():
    chooser = cost.StepChooser(lambda: None, probe_every=2)
    chooser.observe(False, tokens=1, seconds=0.010)
    chooser.observe(False, tokens=1, seconds=0.010)  # 100 tok/s plain
    decisions = []
    for _ in range(20):
        decisions.append(chooser.draft_next())
        chooser.observe(True, tokens=3, seconds=0.015)  # 200 tok/s: twice as fast
    assert all(decisions)


def test_charged_seconds_count_against_the_next_drafted_step():
    chooser = cost.StepChooser(lambda: 0.010, rate=1.0)
    chooser.charge_drafting(0.010)  # a squeeze a plain step paid for drafted steps' holes
    chooser.observe(False, tokens=1, seconds=0.010)
    assert chooser.plain_step_seconds == 0.010  # the plain step is not charged
    chooser.observe(True, tokens=3, seconds=0.020)
    assert chooser.drafted_rate == pytest.approx(3 / 0.030)
    chooser.observe(True, tokens=3, seconds=0.020)
    assert chooser.drafted_rate == pytest.approx(3 / 0.020)  # charged once


def test_isotonic_fit_pools_decreasing_runs_into_their_mean():
    assert cost.isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert cost.isotonic([184.0, 215.0, 154.0, 184.0, 223.0, 191.0, 288.0]) == pytest.approx(
        [184.0, 553 / 3, 553 / 3, 553 / 3, 207.0, 207.0, 288.0]
    )
    assert cost.isotonic([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    assert cost.isotonic([]) == []


def test_forward_cost_times_every_size_per_round_and_fits_a_curve_never_cheaper_when_wider(monkeypatch):
    order = []
    noisy = {1: [9.0, 0.10, 0.30, 0.09], 2: [9.0, 0.12, 0.12, 0.12], 4: [9.0, 0.09, 0.08, 0.10]}

    def once(self, n, block):
        order.append(n)
        return noisy[n][sum(1 for m in order if m == n) - 1]

    monkeypatch.setattr(cost.ForwardTimer, "once", once)
    model = tiny_model("llama")
    curve = cost.measure_forward_cost(model, sizes=(1, 2, 4), context=8, repeats=3)
    assert order == [1, 2, 4] * 4  # rounds over the sizes, the first a warm-up
    # medians 0.10, 0.12, 0.09: the dip at 4 tokens is pooled with 2 tokens' time
    assert curve.seconds == pytest.approx((0.10, 0.105, 0.105))


def test_a_size_a_burst_made_dear_is_timed_again_with_its_neighbours_and_keeps_its_lower_median(monkeypatch):
    """Claim probe4_spread40_amd's fresh curve read 62.5 ms at 4 tokens against 43.8 at 2 and 65.1 at 8 (the
    same machine's other curves: 43.9 and 50.7): sized by it, a tree of 8 cost about what one of 4 did."""
    order = []
    first = {1: 0.039, 2: 0.044, 4: 0.0625, 8: 0.065}  # every round of the first pass: 4 tokens in a burst
    again = {2: 0.046, 4: 0.050, 8: 0.064}

    def once(self, n, block):
        order.append(n)
        return first[n] if len(order) <= 16 else again[n]

    monkeypatch.setattr(cost.ForwardTimer, "once", once)
    curve = cost.measure_forward_cost(tiny_model("llama"), sizes=(1, 2, 4, 8), context=8, repeats=3)
    assert order == [1, 2, 4, 8] * 4 + [2, 4, 8] * 3  # the peak and its neighbours, in rounds again
    assert curve.seconds == pytest.approx((0.039, 0.044, 0.050, 0.064))  # each size's lower median


def test_a_shape_the_machine_really_has_comes_back_from_its_second_timing_unchanged(monkeypatch):
    """The 32-token point of the AMD machine's curves stands 18-30 % above its neighbours' chord every time."""
    curve_ms = {1: 41.6, 2: 43.0, 4: 50.7, 8: 65.7, 16: 91.6, 32: 169.4, 64: 222.9}  # claim sizing_parts_spread40_amd
    order = []

    def once(self, n, block):
        order.append(n)
        return curve_ms[n] / 1000

    monkeypatch.setattr(cost.ForwardTimer, "once", once)
    curve = cost.measure_forward_cost(tiny_model("llama"), context=8, repeats=3)
    assert cost.peaks(curve.sizes, [t * 1000 for t in curve.seconds]) == [5]
    assert order[28:] == [16, 32, 64] * 3
    assert curve.seconds == pytest.approx([t / 1000 for t in curve_ms.values()])


def test_the_forward_timer_times_forwards_without_autograd_whatever_the_callers_grad_mode():
    """A forward that records an autograd graph costs about twice decoding's on the packaged model: a curve
    or a research script timing it so would price trees by a forward decoding never runs."""
    from contextlib import nullcontext

    model = tiny_model("llama")
    assert any(p.requires_grad for p in model.parameters())
    grad_modes = []
    model.model.layers[0].register_forward_hook(lambda module, args, out: grad_modes.append(torch.is_grad_enabled()))
    with torch.enable_grad():
        timer = cost.ForwardTimer(model, context=8)
        for n in (1, 4):
            assert timer.once(n, nullcontext()) > 0
    assert grad_modes == [False, False, False]  # the context's prefill, then each timed forward
    assert not any(t.requires_grad for layer in timer.cache.layers for t in (layer.keys, layer.values))


def other_processes_using(cores: float):
    """`machine_load._busy_seconds` on a machine where other processes keep `cores` cores busy."""
    return lambda: (cores * time.perf_counter(), 0.0)


def test_a_curve_measured_on_a_busy_machine_is_used_but_measured_again_by_the_next_process(monkeypatch):
    import os

    import hf_bpd.machine_load as machine_load

    model = tiny_model("qwen2")
    every_core = float(os.cpu_count())  # busy whatever this process's thread count
    monkeypatch.setattr(machine_load, "_busy_seconds", other_processes_using(every_core))
    busy_curve, path, measured = cost.cached_forward_cost(model, packed_linear=False, sizes=(1, 2))
    stored = json.loads(path.read_text())
    assert measured and stored["busy"] is True and stored["other_cores"] == pytest.approx(every_core, rel=0.01)
    assert cost.cached_forward_cost(model, packed_linear=False, sizes=(1, 2))[2] is True  # not kept as final

    monkeypatch.setattr(machine_load, "_busy_seconds", other_processes_using(0.02))  # idle: daemons only
    assert cost.cached_forward_cost(model, packed_linear=False, sizes=(1, 2))[2] is True
    assert json.loads(path.read_text())["busy"] is False
    assert cost.cached_forward_cost(model, packed_linear=False, sizes=(1, 2))[2] is False  # kept now


def test_a_cached_curve_that_decoding_contradicts_is_dropped_and_measured_again(monkeypatch, caplog):
    # a curve cached while the machine was loaded: every size 1,000 s, flat (decoding's forwards of the tiny
    # model take milliseconds); a quiet measurement then gives a curve decoding agrees with
    model = tiny_model("llama", eos_token_id=None)
    measured_curves = []

    def quiet_measurement(model_, sizes=cost.DEFAULT_SIZES, **kwargs):
        measured_curves.append(cost.ForwardCost(tuple(sizes), tuple(0.002 * (1 + n / 8) for n in sizes)))
        return measured_curves[-1]

    key = cost.forward_cost_key(model, packed_linear=None)
    path = cost.forward_cost_cache_file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    loaded = {"sizes": list(cost.DEFAULT_SIZES), "seconds": [1000.0] * len(cost.DEFAULT_SIZES)}
    path.write_text(json.dumps({"key": key, **loaded, "busy": False}))
    monkeypatch.setattr(cost, "measure_forward_cost", quiet_measurement)
    drafter = BlockDrafter(random_heads(model), top_k=2, max_tree_tokens="auto")
    ids = torch.tensor([[5, 6, 7]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=24)

    def run():
        return model.generate(
            ids, do_sample=False, max_new_tokens=24, custom_generate=hf_bpd.generate, assistant=drafter
        )

    with caplog.at_level("WARNING", logger="hf_bpd"):
        assert run().tolist() == ref.tolist()
    setup = binding_of(drafter).setup
    assert setup["measured"] is False and drafter.forward_cost.seconds[0] == 1000.0  # read from the cache
    assert not path.exists()  # contradicted by decoding: dropped
    assert any("off the forwards decoding timed" in r.getMessage() for r in caplog.records)

    assert run().tolist() == ref.tolist()  # the next call measures it again and keeps it
    assert len(measured_curves) == 1 and drafter.forward_cost == measured_curves[0]
    assert json.loads(path.read_text())["seconds"] == list(measured_curves[0].seconds)
    assert run().tolist() == ref.tolist()
    assert len(measured_curves) == 1  # once per binding: a curve measured again is corrected online only


def test_one_time_measurements_are_logged_with_their_duration(caplog):
    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(random_heads(model), top_k=2, max_tree_tokens="auto", packed_linear=False)
    with caplog.at_level("INFO", logger="hf_bpd"):
        hf_bpd.prepare(drafter, model)
    lines = [r.getMessage() for r in caplog.records if r.name == "hf_bpd"]
    assert any(line.startswith("measuring the forward-cost curve of LlamaForCausalLM") for line in lines)
    assert any("forward-cost curve" in line and "done in" in line for line in lines)


def test_step_chooser_judges_a_drafted_step_by_its_expected_tokens_where_known():
    # plain steps make 100 tok/s; a drafted step of 0.020 s added 1 token (50 tok/s), its trees expected 3
    judged_on_luck = cost.StepChooser(lambda: 0.010)
    judged_on_luck.observe(True, tokens=1, seconds=0.020)
    assert not judged_on_luck.draft_next()  # one miss and the call turns plain
    judged_on_expectation = cost.StepChooser(lambda: 0.010)
    judged_on_expectation.observe(True, tokens=1, seconds=0.020, expected=3.0)
    assert judged_on_expectation.drafted_rate == pytest.approx(150.0)
    assert judged_on_expectation.draft_next()  # 150 tok/s expected: drafting goes on
    judged_on_expectation.observe(True, tokens=5, seconds=0.020, expected=1.2)  # a lucky step, little expected
    assert judged_on_expectation.drafted_rate == pytest.approx(0.7 * 150.0 + 0.3 * 60.0)


def test_one_row_hands_the_chooser_the_expectation_its_tree_was_drafted_with_and_a_batch_its_tokens(monkeypatch):
    from test_decoding import copying_heads

    model = tiny_model("llama", eos_token_id=None)
    flat = cost.ForwardCost((1, 64), (1e-3, 1e-3))  # width is free: trees of several nodes, drafted steps
    drafter = BlockDrafter(copying_heads(model, 4), top_k=3, max_tree_tokens="auto", forward_cost=flat)
    seen, drafted_expectations = [], []
    observe, expected_tokens = cost.StepChooser.observe, BlockDrafter.expected_tokens

    def recording_observe(self, drafted, tokens, seconds, expected=None):
        seen.append((drafted, tokens, expected))
        return observe(self, drafted, tokens, seconds, expected)

    def recording_expected(self):
        value = expected_tokens(self)
        drafted_expectations.append(value)
        return value

    monkeypatch.setattr(cost.StepChooser, "observe", recording_observe)
    monkeypatch.setattr(BlockDrafter, "expected_tokens", recording_expected)
    one_row = torch.tensor([[5, 6, 7, 8, 9, 5, 6]])
    batch = torch.tensor([[1, 5, 6, 7], [5, 6, 7, 8]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    for inputs, kwargs in ((one_row, {}), (batch, {"attention_mask": mask, "pad_token_id": 1})):
        seen.clear(), drafted_expectations.clear()
        ref = model.generate(inputs, do_sample=False, max_new_tokens=24, **kwargs)
        out = model.generate(
            inputs, do_sample=False, max_new_tokens=24, custom_generate=hf_bpd.generate, assistant=drafter, **kwargs
        )
        assert out.tolist() == ref.tolist()
        drafted = [expected for was_drafted, _, expected in seen if was_drafted]
        assert drafted and all(expected is None for was_drafted, _, expected in seen if not was_drafted)
        if inputs is batch:  # a sum over rows: judged on the tokens added
            assert drafted_expectations == [] and all(expected is None for expected in drafted)
            continue
        assert drafted == drafted_expectations  # each drafted step's own, read before its outcome was observed
        assert all(1.0 <= e <= 64 for e in drafted)  # the root's 1, at most every node
        assert any(e > 1.0 for e in drafted)  # drafts that were expected to add tokens


def test_expected_tokens_are_the_sum_of_the_calibrated_path_probabilities_of_the_drafted_trees():
    from test_decoding import copying_heads

    model = tiny_model("llama", eos_token_id=None)
    drafter = BlockDrafter(copying_heads(model, 3), top_k=2, max_tree_tokens=6)
    hf_bpd.prepare(drafter, model)
    ids = torch.tensor([[5, 6, 7, 8]])
    hidden = model(ids, output_hidden_states=True).hidden_states[-1][:, -1]
    trees = drafter.draft(hidden, ids)
    ((tree, arcs),) = drafter._verified
    probs = [math.exp(lp) for lp in tree.path_logprobs(arcs, drafter.calibration)]
    assert len(trees[0]) == 6 and probs[0] == 1.0 and all(0 < p < 1 for p in probs[1:])
    assert drafter.expected_tokens() == pytest.approx(sum(probs))
    drafter.root_trees([8])
    assert drafter.expected_tokens() is None  # a plain step drafted nothing
    uncalibrated = BlockDrafter(copying_heads(model, 3), top_k=2, max_tree_tokens=6, calibrate=False)
    hf_bpd.prepare(uncalibrated, model)
    uncalibrated.draft(hidden, ids)
    assert uncalibrated.expected_tokens() is None  # no arcs kept: the chooser counts the tokens added
