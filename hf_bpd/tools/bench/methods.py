"""The decoding methods a bench run compares (plain `generate` greedy or sampling, on fast_cpu's kernels,
compiled or on a static cache; transformers' prompt lookup and assisted generation; hf_bpd) and the timed
loop that runs them all on every turn, interleaved per prompt (`run_bench`)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ...compat import cache_argument
from ...cpu.packed_linear import fast_cpu
from ...decode.binding import binding_of, prepare
from ...decode.support import attention_windows
from ...drafting.drafter import BlockDrafter
from ...generation import generate as bpd_generate
from ...io.models import chat_inputs
from ..forward_counter import ForwardCounter
from .journal import append_records, read_journal
from .report import summarize


@torch.no_grad()
def answer_nll(model, sequence: torch.Tensor, prompt_length: int) -> float:
    """Summed negative log-likelihood of the answer `sequence[0, prompt_length:]` under the base model's
    raw distribution (temperature 1): the quality measure of sampled runs, where outputs differ by method
    and a lossy acceptance rule would show as a shift from plain sampling's value."""
    logits = model(sequence).logits[0, prompt_length - 1 : -1].float()
    answer = sequence[0, prompt_length:]
    return float(torch.nn.functional.cross_entropy(logits, answer, reduction="sum"))


@dataclass
class Method:
    """A decoding method: `run(inputs, max_new_tokens) -> (sequences, stats or None)`; hf_bpd methods keep
    their drafter (for what it learned during the run)."""

    name: str
    run: Callable
    drafter: BlockDrafter | None = None
    # for a method whose forwards run inside graphs compiled before the bench's counting hook was set (a hook
    # added later is not traced into them): its forwards from (sequences, new tokens, stats)
    forwards: Callable | None = None


GREEDY = {"do_sample": False}
STATIC = {"cache_implementation": "static"}  # generate's static cache (compiled with CUDA graphs on a GPU)


def reference_name(decoding: dict) -> str:
    """The reference method's name: plain `generate` greedy ("greedy") or sampling ("sample")."""
    return "sample" if decoding.get("do_sample") else "greedy"


def greedy_method(model, decoding: dict = GREEDY) -> Method:
    """Plain `generate` with the run's decoding settings (greedy, or sampling options): the reference."""
    return Method(
        reference_name(decoding), lambda inputs, n: (model.generate(**inputs, **decoding, max_new_tokens=n), None)
    )


def static_cache_method(model, decoding: dict = GREEDY) -> Method:
    """Plain `generate` on a static cache (named `<reference>_static`): on a GPU `generate` compiles its
    decoding there (CUDA graphs), its fastest plain decoding; a plain method like the others."""
    return Method(f"{reference_name(decoding)}_static", greedy_method(model, {**decoding, **STATIC}).run)


def fast_cpu_method(method: Method, model) -> Method:
    """`method` with every forward of `model` on `hf_bpd.fast_cpu`'s kernels (named `<name>_fast`): the
    kernels hf_bpd's own forwards use, given to the baselines too. The kernel plan is measured (or read
    from the cache) here, before any timing."""
    try:
        block = fast_cpu(model)
    except (ValueError, RuntimeError) as err:
        raise SystemExit(f"{method.name}_fast runs on hf_bpd.fast_cpu's CPU kernels: {err}") from None

    def run(inputs, n):
        with block:
            return method.run(inputs, n)

    return Method(f"{method.name}_fast", run)


def compiled_method(method: Method, model, tokenizer) -> Method:
    """`method` with the model's forward compiled by `torch.compile` (inductor with freezing: the weights
    become constants, packed for the CPU; dynamic shapes), named `<name>_compiled`: the other fast plain
    baseline. Compiled here, on two warm-up prompts of different lengths (the second compiles the dynamic
    graph), before any timing; compilation is a one-time cost the run reports apart, not in tokens/s."""
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor

    inductor.freezing = True
    # every compiled method of the run shares model.forward's code object, whose graphs count against one
    # limit (8 by default; past it dynamo runs new shapes eagerly, unreported): plain greedy's prefill and
    # step, and hf_bpd's one-token and tree forwards, cost curve and cropped caches
    dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
    compiled = torch.compile(model.forward, dynamic=True)

    def run(inputs, n):
        model.forward = compiled  # for this call only: an instance attribute, removed after
        try:
            return method.run(inputs, n)
        finally:
            del model.forward

    device = next(model.parameters()).device
    short, longer = (
        chat_inputs(tokenizer, [{"role": "user", "content": text}], device)
        for text in ("Hi.", "Say hello to the world in three different languages, please.")
    )
    windowed = window_warm_up(model, tokenizer, device)
    t0 = time.perf_counter()
    # long enough for a drafted method to meet its shapes (tree sizes, a compacted cache) before timing
    for inputs, new_tokens in [(short, 32), (longer, 32), *windowed]:
        run(inputs, new_tokens)
    if method.drafter is not None:
        # a drafted method's plain steps (one token on a cache) are a graph of their own, which a decode meets
        # only where drafting stops paying: compiled here, not inside a timed turn
        tree_size, method.drafter.max_tree_tokens = method.drafter.max_tree_tokens, 1
        try:
            for inputs, new_tokens in [(longer, 8), *windowed]:
                run(inputs, new_tokens)
        finally:
            method.drafter.max_tree_tokens = tree_size
    COMPILE_SECONDS[f"{method.name}_compiled"] = time.perf_counter() - t0
    return Method(f"{method.name}_compiled", run)


COMPILE_SECONDS: dict[str, float] = {}  # one-time compilation of the `_compiled` methods of this process


def window_warm_up(model, tokenizer, device) -> list[tuple[dict, int]]:
    """Warm-up decodes for a compiled model with attention windows, as (inputs, new tokens): transformers'
    masks branch on whether the keys reach a window, and the compiled forward guards on it, so for each
    window a decode that crosses it and a prompt past it need graphs of their own (met in a timed turn,
    they would be compiled there). Empty for a model without windows."""
    windows = attention_windows(model)
    if windows is None or not windows.layers:
        return []
    sizes = sorted({size for _, size in windows.layers.values()})
    text = "Tell me about the history of the world, one century at a time. " * (sizes[-1] // 4 + 16)
    inputs = chat_inputs(tokenizer, [{"role": "user", "content": text}], device)
    if inputs["input_ids"].shape[1] < sizes[-1] + 16:
        raise RuntimeError(f"a window warm-up prompt of {inputs['input_ids'].shape[1]} tokens, under {sizes[-1] + 16}")

    def first(n: int) -> dict:
        return {k: v[:, :n] for k, v in inputs.items()}

    return [decode for size in sizes for decode in ((first(max(size - 16, 1)), 32), (first(size + 16), 8))]


def static_compiled_method(model, tokenizer, decoding: dict = GREEDY, backend: str = "inductor") -> Method:
    """Plain `generate` on a static cache that transformers itself compiles (`<reference>_static_compiled`):
    a `CompileConfig` asks `generate` to compile its one-token steps on any device (`_compile_all_devices`,
    which `_valid_auto_compile_criteria` reads; a GPU needs no flag), through the model's own compiled call
    (`get_compiled_call`; the prefill runs eagerly). The GPU users' baseline, and on a CPU a candidate for
    the fastest plain decoding: on a CPU without CUDA graphs (mode "default") and without inductor's
    freezing, which dynamo reads globally (`compiled_method` sets it) and which would make the static cache's
    tensors constants of the graph, stale for the next call's cache. Compiled here on two warm-up prompts
    of different lengths (the static cache's length differs, so the second makes its dimension dynamic),
    before any timing; the compile time is reported apart (`COMPILE_SECONDS`)."""
    from transformers import CompileConfig

    device = next(model.parameters()).device
    on_cpu = device.type == "cpu"
    config = CompileConfig(
        backend=backend,
        mode="default" if on_cpu else "reduce-overhead",
    )
    config._compile_all_devices = True  # transformers' flag: compile on this device too (a CPU)
    name = f"{reference_name(decoding)}_static_compiled"
    settings = {**decoding, **STATIC, "compile_config": config}

    def run(inputs, n):
        import torch._inductor.config as inductor_config  # loaded by torch.compile on first use: not before

        with inductor_config.patch(freezing=False):
            return model.generate(**inputs, **settings, max_new_tokens=n), None

    short, longer = (
        chat_inputs(tokenizer, [{"role": "user", "content": text}], device)
        for text in ("Hi.", "Say hello to the world in three different languages, please.")
    )
    t0 = time.perf_counter()
    for inputs in (short, longer, short):
        run(inputs, 16)
    COMPILE_SECONDS[name] = time.perf_counter() - t0
    return Method(name, run, forwards=lambda seq, new, stats: new)  # plain: one forward per new token


# the static cache of the captured method holds its turn's prompt, answer and one largest tree, rounded up
# to a multiple of this: each capacity is a graph per tree size, so a run needs few, all compiled in warm-up
CAPTURED_CAPACITY_STEP = 256


def captured_capacity(prompt_tokens: int, max_new_tokens: int, step: int = CAPTURED_CAPACITY_STEP) -> int:
    """The static cache capacity `captured_method` decodes a prompt of `prompt_tokens` on: room for the
    answer and a whole tree of the largest size past it (so every bucket fits up to the last step: the
    step's choice is its own, not the cache's), rounded up to `step`."""
    from ...decode.captured import CAPTURED_TREE_SIZES

    return -(-(prompt_tokens + max_new_tokens + CAPTURED_TREE_SIZES[-1]) // step) * step


def captured_method(
    model,
    drafter: BlockDrafter,
    tokenizer,
    max_new_tokens: int,
    prompts: list[int] = (),
    multi_turn: bool = True,
    backend: str = "inductor",
    decoding: dict = GREEDY,
) -> Method:
    """hf_bpd's captured decode step (`decode/captured.py`: each greedy step one function over device
    tensors) compiled with `backend` (`torch.compile`, one graph per tree size and cache capacity), on a
    static cache: `hf_bpd_captured`. On a CPU it runs on the drafter's kernels (`packed_linear`: oneDNN's
    and the streamed kernel's packed weights, custom ops inside the graph), as `hf_bpd` does. Each turn
    decodes on a `StaticCache` of `captured_capacity` positions, so that the capacities of a run are few:
    those of `prompts` (the run's first-turn prompt lengths in tokens) and, for `multi_turn` rows, the next
    one up are compiled here, in warm-up, before any timing, and reported apart (`COMPILE_SECONDS`). A
    drafter copy of its own (own calibration); the tokens are plain greedy's, as the bench checks."""
    from transformers import StaticCache

    own = drafter.with_rescorer(drafter.rescorer)
    prepare(own, model)
    name = "hf_bpd_captured"
    settings = {**decoding, "custom_generate": bpd_generate, "assistant": own, "captured_step": backend}

    def decode(inputs, n, capacity):
        cache = StaticCache(config=model.config, max_cache_len=capacity)
        cache_kwarg = {cache_argument(model) or "past_key_values": cache}  # "cache" in newer transformers
        return model.generate(**inputs, **settings, max_new_tokens=n, **cache_kwarg), own.stats

    def run(inputs, n):
        return decode(inputs, n, captured_capacity(inputs["input_ids"].shape[1], n))

    device = next(model.parameters()).device
    warm = chat_inputs(tokenizer, [{"role": "user", "content": "Hi."}], device)
    capacities = {captured_capacity(length, max_new_tokens) for length in (*prompts, warm["input_ids"].shape[1])}
    if multi_turn:  # a later turn holds the first turn's prompt and answer: often the next capacity up
        capacities |= {c + CAPTURED_CAPACITY_STEP for c in capacities}
    t0 = time.perf_counter()
    for capacity in sorted(capacities):  # a few tokens decoded on each capacity: its graph compiles
        decode(warm, 8, capacity)
    COMPILE_SECONDS[name] = time.perf_counter() - t0
    return Method(name, run, own, forwards=lambda seq, new, stats: stats.forwards)


def prompt_lookup_method(model, num_tokens: int = 10, decoding: dict = GREEDY) -> Method:
    """transformers' prompt-lookup decoding: drafts copied from n-gram matches in the prompt."""

    def run(inputs, n):
        return model.generate(**inputs, **decoding, max_new_tokens=n, prompt_lookup_num_tokens=num_tokens), None

    return Method("prompt_lookup", run)


def assisted_method(model, assistant_model, name: str = "assisted", decoding: dict = GREEDY) -> Method:
    """transformers' assisted generation with a small draft LM sharing the tokenizer."""

    def run(inputs, n):
        return model.generate(**inputs, **decoding, max_new_tokens=n, assistant_model=assistant_model), None

    return Method(name, run)


def bpd_method(model, drafter: BlockDrafter, name: str = "hf_bpd", decoding: dict = GREEDY) -> Method:
    # One-time start-up work (binding the heads, measuring the forward-cost curve for "auto" trees) is
    # done here, like model loading, so it is neither timed nor counted as decoding forwards.
    prepare(drafter, model)

    def run(inputs, n):
        out = model.generate(**inputs, **decoding, max_new_tokens=n, custom_generate=bpd_generate, assistant=drafter)
        return out, drafter.stats

    return Method(name, run, drafter)


def greedy_bpd_method(model, drafter: BlockDrafter) -> Method:
    """hf_bpd decoding greedily inside a sampled run: the greedy τ of the same drafter on the same turns
    (later turns continue the reference's sampled answers), which sampling's τ is measured against. Its
    drafter is a copy with the same heads and settings, so that its calibration is greedy's own; its
    tokens are greedy's, so it is not expected to match the sampled reference."""
    return bpd_method(model, drafter.with_rescorer(drafter.rescorer), "hf_bpd_greedy", GREEDY)


def learned(methods: list[Method]) -> dict:
    """What each calibrated hf_bpd method's drafter learned so far: acceptance multipliers per
    source@depth and forward-cost factors per tree-size bucket."""
    return {
        m.name: {
            "acceptance_multipliers": m.drafter.calibration.summary(),
            "forward_cost_factors": getattr(binding_of(m.drafter).step_cost, "factors", {}),
        }
        for m in methods
        if m.drafter is not None and m.drafter.calibration is not None
    }


def run_bench(
    model,
    tokenizer,
    rows: list[dict],
    methods: list[Method],
    max_new_tokens: int,
    progress: bool = True,
    journal: str | Path | None = None,
    header: dict | None = None,
    seed: int | None = None,
) -> dict:
    """Run every method on every turn of every row (greedy first: it is the reference and gives the
    MT-bench first answers). Returns {method: {"overall": summary, "categories": {cat: summary}}}.

    seed: for sampling runs, every method of a turn starts from `torch.manual_seed(seed + turn number)`,
    so hf_bpd, which draws exactly as plain sampling does, can be compared token for token.

    journal: a jsonl file that gets `header` and then each finished row's records (one per turn and
    method), flushed row by row; a rerun with the same journal and header skips the rows already there
    (resume after an interruption) and aggregates them with the new ones."""
    from tqdm import tqdm

    names = [m.name for m in methods]
    header = {**(header or {}), "methods": names, "max_new_tokens": max_new_tokens, "rows": len(rows)}
    done = {}
    if journal is not None:  # rows whose every turn has every method's record
        for i, records in read_journal(journal, header).items():
            if i >= len(rows) or any(r["question_id"] != rows[i].get("question_id") for r in records):
                continue
            pairs = [(r["turn"], r["method"]) for r in records]
            if sorted(pairs) == sorted((t, m) for t in range(len(rows[i]["turns"])) for m in names):
                done[i] = records
        # rewrite: header + complete rows only (a row cut off mid-write is redone); atomically, so an
        # interruption now loses nothing
        Path(journal).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(journal).with_suffix(".tmp")
        tmp.write_text(
            "".join(json.dumps(x) + "\n" for x in [{"header": header}, *(r for i in sorted(done) for r in done[i])])
        )
        os.replace(tmp, journal)
    device = next(model.parameters()).device
    greedy = methods[0]
    with ForwardCounter(model) as counter:
        todo = [(i, row) for i, row in enumerate(rows) if i not in done]
        for i, row in tqdm(todo, disable=not progress, desc="bench", initial=len(done), total=len(rows)):
            records = []
            messages: list[dict] = []
            for t, turn in enumerate(row["turns"]):
                messages.append({"role": "user", "content": turn})
                inputs = chat_inputs(tokenizer, messages, device)
                n = inputs["input_ids"].shape[1]
                # interleave: rotate the order of the non-reference methods from row to row
                others = methods[1:]
                others = others[i % len(others) :] + others[: i % len(others)] if others else []
                results = {}
                for m in [greedy, *others]:
                    if seed is not None:
                        torch.manual_seed(seed + 1000 * i + t)
                    counter.count = 0
                    t0 = time.perf_counter()
                    seq, stats = m.run(inputs, max_new_tokens)
                    secs = time.perf_counter() - t0
                    if m.forwards is not None:  # forwards in compiled graphs, which the counter's hook misses
                        counter.count = m.forwards(seq, seq.shape[1] - n, stats)
                    results[m.name] = (seq, counter.count, stats, secs)
                    if stats is not None and stats.forwards != counter.count:
                        raise RuntimeError(
                            f"{m.name}: stats count {stats.forwards} forwards, the model ran {counter.count}"
                        )
                ref, greedy_s = results[greedy.name][0], results[greedy.name][3]
                for name in names:
                    seq, forwards, stats, secs = results[name]
                    record = {
                        "row": i,
                        "question_id": row.get("question_id"),
                        "category": row["category"],
                        "turn": t,
                        "method": name,
                        "tokens": seq.shape[1] - n,
                        "forwards": forwards,
                        "seconds": secs,
                        "greedy_seconds": greedy_s,
                        "identical": seq.tolist() == ref.tolist(),
                    }
                    if seed is not None:  # after the timing, not counted as decoding forwards
                        record["nll"] = answer_nll(model, seq, n)
                    if stats is not None:
                        record["steps"] = stats.steps
                        record["step_seconds"] = {k: v * stats.steps for k, v in stats.time_per_step().items()}
                    records.append(record)
                answer = tokenizer.decode(ref[0, n:], skip_special_tokens=True)
                messages.append({"role": "assistant", "content": answer})
            done[i] = records
            if journal is not None:
                append_records(journal, records)
    return summarize([r for i in sorted(done) for r in done[i]], names)


def load_drafter(heads: str, model, num_heads: int = 4, packaged_model: str | None = None, **kwargs) -> BlockDrafter:
    """The drafter a benchmark runs, profiled: `heads` is a folder, "packaged" (the heads shipped for the
    packaged model `packaged_model` names, None the default, with their drafter.json settings, which
    `kwargs` override) or "untrained" (`num_heads` fresh heads)."""
    from ...drafting.heads import BlockDraftHeads

    if heads == "untrained":
        return BlockDrafter(BlockDraftHeads.for_base_model(model, num_heads=num_heads), profile=True, **kwargs)
    if heads == "packaged":
        from ...io.packaged import load_packaged_drafter

        drafter = load_packaged_drafter(model=packaged_model, **kwargs)
        drafter.profile = True
        return drafter
    return BlockDrafter.from_pretrained(heads, profile=True, **kwargs)
