"""Batches (hf_bpd/decode/batch.py): every row equals the same row of plain batched greedy `generate` on the same
left-padded batch, however differently the rows accept, finish or start."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import hf_bpd
from hf_bpd import BlockDrafter, BlockDraftHeads

PAD = 0


def left_padded(prompts: list[list[int]]) -> dict:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return {"input_ids": ids, "attention_mask": mask}


def prompts_for(batch_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 9, 3, 17, 5, 2, 12, 7][:batch_size]
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in lengths]


def drafter_for(model, **kw) -> BlockDrafter:
    # zero-residual heads draft the model's own next token: rows accept different lengths
    return BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8, **kw)


def both(model, batch, drafter, **kw):
    kw = dict(do_sample=False, pad_token_id=PAD, **kw)
    ref = model.generate(**batch, **kw)
    out = model.generate(**batch, **kw, custom_generate=hf_bpd.generate, assistant=drafter)
    return ref, out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("batch_size", [2, 3, 8])
def test_every_row_equals_plain_batched_greedy(arch, batch_size):
    model = tiny_model(arch, eos_token_id=None)
    drafter = drafter_for(model)
    for seed, new in ((0, 1), (1, 17), (2, 40)):
        batch = left_padded(prompts_for(batch_size, seed))
        ref, out = both(model, batch, drafter, max_new_tokens=new)
        assert out.tolist() == ref.tolist(), (arch, batch_size, new)
    rows = drafter.stats.rows
    assert len(rows) == batch_size and all(r.new_tokens == 40 for r in rows)
    if batch_size > 2:
        assert max(max(r.accepted_lengths) for r in rows) > 1  # drafts were accepted in some row


def test_rows_hitting_eos_at_different_steps_inside_drafts_are_padded_like_generate():
    model = tiny_model("llama", eos_token_id=None)
    drafter = drafter_for(model)
    batch = left_padded(prompts_for(6, 3))
    _, free = both(model, batch, drafter, max_new_tokens=40)
    width = batch["input_ids"].shape[1]
    # an eos that one row produces mid-way, inside an accepted block in some steps
    eos = free[2, width + 7].item()
    ref, out = both(model, batch, drafter, max_new_tokens=40, eos_token_id=eos)
    assert out.tolist() == ref.tolist()
    lengths = [r.new_tokens for r in drafter.stats.rows]
    assert len(set(lengths)) > 1  # the rows finished at different steps


def test_a_row_finishing_at_its_first_token():
    model = tiny_model("qwen2", eos_token_id=None)
    batch = left_padded(prompts_for(3, 4))
    drafter = drafter_for(model)
    _, free = both(model, batch, drafter, max_new_tokens=20)
    eos = free[1, batch["input_ids"].shape[1]].item()  # row 1's very first token
    ref, out = both(model, batch, drafter, max_new_tokens=20, eos_token_id=eos)
    assert out.tolist() == ref.tolist()
    assert drafter.stats.rows[1].new_tokens == 1


@pytest.mark.parametrize("curve_shape", ["flat", "linear"])
def test_auto_trees_take_one_width_sized_by_the_batch_forward_and_stay_exact(curve_shape, monkeypatch):
    from hf_bpd.decode.cost import BatchForwardCost, ForwardCost

    # every forward "takes" what the curve says (no timing in tests): the sizing then follows the curve
    def observe_the_curve(self, width, seconds):
        self.seconds[width] = self.curve(self.rows * width)

    monkeypatch.setattr(BatchForwardCost, "observe", observe_the_curve)
    model = tiny_model("llama", eos_token_id=None)
    sizes = (1, 2, 4, 8, 16)
    # flat: a GPU-like forward, 16 tokens cost barely more than one; linear: each token costs the same
    seconds = (0.05, 0.05, 0.05, 0.05, 0.051) if curve_shape == "flat" else tuple(0.05 * n for n in sizes)
    drafter = drafter_for(model, forward_cost=ForwardCost(sizes, seconds))
    drafter.max_tree_tokens = "auto"
    batch = left_padded(prompts_for(4, 5))
    ref, out = both(model, batch, drafter, max_new_tokens=30)
    assert out.tolist() == ref.tolist()
    rows = drafter.stats.rows
    assert all(r.tree_sizes[0] == 1 for r in rows)  # the first step is a plain one, timed
    largest = max(max(r.tree_sizes) for r in rows)
    if curve_shape == "linear":
        # B x w tokens cost w times a one-token-per-row step and no drafted node is sure: plain steps
        assert largest == 1
    else:  # drafts are worth verifying, within the curve's largest tree (16) shared by the unfinished rows
        assert largest > 1
        widest = 1  # widths ramp up: at most twice the widest verified before (`BatchForwardCost.max_width`)
        for step in range(max(len(r.tree_sizes) for r in rows)):
            sizes = [r.tree_sizes[step] for r in rows if len(r.tree_sizes) > step]
            assert max(sizes) <= 16 // len(sizes) and max(sizes) <= 2 * widest
            widest = max(widest, max(sizes))


def test_plain_steps_leave_the_cache_alone_and_drafted_steps_compact_it(monkeypatch):
    import hf_bpd.decode.batch
    from hf_bpd.decode.cost import BatchForwardCost, ForwardCost

    calls = []
    compact = hf_bpd.decode.batch.compact_rows
    monkeypatch.setattr(hf_bpd.decode.batch, "compact_rows", lambda *a, **k: calls.append(a[1]) or compact(*a, **k))
    # each token costs the same and no drafted node is sure: every tree is the root alone
    monkeypatch.setattr(BatchForwardCost, "observe", lambda self, w, s: self.seconds.update({w: 0.05 * self.rows * w}))
    model = tiny_model("llama", eos_token_id=None)
    sizes = (1, 2, 4, 8, 16)
    drafter = drafter_for(model, forward_cost=ForwardCost(sizes, tuple(0.05 * n for n in sizes)))
    drafter.max_tree_tokens = "auto"
    batch = left_padded(prompts_for(4, 6))
    ref, out = both(model, batch, drafter, max_new_tokens=20)
    assert out.tolist() == ref.tolist()
    assert all(size == 1 for row in drafter.stats.rows for size in row.tree_sizes) and calls == []
    ref, out = both(model, batch, drafter_for(model), max_new_tokens=20)  # fixed trees: drafted steps
    assert out.tolist() == ref.tolist()
    assert calls and all(n == 8 for n in calls)


def test_plain_steps_feed_the_roots_alone_and_every_row_stays_exact(monkeypatch):
    """A plain step (the step chooser's, with "auto" trees) verifies each row's root as three tensors
    (`tree.root_batch`), no tree per row: greedy reads every row's token in one copy per step, rows
    finishing at eos get pad tokens as in plain generate, and processors still see each row's own sequence."""
    import hf_bpd.decode.batch
    from hf_bpd.decode.cost import BatchForwardCost, ForwardCost

    built = []
    batch_trees = hf_bpd.decode.batch.batch_trees
    monkeypatch.setattr(hf_bpd.decode.batch, "batch_trees", lambda *a, **k: built.append(1) or batch_trees(*a, **k))
    # every token costs the same and no drafted node is sure: drafting never pays, every step is plain
    monkeypatch.setattr(BatchForwardCost, "observe", lambda self, w, s: self.seconds.update({w: 0.05 * self.rows * w}))
    model = tiny_model("llama", eos_token_id=None)
    sizes = (1, 2, 4, 8, 16)
    drafter = drafter_for(model, forward_cost=ForwardCost(sizes, tuple(0.05 * n for n in sizes)))
    drafter.max_tree_tokens = "auto"
    drafter.count_host_syncs = True
    batch = left_padded(prompts_for(6, 3))
    _, free = both(model, batch, drafter, max_new_tokens=30)
    eos = free[2, batch["input_ids"].shape[1] + 7].item()  # a token one row makes mid-way
    for options in ({}, dict(eos_token_id=eos), dict(repetition_penalty=1.3)):
        built.clear()
        ref, out = both(model, batch, drafter, max_new_tokens=30, **options)
        assert out.tolist() == ref.tolist(), options
        stats = drafter.stats
        assert stats.plain_steps > 0 and len(built) == stats.steps - stats.plain_steps, options
        if not options or "eos_token_id" in options:  # greedy without processors: one read per step
            assert stats.host_syncs_per_step()["accept"] == 1.0, (options, stats.host_syncs)
    assert len({r.new_tokens for r in drafter.stats.rows}) == 1  # (the last call: no eos)


def test_right_padding_and_holes_are_refused_before_any_forward():
    model = tiny_model("llama")
    drafter = drafter_for(model)
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    ids = torch.tensor([[5, 6, 7], [8, 9, PAD]])
    with pytest.raises(ValueError, match="left-padded"):
        model.generate(
            input_ids=ids,
            attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
            max_new_tokens=3,
            pad_token_id=PAD,
            custom_generate=hf_bpd.generate,
            assistant=drafter,
        )
    with pytest.raises(ValueError, match="hole"):
        model.generate(
            input_ids=ids,
            attention_mask=torch.tensor([[1, 1, 1], [1, 0, 1]]),
            max_new_tokens=3,
            pad_token_id=PAD,
            custom_generate=hf_bpd.generate,
            assistant=drafter,
        )
    assert not calls


def test_batch_state_processors_and_one_row_rescorers_are_refused_before_any_forward():
    # the loop runs processors one row at a time: classifier-free guidance and SynthID keep batch-shaped
    # state, and a neural rescorer keeps one KV cache; refused up front, not at the first step
    from transformers import SynthIDTextWatermarkingConfig, UnbatchedClassifierFreeGuidanceLogitsProcessor

    from hf_bpd.drafting.rescoring.neural import NeuralRescorer, truncated_lm

    model = tiny_model("llama")
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    batch = left_padded(prompts_for(2, 0))
    kw = dict(max_new_tokens=3, pad_token_id=PAD, custom_generate=hf_bpd.generate)
    drafter = drafter_for(model)
    with pytest.raises(ValueError, match="guidance_scale keeps state for the whole batch"):
        model.generate(**batch, **kw, assistant=drafter, guidance_scale=1.5)
    watermark = SynthIDTextWatermarkingConfig(keys=[11, 12, 13], ngram_len=2)
    with pytest.raises(ValueError, match="watermarking_config"):
        model.generate(**batch, **kw, assistant=drafter, watermarking_config=watermark)
    guidance = UnbatchedClassifierFreeGuidanceLogitsProcessor(1.5, model)
    with pytest.raises(ValueError, match="UnbatchedClassifierFreeGuidanceLogitsProcessor"):
        model.generate(**batch, **kw, assistant=drafter, logits_processor=[guidance])
    rescored = drafter_for(model, rescorer=NeuralRescorer(truncated_lm(model, 1)))
    with pytest.raises(ValueError, match="NeuralRescorer.*batch size 1"):
        model.generate(**batch, **kw, assistant=rescored)
    assert not calls


def test_batches_below_an_attention_window_squeeze_holes_and_stay_exact():
    model = tiny_model("mistral", sliding_window=32, eos_token_id=None)
    batch = left_padded(prompts_for(4, 6))  # the widest prompt has 17 tokens
    ref, out = both(model, batch, drafter_for(model), max_new_tokens=15)  # 17 + 15: the whole window
    assert out.tolist() == ref.tolist()


def test_squeeze_holes_keeps_each_rows_real_slots_in_order():
    from transformers import DynamicCache

    from hf_bpd.kv import squeeze_holes

    cache = DynamicCache()
    keys = torch.arange(2 * 6, dtype=torch.float).view(2, 1, 6, 1)
    cache.update(keys, keys.clone(), 0)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 0, 1, 1, 1, 1]])
    new = squeeze_holes(cache, mask)
    assert new.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert cache.layers[0].keys[0, 0, 2:, 0].tolist() == [1.0, 2.0, 4.0]
    assert cache.layers[0].keys[1, 0, :, 0].tolist() == [6.0, 8.0, 9.0, 10.0, 11.0]


def test_finished_rows_leave_the_cache_once_they_would_cost_a_step_and_the_rest_stay_exact(monkeypatch):
    import hf_bpd.decode.batch as batch_module

    drops = []  # (cache rows before, rows kept)
    drop = batch_module.drop_rows
    monkeypatch.setattr(
        batch_module,
        "drop_rows",
        lambda cache, mask, hidden, keep: drops.append((mask.shape[0], list(keep))) or drop(cache, mask, hidden, keep),
    )
    model = tiny_model("llama", eos_token_id=None)
    drafter = drafter_for(model)
    batch = left_padded(prompts_for(6, 3))
    _, free = both(model, batch, drafter, max_new_tokens=40)
    eos = free[2, batch["input_ids"].shape[1] + 3].item()  # row 2 ends early; others may too
    drops.clear()
    ref, out = both(model, batch, drafter, max_new_tokens=40, eos_token_id=eos)
    assert out.tolist() == ref.tolist()
    assert drops and drops[0][0] == 6 and len(drops[0][1]) < 6  # finished rows left a 6-row cache
    for (_, keep), (later_rows, _) in zip(drops, drops[1:]):
        assert later_rows == len(keep)  # each drop starts from the cache the last one left
    assert drafter.stats.rows[2].new_tokens < 40


def test_retiring_finished_rows_weighs_their_share_of_the_steps_left_against_a_step():
    from hf_bpd.decode.batch import retire_due

    assert not retire_due(0, 8, 100)  # nothing finished
    assert retire_due(1, 8, 8) and not retire_due(1, 8, 7)  # 1/8 of each of 8 steps: one step
    assert retire_due(4, 8, 2) and not retire_due(4, 8, 1)


def test_the_hole_ledger_squeezes_once_the_holes_have_cost_one_copy_of_the_cache():
    from hf_bpd.kv import HoleLedger

    ledger = HoleLedger()
    # 2 holes more each step in a 200-slot cache: 2 + 4 + ... + 2n reaches 200 at n = 14, 28 holes
    # (about sqrt(2 g S) = 28.3, the period that minimises squeezes plus holes carried)
    due = [ledger.due(2 * n, 200) for n in range(1, 20)]
    assert due.index(True) == 13
    ledger.squeezed()
    assert not ledger.due(0, 200) and not ledger.due(150, 200) and ledger.due(50, 200)


def test_a_batch_squeezes_its_holes_as_it_goes_and_every_row_stays_exact(monkeypatch):
    import hf_bpd.decode.batch as batch_module

    squeezes = []
    squeeze = batch_module.squeeze_holes
    monkeypatch.setattr(
        batch_module,
        "squeeze_holes",
        lambda cache, mask, *a: squeezes.append(mask.shape[1]) or squeeze(cache, mask, *a),
    )
    model = tiny_model("llama", eos_token_id=None)
    ref, out = both(model, left_padded(prompts_for(8, 2)), drafter_for(model), max_new_tokens=60)
    assert out.tolist() == ref.tolist()
    assert len(squeezes) >= 2  # rows accepting different lengths left holes, squeezed out more than once


def test_plain_steps_the_chooser_takes_run_on_a_cache_without_holes(monkeypatch):
    """After drafted steps left holes (rows accepting different lengths), a plain step the step chooser
    takes first squeezes them out: plain steps make none, and timed on drafted steps' holes they would look
    dearer than plain decoding is. The squeeze is charged to drafting."""
    import hf_bpd.decode.batch as batch_module
    from hf_bpd.decode.cost import BatchForwardCost, ForwardCost, StepChooser

    script = iter([True, True, True, False, False, True, True, False] * 20)  # drafted and plain steps
    decisions = [False]  # the batch's first step is plain, before the chooser
    monkeypatch.setattr(StepChooser, "draft_next", lambda self, rows=1: decisions.append(next(script)) or decisions[-1])
    charged = []
    charge = StepChooser.charge_drafting
    monkeypatch.setattr(StepChooser, "charge_drafting", lambda self, s: charged.append(s) or charge(self, s))
    monkeypatch.setattr(BatchForwardCost, "observe", lambda self, w, s: self.seconds.update({w: 0.05}))
    masks = []  # (the last two decisions, cache mask) of every verification
    verify = batch_module.verify_tree
    monkeypatch.setattr(
        batch_module,
        "verify_tree",
        lambda model, batch, cache, mask, *a: (
            masks.append((decisions[-2:], mask.clone())) or verify(model, batch, cache, mask, *a)
        ),
    )
    model = tiny_model("llama", eos_token_id=None)
    sizes = (1, 2, 4, 8, 16)
    drafter = drafter_for(model, forward_cost=ForwardCost(sizes, (0.05,) * 5))
    drafter.max_tree_tokens = "auto"
    ref, out = both(model, left_padded(prompts_for(8, 2)), drafter, max_new_tokens=40)
    assert out.tolist() == ref.tolist()

    def has_holes(mask):  # slots beyond the longest row's real tokens (what holes cost: a wider cache)
        return mask.shape[1] > int(mask.sum(-1).max())

    assert any(has_holes(m) for d, m in masks if d[-1])  # drafted steps did leave holes
    after = [m for d, m in masks if d == [True, False]]  # plain steps right after drafted ones
    assert after and not any(has_holes(m) for m in after)  # ran without them
    assert charged  # squeezed for a plain step, charged to drafting


def test_rows_with_a_context_rescorer_and_context_copy_heads_equal_plain_batched_greedy():
    from test_context_copy import copy_heads

    from hf_bpd.drafting.rescoring.ngram import NgramRescorer

    model = tiny_model("llama", eos_token_id=None)
    rescorer = NgramRescorer(context_weight=0.5, num_paths=2)
    drafter = BlockDrafter(copy_heads(model), top_k=3, max_tree_tokens=8, rescorer=rescorer)
    # repeats in the prompts give the context n-grams, the pointer and the lookup chain something to copy
    prompts = [p + p for p in prompts_for(4, 6)]
    for new in (9, 30):
        ref, out = both(model, left_padded(prompts), drafter, max_new_tokens=new)
        assert out.tolist() == ref.tolist(), new
    assert drafter.calibration is not None and drafter.calibration.summary()  # calibrated across rows


def test_sampled_rows_each_follow_plain_samplings_law():
    """Each row draws its own tokens: the first three tokens of both rows of a batch have plain sampling's
    law (χ², as for one row in test_sampling.py), while the rows accept different drafts."""
    from test_sampling import CONTROL_RUNS, STAT_OPTIONS, chi_squared_p, exact_three_token_law

    model = tiny_model("llama", vocab_size=8, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    drafter = BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=2), top_k=3, max_tree_tokens=8)
    prompts = [[1, 2, 3, 1], [4, 5, 6]]
    batch = left_padded(prompts)
    counts: list[dict] = [{}, {}]
    accepted = 0
    for seed in range(CONTROL_RUNS):
        torch.manual_seed(seed)
        out = model.generate(
            **batch,
            max_new_tokens=3,
            pad_token_id=PAD,
            custom_generate=hf_bpd.generate,
            assistant=drafter,
            **STAT_OPTIONS,
        )
        for row in range(2):
            key = tuple(out[row, -3:].tolist())
            counts[row][key] = counts[row].get(key, 0) + 1
        accepted += sum(n - 1 for r in drafter.stats.rows for n in r.accepted_lengths)
    assert accepted > CONTROL_RUNS // 10  # drafts were accepted: the tree rule ran in the batch
    for row, prompt in enumerate(prompts):
        law = exact_three_token_law(model, prompt)
        assert chi_squared_p(counts[row], law, CONTROL_RUNS) > 1e-3, row


def test_processors_with_per_row_state_see_their_own_row():
    """Repetition penalty ignores each row's own left padding, and `prefix_allowed_tokens_fn` gets each row's
    batch id, as in plain batched generate (accept_tree runs processors one row at a time)."""
    model = tiny_model("llama", eos_token_id=None)
    drafter = drafter_for(model)
    batch = left_padded(prompts_for(4, 7))

    def allowed(batch_id, sent):  # row b may only use tokens of one residue class
        return [t for t in range(model.config.vocab_size) if t % 4 == batch_id]

    for options in (dict(repetition_penalty=1.3), dict(prefix_allowed_tokens_fn=allowed)):
        ref, out = both(model, batch, drafter, max_new_tokens=20, **options)
        assert out.tolist() == ref.tolist(), options
    width = batch["input_ids"].shape[1]
    assert all(t % 4 == b for b in range(4) for t in out[b, width:].tolist())


def test_greedy_batch_steps_read_every_rows_choices_in_one_copy():
    """A greedy batch without logits processors synchronises once per step for its accept, however many
    rows (one argmax over every row and node), and not at all in the forward or the cache work: each row's
    real-token count is kept on the host."""
    model = tiny_model("llama", eos_token_id=None)
    drafter = drafter_for(model)
    drafter.count_host_syncs = True
    batch = left_padded(prompts_for(8, 4))
    ref, out = both(model, batch, drafter, max_new_tokens=30)
    assert out.tolist() == ref.tolist()
    per_step = drafter.stats.host_syncs_per_step()
    assert per_step["accept"] == 1.0, per_step
    assert per_step.get("verify", 0) == 0 and per_step.get("cache", 0) == 0, per_step
    assert max(max(r.accepted_lengths) for r in drafter.stats.rows) > 1  # drafted trees were walked too


def test_batch_draft_margin_grows_above_8_rows_so_a_thin_drafting_win_stays_plain_there():
    from hf_bpd.decode.batch import BATCH_DRAFT_MARGIN, batch_draft_margin
    from hf_bpd.decode.cost import StepChooser

    assert batch_draft_margin(1) == batch_draft_margin(8) == BATCH_DRAFT_MARGIN
    assert batch_draft_margin(16) == pytest.approx(0.10)
    assert batch_draft_margin(12) < batch_draft_margin(13)

    def chooser(rows: int) -> StepChooser:
        # drafted steps measured 8 % above plain ones per row
        c = StepChooser(lambda: 1.0, margin=batch_draft_margin(rows), drafted_rate=1.08 * rows, plain_timed=2)
        c.plain_step_seconds = 1.0
        return c

    assert chooser(8).draft_next(8) and not chooser(16).draft_next(16)


def test_one_row_probes_drafting_sooner_than_a_batch(monkeypatch):
    """One row's drafted probe costs little more than a plain step (its tree is sized down where drafts are
    weak), so a row probes after `ROW_PROBES[0]` plain steps and waits at most `ROW_PROBES[1]`; a batch's
    probe costs several plain steps, so a batch waits `BATCH_PROBES`."""
    from hf_bpd.decode.cost import BATCH_PROBES, ROW_PROBES, ForwardCost, StepChooser

    assert ROW_PROBES[0] < BATCH_PROBES[0] and ROW_PROBES[1] < BATCH_PROBES[1]
    made = []
    init = StepChooser.__init__
    monkeypatch.setattr(StepChooser, "__init__", lambda self, *a, **k: init(self, *a, **k) or made.append(self))
    model = tiny_model("llama", eos_token_id=None)
    drafter = drafter_for(model, forward_cost=ForwardCost((1, 2, 4, 8), (0.05,) * 4))
    drafter.max_tree_tokens = "auto"
    for rows, probes in ((1, ROW_PROBES), (2, BATCH_PROBES)):
        made.clear()
        ref, out = both(model, left_padded(prompts_for(rows, 3)), drafter, max_new_tokens=12)
        assert out.tolist() == ref.tolist()
        assert [(c.probe_every, c.max_probe_every) for c in made] == [probes]
