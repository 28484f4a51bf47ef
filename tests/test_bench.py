"""The bench on a tiny model: per-category aggregates, forward counting, lossless check, table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

import hf_bpd
from hf_bpd.tools import bench


class TinyChatTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt=True, return_tensors="pt", return_dict=True):
        ids = [3 + (ord(c) % 90) for m in messages for c in m["content"]][-24:]
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + int(i) % 26) for i in ids)


ROWS = [
    {"question_id": 1, "category": "writing", "turns": ["hello there", "and again"]},
    {"question_id": 2, "category": "qa", "turns": ["what is it"]},
    {"question_id": 3, "category": "qa", "turns": ["tell me more"]},
]


def test_bench_counts_forwards_and_checks_identity():
    model = tiny_model("llama", eos_token_id=None)
    drafter = hf_bpd.BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8)
    methods = [bench.greedy_method(model), bench.prompt_lookup_method(model), bench.bpd_method(model, drafter)]
    results = bench.run_bench(model, TinyChatTokenizer(), ROWS, methods, max_new_tokens=12, progress=False)
    g, p, b = (results[m]["overall"] for m in ("greedy", "prompt_lookup", "hf_bpd"))
    assert g["tau"] == 1.0 and g["speedup"] == 1.0 and g["tokens"] == 4 * 12 == b["tokens"] == p["tokens"]
    assert b["identical"] and p["identical"] and b["forwards"] <= g["forwards"]
    assert set(results["hf_bpd"]["categories"]) == {"qa", "writing"}
    assert results["hf_bpd"]["categories"]["writing"]["tokens"] == 24  # two turns
    assert set(b["ms_per_step"]) == {"heads", "rescore", "lattice_tree", "verify_forward", "accept", "cache_compaction"}
    table = bench.markdown_table(results)
    assert "| **overall** |" in table and "hf_bpd τ" in table and "| hf_bpd | " in table
    assert set(bench.learned(methods)) == {"hf_bpd"}  # the calibrated drafter's multipliers and cost factors
    assert set(bench.learned(methods)["hf_bpd"]) == {"acceptance_multipliers", "forward_cost_factors"}


def test_a_runs_header_records_the_rescorer_specs_shipped_for_its_model():
    from hf_bpd.io.packaged import packaged_rescorers

    gemma = bench.rescorer_specs(["hf_bpd", "hf_bpd+context"], "gemma-3-270m")
    assert gemma == {"context": packaged_rescorers("gemma-3-270m")["context"]}
    assert gemma != bench.rescorer_specs(["hf_bpd+context"], None)  # SmolLM2's spec has no Gemma description


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    summary = {"tau": 1.5, "speedup": 1.1, "identical": True}
    results = {m: {"overall": summary, "categories": {"qa": summary, "rag": summary}} for m in ("greedy", "x")}
    bench.plot(results, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_select_rows():
    rows = [{"category": c, "turns": ["x"]} for c in "aabbbc"]
    assert [r["category"] for r in bench.select_rows(rows, None, 1, None)] == ["a", "b", "c"]
    assert [r["category"] for r in bench.select_rows(rows, ["b"], None, 2)] == ["b", "b"]
    assert len(bench.select_rows(rows, None, None, None, spread=3)) == 3


def test_auto_tree_measurement_is_not_counted_as_decoding():
    model = tiny_model("llama", eos_token_id=None)
    drafter = hf_bpd.BlockDrafter(
        hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=2), top_k=3, max_tree_tokens="auto"
    )
    methods = [bench.greedy_method(model), bench.bpd_method(model, drafter)]
    results = bench.run_bench(model, TinyChatTokenizer(), ROWS[1:2], methods, max_new_tokens=8, progress=False)
    assert results["hf_bpd"]["overall"]["forwards"] == drafter.stats.forwards


def test_assisted_and_rescored_methods_are_lossless_and_named():
    from hf_bpd.drafting.rescoring.neural import truncated_lm
    from hf_bpd.drafting.rescoring.ngram import NgramRescorer

    model = tiny_model("llama", eos_token_id=None)
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3)
    rescored = hf_bpd.BlockDrafter(heads, top_k=3, max_tree_tokens=8, rescorer=NgramRescorer(None, context_weight=0.5))
    methods = [
        bench.greedy_method(model),
        bench.assisted_method(model, truncated_lm(model, 1)),
        bench.bpd_method(model, rescored, "hf_bpd+context"),
    ]
    results = bench.run_bench(model, TinyChatTokenizer(), ROWS, methods, max_new_tokens=12, progress=False)
    assert results["assisted"]["overall"]["identical"] and results["hf_bpd+context"]["overall"]["identical"]
    assert results["hf_bpd+context"]["overall"]["ms_per_step"]["rescore"] > 0


def test_journal_resumes_an_interrupted_run_without_redoing_rows(tmp_path):
    import json

    model = tiny_model("llama", eos_token_id=None)
    drafter = hf_bpd.BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=2), top_k=3, max_tree_tokens=6)
    calls = []

    def methods():
        greedy = bench.greedy_method(model)
        run = greedy.run
        greedy.run = lambda inputs, n: (calls.append(inputs["input_ids"].shape[1]), run(inputs, n))[1]
        return [greedy, bench.bpd_method(model, drafter)]

    journal = tmp_path / "run.journal.jsonl"
    full = bench.run_bench(model, TinyChatTokenizer(), ROWS, methods(), 8, progress=False, journal=journal)
    assert len(calls) == 4  # 4 turns
    lines = journal.read_text().splitlines()
    assert json.loads(lines[0])["header"]["methods"] == ["greedy", "hf_bpd"] and len(lines) == 1 + 4 * 2
    # interrupted while writing row 1: row 0's 4 records, then one of row 1's 2 and half of the other
    journal.write_text("\n".join(lines[:6]) + "\n" + lines[6][:20])
    calls.clear()
    resumed = bench.run_bench(model, TinyChatTokenizer(), ROWS, methods(), 8, progress=False, journal=journal)
    assert len(calls) == 2  # rows 1 and 2 (one turn each) ran again; row 0's two turns were kept
    for m in ("greedy", "hf_bpd"):
        for key in ("tokens", "forwards", "identical"):
            assert resumed[m]["overall"][key] == full[m]["overall"][key]
    assert len(journal.read_text().splitlines()) == 1 + 4 * 2
    with pytest.raises(ValueError, match="max_new_tokens"):
        bench.run_bench(model, TinyChatTokenizer(), ROWS, methods(), 9, progress=False, journal=journal)


def test_resume_identifies_heads_by_content_not_by_name(tmp_path):
    header = {"methods": ["hf_bpd"], "max_new_tokens": 8, "heads": "packaged", "drafter": {"heads_sha1": "aa"}}
    journal = tmp_path / "run.journal.jsonl"
    journal.write_text(json.dumps({"header": header}) + "\n")
    assert bench.read_journal(journal, {**header, "heads": "runs/heads3"}) == {}  # same heads, moved
    with pytest.raises(ValueError, match="heads_sha1"):  # "packaged" now names other heads
        bench.read_journal(journal, {**header, "drafter": {"heads_sha1": "bb"}})


def test_journals_from_before_packed_linear_resume_as_packed_linear_off(tmp_path):
    header = {"methods": ["hf_bpd"], "max_new_tokens": 8, "drafter": {"heads_sha1": "aa"}}  # no packed_linear
    journal = tmp_path / "run.journal.jsonl"
    journal.write_text(json.dumps({"header": header}) + "\n")
    off = {**header, "drafter": {"heads_sha1": "aa", "packed_linear": "off"}}
    assert bench.read_journal(journal, off) == {}
    with pytest.raises(ValueError, match="'packed_linear': 'off'.*} vs .*'packed_linear': 'on'"):
        bench.read_journal(journal, {**header, "drafter": {"heads_sha1": "aa", "packed_linear": "on"}})
    # journals from before the context-lookup chain ran without it
    assert bench.read_journal(journal, {**header, "drafter": {**off["drafter"], "context_lookup": 0}}) == {}
    with pytest.raises(ValueError, match="'context_lookup': 0} vs .*'context_lookup': 10}"):
        bench.read_journal(journal, {**header, "drafter": {**off["drafter"], "context_lookup": 10}})


def _journal(path, selection, records, top_k=4):
    header = {"methods": ["greedy", "hf_bpd"], "max_new_tokens": 8, "selection": selection, "drafter": {"top_k": top_k}}
    path.write_text("".join(json.dumps(x) + "\n" for x in [{"header": header}, *records]))
    return path


def _record(qid, category, method, tokens, forwards):
    return {
        "row": 0,
        "question_id": qid,
        "category": category,
        "turn": 0,
        "method": method,
        "tokens": tokens,
        "forwards": forwards,
        "seconds": 1.0,
        "greedy_seconds": 1.0,
        "identical": True,
    }


def test_merge_journals_of_a_run_split_by_category(tmp_path):
    from hf_bpd.tools.bench import merge_journals, summarize

    a = _journal(tmp_path / "a.jsonl", ["qa"], [_record(1, "qa", "greedy", 8, 8), _record(1, "qa", "hf_bpd", 8, 4)])
    b = _journal(tmp_path / "b.jsonl", ["rag"], [_record(2, "rag", "greedy", 8, 8), _record(2, "rag", "hf_bpd", 8, 2)])
    methods, records = merge_journals([a, b])
    assert methods == ["greedy", "hf_bpd"] and len(records) == 4
    merged = summarize(records, methods)["hf_bpd"]
    assert merged["overall"]["tau"] == 16 / 6  # tokens / forwards over both parts, not a mean of ratios
    assert set(merged["categories"]) == {"qa", "rag"}
    with pytest.raises(ValueError, match="overlap"):
        merge_journals([a, a])
    other = _journal(tmp_path / "c.jsonl", ["rag"], [_record(3, "rag", "greedy", 8, 8)], top_k=8)
    with pytest.raises(ValueError, match="other settings"):
        merge_journals([a, other])


def test_a_merged_run_keeps_its_parts_environments(tmp_path):
    import json

    from hf_bpd.tools.bench import merged_environment

    a = _journal(tmp_path / "a.journal.jsonl", ["qa"], [_record(1, "qa", "greedy", 8, 8)])
    b = _journal(tmp_path / "b.journal.jsonl", ["rag"], [_record(2, "rag", "greedy", 8, 8)])
    assert merged_environment([a, b]) == {}  # no reports beside the journals
    (tmp_path / "a.json").write_text(json.dumps({"environment": {"commit": "abc", "date": "2026-11-24"}}))
    merged = merged_environment([a, b])
    assert merged["environment"] == {"commit": "abc", "date": "2026-11-24"}
    assert [p["environment"] for p in merged["parts"]] == [{"commit": "abc", "date": "2026-11-24"}, None]


def test_summaries_count_the_turns_that_differ_from_greedy():
    """In low precision a tree forward may round a near tie the other way: the rate is reported, not hidden."""
    from hf_bpd.tools.bench import markdown_table, summarize

    records = [_record(1, "qa", "greedy", 8, 8), _record(1, "qa", "hf_bpd", 8, 4)]
    records += [_record(2, "rag", "greedy", 8, 8), {**_record(2, "rag", "hf_bpd", 8, 3), "identical": False}]
    results = summarize(records, ["greedy", "hf_bpd"])
    overall = results["hf_bpd"]["overall"]
    assert (overall["turns"], overall["identical_turns"], overall["identical"]) == (2, 1, False)
    assert results["hf_bpd"]["categories"]["qa"]["identical_turns"] == 1
    assert "NO (1 of 2 turns differ)" in markdown_table(results)


@pytest.mark.parametrize("command", ["bench", "replay", "analyze"])
def test_missing_prompts_file_is_refused_before_loading_a_model(command, tmp_path, monkeypatch):
    import hf_bpd.io.models
    from hf_bpd import cli

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the missing file was noticed")

    monkeypatch.setattr(hf_bpd.io.models, "load_model", no_loading)
    extra = {"bench": [], "replay": ["--answers", str(tmp_path / "a.jsonl")], "analyze": ["--output", str(tmp_path)]}
    with pytest.raises(SystemExit, match="no such file"):
        cli.main([command, str(tmp_path / "missing.jsonl"), *extra[command]])


@pytest.mark.real
def test_batch_bench_rows_equal_plain_batched_greedy(smollm2):
    from conftest import spec_bench_prompts

    from hf_bpd.tools.bench import bpd_method, greedy_method, run_batch_bench

    model, tokenizer = smollm2
    rows = [{"question_id": i, "category": "qa", "turns": [p]} for i, p in enumerate(spec_bench_prompts(4)[:3])]
    drafter = hf_bpd.load_packaged_drafter(max_tree_tokens=8)
    methods = [greedy_method(model), bpd_method(model, drafter)]
    records = run_batch_bench(model, tokenizer, rows, methods, 24, batch_size=2)
    assert [r["method"] for r in records] == ["greedy", "hf_bpd"] * 2  # a batch of 2, then one of 1
    assert all(r["identical"] for r in records), records
    by_method = {m: sum(r["tokens"] for r in records if r["method"] == m) for m in ("greedy", "hf_bpd")}
    assert by_method["greedy"] == by_method["hf_bpd"] > 0
    bpd = [r for r in records if r["method"] == "hf_bpd"]
    assert bpd[0]["forwards"] < 24 and len(bpd[0]["row_tau"]) == 2
    assert bpd[0]["steps"] == bpd[0]["forwards"] - 1 and bpd[0]["plain_steps"] == 0  # fixed trees draft every step


def test_batch_rounds_decode_every_batch_again_with_the_methods_order_turning():
    from hf_bpd.tools.bench import run_batch_bench

    class PaddingTokenizer(TinyChatTokenizer):
        pad_token_id = 0

    model = tiny_model("llama", eos_token_id=None)
    drafter = hf_bpd.BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8)
    order = []
    methods = [bench.greedy_method(model), bench.bpd_method(model, drafter)]
    for m in methods:
        run = m.run
        m.run = lambda inputs, n, run=run, name=m.name: order.append(name) or run(inputs, n)
    records = run_batch_bench(model, PaddingTokenizer(), ROWS, methods, 6, batch_size=2, rounds=2)
    # 2 rounds of (a batch of 2, a batch of 1), each decoded by both methods, after one warm-up each
    assert [(r["round"], r["method"]) for r in records] == [(k, m) for k in (0, 0, 1, 1) for m in ("greedy", "hf_bpd")]
    assert len({r["row"] for r in records}) == 4 and all(r["identical"] for r in records)
    assert order[2:] == ["greedy", "hf_bpd", "hf_bpd", "greedy"] * 2  # who runs first turns batch by batch
    with pytest.raises(SystemExit, match="--rounds"):
        bench.main(["--rounds", "2", "--max-new-tokens", "4"])


def test_round_speedups_divide_each_round_by_the_sizes_fastest_plain_method():
    def record(size, k, method, seconds):
        return {"category": f"batches of {size}", "round": k, "method": method, "seconds": seconds}

    # batches of 2: two batches a round; greedy_fast is the fastest plain method over both rounds
    records = [
        *(record(2, 0, m, s) for m, s in (("greedy", 6.0), ("greedy_fast", 4.0), ("hf_bpd", 2.0))),
        *(record(2, 0, m, s) for m, s in (("greedy", 6.0), ("greedy_fast", 4.0), ("hf_bpd", 6.0))),
        *(record(2, 1, m, s) for m, s in (("greedy", 5.0), ("greedy_fast", 5.0), ("hf_bpd", 4.0))),
        *(record(4, 0, m, s) for m, s in (("greedy", 3.0), ("greedy_fast", 4.0), ("hf_bpd", 6.0))),
    ]
    out = bench.round_speedups(records, ["greedy", "greedy_fast", "hf_bpd"])
    assert out["batches of 2"] == {"greedy": [8 / 12, 5 / 5], "greedy_fast": [1.0, 1.0], "hf_bpd": [1.0, 5 / 4]}
    assert out["batches of 4"]["hf_bpd"] == [3 / 6]  # here eager greedy is the faster plain method


def test_drafted_step_share_sums_steps_over_each_sizes_batches():
    def record(size, method, steps=None, plain=None):
        r = {"category": f"batches of {size}", "method": method}
        return r if steps is None else {**r, "steps": steps, "plain_steps": plain}

    records = [record(2, "greedy"), record(2, "hf_bpd", 10, 2), record(2, "hf_bpd", 30, 28), record(4, "hf_bpd", 5, 0)]
    assert bench.drafted_step_share(records) == {"batches of 2": {"hf_bpd": 10 / 40}, "batches of 4": {"hf_bpd": 1.0}}


@pytest.fixture
def traced_graphs(monkeypatch):
    """`torch.compile` as dynamo's trace run as traced (no inductor: quick); the list of graphs it traced."""
    graphs = []
    compile_ = torch.compile

    def traced(fn, dynamic=None, **_):
        return compile_(fn, dynamic=dynamic, backend=lambda g, _: graphs.append(g) or g.forward)

    monkeypatch.setattr(torch, "compile", traced)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=8):  # torch's own way: put back on exit
        yield graphs
    torch._dynamo.reset()


def test_a_compiled_drafted_method_meets_its_plain_steps_in_warm_up(traced_graphs):
    # every graph hf_bpd's decoding needs (prefill, one-token steps, trees) is compiled before timing
    graphs = traced_graphs
    model = tiny_model("llama", eos_token_id=None)
    drafter = hf_bpd.BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8)
    method = bench.compiled_method(bench.bpd_method(model, drafter), model, TinyChatTokenizer())
    assert drafter.max_tree_tokens == 8  # put back after the plain-step warm-up
    warmed = len(graphs)
    inputs = TinyChatTokenizer().apply_chat_template([{"role": "user", "content": "a longer prompt than both"}])
    plain = model.generate(**inputs, do_sample=False, max_new_tokens=30)
    drafter.max_tree_tokens = 1  # plain steps only
    assert method.run(inputs, 30)[0].tolist() == plain.tolist()
    drafter.max_tree_tokens = 8
    assert method.run(inputs, 30)[0].tolist() == plain.tolist()
    assert max(drafter.stats.tree_sizes) > 1 and len(graphs) == warmed


class LongChatTokenizer(TinyChatTokenizer):
    def apply_chat_template(self, messages, add_generation_prompt=True, return_tensors="pt", return_dict=True):
        ids = [3 + (ord(c) % 90) for m in messages for c in m["content"]]  # every character: prompts of any length
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}


def test_compiled_methods_meet_the_graphs_of_an_attention_window_in_warm_up(traced_graphs):
    # transformers' masks branch on whether the keys reach a window: a decode crossing it and a prompt past
    # it each need graphs, compiled in warm-up (the bench's short prompts reach neither), never in a turn
    graphs = traced_graphs
    model = tiny_model("mistral", eos_token_id=None, sliding_window=128)
    tokenizer = LongChatTokenizer()
    assert [(x["input_ids"].shape[1], n) for x, n in bench.window_warm_up(model, tokenizer, "cpu")] == [
        (112, 32),
        (144, 8),
    ]
    assert bench.window_warm_up(tiny_model("llama"), tokenizer, "cpu") == []  # no window: nothing more to warm
    drafter = hf_bpd.BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8)
    greedy = bench.compiled_method(bench.greedy_method(model), model, tokenizer)
    bpd = bench.compiled_method(bench.bpd_method(model, drafter), model, tokenizer)
    warmed = len(graphs)
    for length, new in ((100, 40), (150, 20)):  # below the window, crossing it; past it from the prompt on
        text = "".join(chr(97 + (7 * i) % 26) for i in range(length))
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        plain = model.generate(**inputs, do_sample=False, max_new_tokens=new)
        assert greedy.run(inputs, new)[0].tolist() == plain.tolist()
        assert bpd.run(inputs, new)[0].tolist() == plain.tolist()
    assert len(graphs) == warmed


def test_greedy_twin_in_a_sampled_run_decodes_greedily_with_its_own_calibration():
    model = tiny_model("llama", eos_token_id=None)
    drafter = hf_bpd.BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8)
    twin = bench.greedy_bpd_method(model, drafter)
    assert twin.name == "hf_bpd_greedy" and twin.drafter is not drafter
    assert twin.drafter.calibration is not drafter.calibration and twin.drafter.heads is drafter.heads
    ids = torch.tensor([[5, 6, 7, 5, 6, 9]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    torch.manual_seed(1)
    seq, stats = twin.run(inputs, 20)
    assert seq.tolist() == model.generate(**inputs, do_sample=False, max_new_tokens=20).tolist()
    decoding = {"do_sample": True, "temperature": 0.7}
    methods = [bench.greedy_method(model, decoding), bench.bpd_method(model, drafter, decoding=decoding), twin]
    results = bench.run_bench(model, TinyChatTokenizer(), ROWS, methods, 12, progress=False, seed=0)
    assert results["hf_bpd"]["overall"]["identical"]  # seeded plain sampling, token for token
    assert results["hf_bpd_greedy"]["overall"]["tokens"] == results["sample"]["overall"]["tokens"] == 4 * 12
    assert set(bench.learned(methods)) == {"hf_bpd", "hf_bpd_greedy"}


def test_static_cache_methods_are_lossless_and_plain_static_competes_for_the_denominator():
    model = tiny_model("llama", eos_token_id=None)
    drafter = hf_bpd.BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8)
    static = {**bench.GREEDY, **bench.STATIC}
    methods = [
        bench.greedy_method(model),
        bench.static_cache_method(model),
        bench.fast_cpu_method(bench.static_cache_method(model), model),  # the fast kernels too
        bench.bpd_method(model, drafter, "hf_bpd_static", static),
    ]
    plain = ("greedy", "greedy_static", "greedy_static_fast")
    assert [m.name for m in methods[:3]] == list(plain) and set(plain) <= set(bench.PLAIN_METHODS)
    results = bench.run_bench(model, TinyChatTokenizer(), ROWS, methods, max_new_tokens=12, progress=False)
    b = results["hf_bpd_static"]["overall"]
    assert b["identical"] and all(results[m]["overall"]["identical"] for m in plain)
    assert b["speedup_over"] in plain  # the fastest of the plain methods


def test_the_default_prompts_are_the_demo_prompts_inside_the_installed_package():
    """`hf-bpd bench` with no prompts file runs on what every install has: the demo prompts shipped in the
    package (Spec-Bench is passed as a path), each read as a one-turn row."""
    from pathlib import Path

    from hf_bpd.tools.demo import demo_prompts

    package = Path(hf_bpd.__file__).resolve().parent
    default = Path(bench.DEFAULT_DATA).resolve()
    assert default.is_file() and default.is_relative_to(package), default
    bench.check_data_file(bench.DEFAULT_DATA)  # does not exit
    rows = bench.read_prompts(bench.DEFAULT_DATA)
    assert rows and all(len(r["turns"]) == 1 and r["category"] and r["question_id"] for r in rows)
    assert [r["turns"][0] for r in rows] == demo_prompts()
    assert len({r["question_id"] for r in rows}) == len(rows)  # merged journals tell the rows apart


def test_prompts_files_of_either_format_are_read(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"prompt": "hi", "category": "qa"}) + "\n")
    rows = bench.read_prompts(path)
    assert rows[0] == ROWS[0] and rows[1]["turns"] == ["hi"] and rows[1]["category"] == "qa"
    path.write_text(json.dumps({"text": "neither"}) + "\n")
    with pytest.raises(ValueError, match="neither"):
        bench.read_prompts(path)


def test_the_bench_runs_as_a_module_and_as_an_hf_bpd_command():
    """`python -m hf_bpd.tools.bench` (the commands RESULTS.md and research/gpu record) and `hf-bpd bench`
    are the same command line."""
    import subprocess
    import sys

    from hf_bpd import cli

    out = subprocess.run(
        [sys.executable, "-m", "hf_bpd.tools.bench", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("usage: hf-bpd bench") and "--batch-size" in out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--help"])
    assert exit_.value.code == 0


def test_compiled_static_and_captured_methods_are_registered_and_give_plain_greedy_s_tokens():
    # transformers' own compile of a static cache, and hf_bpd's captured step compiled (here by the quick
    # backends: the bench compiles both with inductor), each compiled in warm-up and reported apart
    from hf_bpd.tools.bench.cli import METHODS

    assert {"greedy_static_compiled", "hf_bpd_captured"} <= set(METHODS)
    assert {"greedy_static_compiled", "sample_static_compiled"} <= set(bench.PLAIN_METHODS)
    model = tiny_model("llama", eos_token_id=None)
    drafter = hf_bpd.BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3), top_k=3, max_tree_tokens=8)
    tokenizer = TinyChatTokenizer()
    rows = ROWS[1:]  # two one-turn prompts
    first = [tokenizer.apply_chat_template([{"role": "user", "content": r["turns"][0]}]) for r in rows]
    lengths = [x["input_ids"].shape[1] for x in first]
    assert {bench.captured_capacity(n, 8) for n in lengths} == {256}  # one capacity: one graph, compiled in warm-up
    methods = [
        bench.greedy_method(model),
        bench.static_compiled_method(model, tokenizer, backend="eager"),
        bench.captured_method(model, drafter, tokenizer, 8, lengths, multi_turn=False, backend="eager"),
    ]
    assert [m.name for m in methods] == ["greedy", "greedy_static_compiled", "hf_bpd_captured"]
    assert {"greedy_static_compiled", "hf_bpd_captured"} <= set(bench.COMPILE_SECONDS)
    assert hasattr(model, "_compiled_call")  # generate took transformers' compiled call on the CPU
    captured = methods[2].drafter
    results = bench.run_bench(model, tokenizer, rows, methods, max_new_tokens=8, progress=False)
    for name in ("greedy_static_compiled", "hf_bpd_captured"):
        assert results[name]["overall"]["identical"] and results[name]["overall"]["tokens"] == 2 * 8, name
    assert captured.stats.steps < 8  # drafted steps: the captured step ran


def test_the_corpus_method_needs_its_answers_before_a_model_loads(monkeypatch):
    import hf_bpd.io.models

    monkeypatch.setattr(hf_bpd.io.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit, match="--corpus"):
        bench.main(["--methods", "greedy", "hf_bpd_corpus"])
    with pytest.raises(SystemExit, match="--corpus"):
        bench.main(["--methods", "greedy", "hf_bpd", "--corpus", "training/data/distilled/distill_self"])


@pytest.mark.real
def test_the_corpus_method_drafts_from_distilled_answers_and_stays_lossless(tmp_path, smollm2):
    out = tmp_path / "corpus.json"
    distilled = str(Path(__file__).resolve().parents[1] / "training" / "data" / "distilled" / "distill_self")
    argv = ["--methods", "greedy", "hf_bpd_corpus", "--corpus", distilled, "--limit", "2", "--max-new-tokens", "24"]
    assert bench.main([*argv, "--max-tree-tokens", "8", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["methods"]["hf_bpd_corpus"]["overall"]["identical"]
    assert report["methods"]["hf_bpd_corpus"]["overall"]["tau"] > 1


def test_a_journal_timed_on_another_machine_or_kernel_is_refused_before_a_model_loads(tmp_path, monkeypatch):
    """A resumed run's rows are summed with the journal's, and it reuses the journal's forward-cost curve:
    both only mean something on the processor and with the CPU kernel that timed them."""
    import hf_bpd.io.models
    from hf_bpd.cpu import streamed_linear
    from hf_bpd.tools.bench import check_same_machine, machine, merge_journals
    from hf_bpd.tools.bench.cli import cpu_kernel

    monkeypatch.setattr(hf_bpd.io.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    here = machine("cpu")
    assert here.startswith("cpu (") and f"{torch.get_num_threads()} threads" in here
    out = tmp_path / "run.json"
    journal = tmp_path / "run.journal.jsonl"
    header = {"methods": ["greedy", "hf_bpd"], "max_new_tokens": 8, "drafter": {"top_k": 4}}
    journal.write_text(json.dumps({"header": {**header, "machine": "cpu (Other CPU, 64 cores, 64 threads)"}}) + "\n")
    with pytest.raises(SystemExit, match=r"timed on 'cpu \(Other CPU, 64 cores, 64 threads\)'; this is"):
        bench.main(["--methods", "greedy", "--output", str(out), "--resume"])
    journal.write_text(json.dumps({"header": header}) + "\n")  # from before journals recorded it
    with pytest.raises(SystemExit, match="on a machine it does not record"):
        bench.main(["--methods", "greedy", "--output", str(out), "--resume"])
    # the same machine with another build of the CPU kernel (or a journal from before they were recorded)
    kernel = cpu_kernel("cpu")
    assert kernel == streamed_linear.version() and cpu_kernel("cuda") is None
    for recorded in ({}, {"cpu_kernel": "0123456789"}):
        journal.write_text(json.dumps({"header": {**header, "machine": here, **recorded}}) + "\n")
        with pytest.raises(SystemExit, match="another build of hf_bpd's CPU kernel"):
            bench.main(["--methods", "greedy", "--output", str(out), "--resume"])
    journal.write_text(json.dumps({"header": {**header, "machine": here, "cpu_kernel": kernel}}) + "\n")
    check_same_machine(journal, here, kernel)  # the same machine and kernel resume
    check_same_machine(tmp_path / "none.journal.jsonl", here)  # and a run not started yet starts
    # parts of one run split over machines still merge: each keeps its own environment
    other = tmp_path / "other.journal.jsonl"
    other.write_text(json.dumps({"header": {**header, "machine": "cpu (Other CPU, 64 cores, 64 threads)"}}) + "\n")
    assert merge_journals([journal, other]) == (["greedy", "hf_bpd"], [])


@pytest.mark.real
def test_a_bench_journal_records_its_machine_and_resumes_there(tmp_path, smollm2):
    from hf_bpd.cpu import streamed_linear

    out = tmp_path / "run.json"
    argv = ["--methods", "greedy", "--limit", "1", "--max-new-tokens", "4", "--max-tree-tokens", "8"]
    assert bench.main([*argv, "--output", str(out), "--no-progress"]) == 0
    journal = out.with_suffix(".journal.jsonl")
    header = json.loads(journal.read_text().splitlines()[0])["header"]
    assert header["machine"] == bench.machine("cpu") == json.loads(out.read_text())["environment"]["device"]
    assert header["cpu_kernel"] == streamed_linear.version()
    records = journal.read_text().splitlines()[1:]
    assert bench.main([*argv, "--output", str(out), "--no-progress", "--resume"]) == 0
    assert journal.read_text().splitlines()[1:] == records  # nothing redone


def test_a_second_drafter_runs_in_the_same_bench_as_its_own_method(tmp_path, smollm2):
    from hf_bpd.io.packaged import load_packaged_drafter

    other = tmp_path / "other"
    load_packaged_drafter().save_pretrained(other)
    out = tmp_path / "run.json"
    methods = ["greedy", "hf_bpd", f"hf_bpd@{other}"]
    argv = ["--methods", *methods, "--limit", "1", "--max-new-tokens", "8", "--max-tree-tokens", "8"]
    assert bench.main([*argv, "--output", str(out), "--no-progress"]) == 0
    results = json.loads(out.read_text())["methods"]
    assert set(results) == set(methods)
    assert results[f"hf_bpd@{other}"]["overall"]["identical"] and results["hf_bpd"]["overall"]["identical"]
    header = json.loads(out.with_suffix(".journal.jsonl").read_text().splitlines()[0])["header"]
    assert header["other_drafters"] == {f"hf_bpd@{other}": header["drafter"]["heads_sha1"]}  # the same heads


def test_the_runs_forward_cost_curve_goes_only_to_drafters_with_auto_trees():
    from conftest import random_heads

    from hf_bpd import BlockDrafter
    from hf_bpd.decode.cost import ForwardCost
    from hf_bpd.tools.bench.cli import share_forward_cost

    model = tiny_model("llama")
    auto = BlockDrafter(random_heads(model), max_tree_tokens="auto")
    fixed = BlockDrafter(random_heads(model), max_tree_tokens=8)  # given a curve it would size trees up to 8
    curve = ForwardCost((1, 8), (0.04, 0.06))
    share_forward_cost(curve, [auto, fixed])
    assert auto.forward_cost is curve and fixed.forward_cost is None
