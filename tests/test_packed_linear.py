"""oneDNN pre-packed linears (`hf_bpd.cpu.packed_linear`): same numbers as `F.linear` up to rounding, used
only inside the context, never stale, and lossless decoding with them."""

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

import hf_bpd
from hf_bpd.compat import cache_argument, compiled_forward
from hf_bpd.cpu.packed_linear import (
    KERNEL_PLAN_SIZES,
    KernelPlan,
    PackedLinear,
    RowPlan,
    active_packed_linear,
    cached_kernel_plan,
    fast_cpu,
    linear_context,
    packed_linear_available,
    wants_packed_linear,
)
from hf_bpd.decode.binding import binding_of
from hf_bpd.decode.cost import ForwardTimer, measure_forward_cost
from hf_bpd.kv import contiguous_kv

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="this torch build has no oneDNN")


def test_packed_linear_matches_the_layer_for_any_row_count_and_reuses_its_packing():
    torch.manual_seed(0)
    layer = torch.nn.Linear(40, 96)
    plain = torch.nn.Linear(40, 96, bias=False)
    mode = PackedLinear(torch.nn.Sequential(layer, plain))
    assert mode.layers == [layer, plain]
    for shape in [(40,), (1, 40), (3, 40), (2, 5, 40), (70, 40)]:
        x = torch.randn(*shape)
        with mode, torch.no_grad():
            got, got_nobias = layer(x), plain(x)
        assert got.shape == (*shape[:-1], 96)
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_nobias, F.linear(x, plain.weight), rtol=1e-4, atol=1e-4)
    assert len(mode) == 2  # one packed copy per weight, made on first use


def test_packed_linear_repacks_a_weight_changed_in_place():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16)
    with PackedLinear(layer), torch.no_grad():
        layer(x)
        layer.weight.mul_(2)  # e.g. merging an adapter into the base weights
        got = layer(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)


def test_packed_linear_leaves_what_it_cannot_serve_to_the_layer():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16, requires_grad=True)
    double = torch.nn.Linear(16, 8).double()
    mode = PackedLinear(layer, double)
    with mode:
        layer(x).sum().backward()  # autograd: the packed op has no backward
        wide = double(x.detach().double())  # another dtype
    assert x.grad is not None and x.grad.shape == x.shape
    torch.testing.assert_close(wide, F.linear(x.detach().double(), double.weight, double.bias))
    assert len(mode) == 0  # neither call used a packed weight


def test_packed_linear_is_scoped_to_its_blocks():
    layer = torch.nn.Linear(4, 8)
    mode = PackedLinear(layer)
    with mode:
        with mode:  # re-entered (the heads inside a verification): still packed after the inner exit
            assert "forward" in layer.__dict__
        assert "forward" in layer.__dict__
    assert "forward" not in layer.__dict__  # outside: the layer's own class forward again
    with pytest.raises(KeyError), mode:
        raise KeyError("boom")
    assert "forward" not in layer.__dict__


def test_the_heads_softmax_over_the_base_lm_head_is_packed_inside_a_block():
    model = tiny_model("llama")
    heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=2, token_input="previous").bind(model)
    assert heads.config.tie_lm_head  # the softmax borrows the base LM head: a weight, not an nn.Linear
    states = torch.randn(5, model.config.hidden_size)
    outer, inner = PackedLinear(model), PackedLinear(heads)
    assert active_packed_linear() is None
    with outer, inner, torch.no_grad():
        assert active_packed_linear() is inner  # the innermost block serves non-layer linears
        got = heads.project(states)
    assert active_packed_linear() is None
    torch.testing.assert_close(got, F.linear(states, heads.__dict__["_tied_weight"]), rtol=1e-4, atol=1e-4)
    assert len(inner) == 1 and len(outer) == 0


def test_auto_resolution_and_refusals():
    model = tiny_model("llama")
    assert wants_packed_linear(model, None)  # float32, CPU, tiny
    assert not wants_packed_linear(model, False)
    assert isinstance(linear_context(model, False), contextlib.nullcontext)
    assert linear_context(model, True) is linear_context(model, None)  # one packed copy per model
    assert not wants_packed_linear(model.to(torch.bfloat16), None)
    with pytest.raises(ValueError, match="float32 models on a CPU; this one is torch.bfloat16"):
        wants_packed_linear(model, True)
    with pytest.raises(ValueError, match="packed_linear must be True, False or None"):
        hf_bpd.BlockDrafter(hf_bpd.BlockDraftHeads.for_base_model(tiny_model(), num_heads=2), packed_linear="yes")


def test_a_torch_whose_private_ops_changed_turns_packing_off_or_raises(monkeypatch):
    import hf_bpd.cpu.packed_linear as packed_linear

    def changed(*args):
        raise RuntimeError("mkldnn::_linear_pointwise() expected at most 5 arguments")

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", changed)
    assert packed_linear.packed_linear_available.__wrapped__() is False  # the self-check, uncached
    monkeypatch.setattr(packed_linear, "packed_linear_available", lambda: False)
    model = tiny_model("llama")
    assert not packed_linear.wants_packed_linear(model, None)
    with pytest.raises(RuntimeError, match="needs oneDNN's packed linear ops"):
        packed_linear.wants_packed_linear(model, True)


@pytest.mark.parametrize("token_input", ["next", "previous"])
def test_generate_with_packed_linear_equals_greedy(token_input):
    from test_decoding import copying_heads

    model = tiny_model("llama", eos_token_id=None)
    heads = copying_heads(model, 4)
    if token_input == "previous":
        heads = hf_bpd.BlockDraftHeads.for_base_model(model, num_heads=3, token_input="previous")
    ids = torch.tensor([[5, 6, 7]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=60)
    for packed in (True, False):
        drafter = hf_bpd.BlockDrafter(heads, top_k=3, max_tree_tokens=16, packed_linear=packed)
        got = model.generate(
            ids, do_sample=False, max_new_tokens=60, custom_generate=hf_bpd.generate, assistant=drafter
        )
        assert got.tolist() == ref.tolist()
        assert token_input == "previous" or max(drafter.stats.accepted_lengths) > 1
        assert isinstance(binding_of(drafter).linear_context, PackedLinear) == packed


def test_a_compiled_forward_runs_the_trees_unpacked_exactly_and_gets_its_own_cost_curve(tmp_path, monkeypatch):
    # transformers' way to compile a model for generate: replace model.forward. hf_bpd must then leave the
    # linears to the compiled graph, send its tree forwards (4D mask, several tokens) through it, and size
    # "auto" trees by a curve measured on it.
    from test_decoding import copying_heads

    monkeypatch.setenv("HF_BPD_CACHE", str(tmp_path))
    model = tiny_model("llama", eos_token_id=None)
    ids = torch.tensor([[5, 6, 7]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=40)
    other = torch.tensor([[9, 3, 4, 3, 4, 3]])
    other_ref = model.generate(other, do_sample=False, max_new_tokens=40)
    fixed = hf_bpd.BlockDrafter(copying_heads(model, 4), top_k=3, max_tree_tokens=16)
    auto = hf_bpd.BlockDrafter(fixed.heads, top_k=3, max_tree_tokens="auto")
    kw = dict(do_sample=False, max_new_tokens=40, custom_generate=hf_bpd.generate)
    assert model.generate(ids, assistant=auto, **kw).tolist() == ref.tolist()
    assert isinstance(binding_of(auto).linear_context, PackedLinear)
    packed_curve = auto.forward_cost

    graphs = []

    def counting_backend(graph, example_inputs):  # dynamo's trace, run as traced (no inductor: quick)
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(model.forward, backend=counting_backend, dynamic=True)
    layouts = []  # whether every cached key and value tensor the compiled forward was given is contiguous

    @functools.wraps(compiled)  # its signature, and the mark compiled_forward looks for
    def recording(*args, **kwargs):
        cache = kwargs.get(cache_argument(model))
        tensors = [getattr(layer, n, None) for layer in getattr(cache, "layers", []) for n in ("keys", "values")]
        if any(t is not None and t.numel() for t in tensors):
            layouts.append(all(t.is_contiguous() for t in tensors if t is not None))
        return compiled(*args, **kwargs)

    model.forward = recording
    try:
        assert compiled_forward(model) and not wants_packed_linear(model, None)
        with pytest.raises(ValueError, match="model.forward is compiled"):
            wants_packed_linear(model, True)
        for drafter in (fixed, auto):
            assert model.generate(ids, assistant=drafter, **kw).tolist() == ref.tolist()
            assert isinstance(binding_of(drafter).linear_context, contextlib.nullcontext)
            # the heads run eagerly beside the graph: their own linears keep the packed kernels, by a plan
            # measured on them (every shape of theirs, and the LM-head rows they borrow)
            heads_kernels = drafter.heads_context
            assert isinstance(heads_kernels, PackedLinear) and heads_kernels.layers
            borrowed = drafter.heads.__dict__["_tied_weight"]
            shapes = {tuple(layer.weight.shape) for layer in heads_kernels.layers} | {tuple(borrowed.shape)}
            assert shapes <= set(heads_kernels.plan.shapes)
        unpacked = hf_bpd.BlockDrafter(fixed.heads, top_k=3, max_tree_tokens=16, packed_linear=False)
        assert model.generate(ids, assistant=unpacked, **kw).tolist() == ref.tolist()
        assert isinstance(unpacked.heads_context, contextlib.nullcontext)  # packed_linear=False: none anywhere
        assert max(fixed.stats.accepted_lengths) > 1  # trees were verified through the compiled forward
        assert graphs
        # decoding again (another prompt, other lengths) compiles nothing new
        compiled_graphs = len(graphs)
        assert model.generate(other, assistant=fixed, **kw).tolist() == other_ref.tolist()
        # nor do plain one-token steps after the prefill and between trees: every cache the compiled forward
        # is given is laid out alike (`contiguous_kv`), and the cost curve's timing compiled the one-token graph
        roots_only = hf_bpd.BlockDrafter(fixed.heads, top_k=3, max_tree_tokens=1, context_lookup=0)
        assert model.generate(other, assistant=roots_only, **kw).tolist() == other_ref.tolist()
        assert max(roots_only.stats.tree_sizes) == 1
        assert len(graphs) == compiled_graphs
        assert layouts and all(layouts)  # after a prefill, a crop or a compaction alike
        assert auto.forward_cost is not packed_curve  # measured again, on the compiled forward
    finally:
        del model.forward
    assert not compiled_forward(model)


def test_timing_a_compiled_forward_compiles_the_graphs_verification_then_runs():
    # the cost curve's timed forwards must be the very call `verify_tree` makes (the same keyword arguments,
    # the same cache layout): a compiled forward guards on them, so otherwise the first one-token step a
    # decoding takes (whether it takes one depends on the host's timings) compiles a graph mid-decoding
    from hf_bpd.decode.verify import verify_tree
    from hf_bpd.drafting.tree import DraftTree, batch_trees

    model = tiny_model("llama", eos_token_id=None)
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(model.forward, backend=counting_backend, dynamic=True)
    model.forward = functools.wraps(compiled)(lambda *args, **kwargs: compiled(*args, **kwargs))
    try:
        assert compiled_forward(model)
        timer = ForwardTimer(model, context=8)  # its prefill compiles a graph, as a decoding's prefill does
        for n in (1, 3):
            timer.once(n, contextlib.nullcontext())
        timed = len(graphs)
        tree = DraftTree.root_only(5)
        tree.add_path([6, 7], max_nodes=3)
        for draft in (DraftTree.root_only(5), tree):
            batch = batch_trees([draft], pad_token_id=0, device=torch.device("cpu"))
            verify_tree(model, batch, timer.cache, torch.ones(1, timer.context))
            timer.cache.crop(-len(draft))
            contiguous_kv(timer.cache)
        assert len(graphs) == timed
    finally:
        del model.forward


def test_forward_cost_is_measured_the_way_verification_runs():
    model = tiny_model("llama")
    mode = linear_context(model, True)
    mode.clear()
    measure_forward_cost(model, sizes=(1, 2), context=8, repeats=1, packed_linear=False)
    assert len(mode) == 0
    mode.plan = None  # pack every row count, whatever this machine's measured plan says
    measure_forward_cost(model, sizes=(1, 2), context=8, repeats=1, packed_linear=True)
    assert len(mode) > 0


class RecordingPlan:
    """A kernel plan that packs every row count and records the row counts it was asked about."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, rows: int, shape) -> bool:
        self.rows.append(rows)
        return True


def test_kernel_plan_decides_per_weight_shape_by_the_smallest_measured_size_at_or_above_the_rows():
    rows = RowPlan((1, 2, 8, 64), (False, True, True, False))
    assert [rows(n) for n in (1, 2, 3, 8, 9, 64, 500)] == [False, True, True, True, False, False, False]
    assert rows.description == "BLAS for 1 rows, packed for 2-8 rows, BLAS for 9+ rows"
    with pytest.raises(ValueError, match="increasing sizes"):
        RowPlan((4, 2), (True, False))
    plan = KernelPlan({(96, 40): rows, (8, 16): RowPlan((1,), (False,))})
    assert plan(2, torch.Size([96, 40])) and not plan(2, (8, 16)) and not plan(2, (5, 5))  # unmeasured: BLAS
    assert plan.packs_anything and not KernelPlan({(8, 16): RowPlan((1,), (False,))}).packs_anything
    assert plan.description == "96x40: BLAS for 1 rows, packed for 2-8 rows, BLAS for 9+ rows; 8x16: BLAS for 1+ rows"


def test_a_traced_row_plan_decides_as_the_eager_one_and_guards_only_where_its_decision_changes(monkeypatch):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    g = torch.Generator().manual_seed(0)
    plans = [
        RowPlan(KERNEL_PLAN_SIZES, tuple(bool(b) for b in torch.randint(0, 2, (7,), generator=g))) for _ in range(40)
    ]
    eager = [[plan(n) for n in range(1, 200)] for plan in plans]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert [[plan(n) for n in range(1, 200)] for plan in plans] == eager
    monkeypatch.undo()

    # BLAS for one row, packed for 2-16, BLAS beyond: a traced forward of 2 to 16 rows is ONE graph
    plan = RowPlan(KERNEL_PLAN_SIZES, (False, True, True, True, True, False, False))
    counter = CompileCounter()

    @torch.compile(backend=counter, dynamic=True)
    def decide(x):
        return x * 2 if plan(x.shape[0]) else x * 3

    torch._dynamo.reset()
    for rows in (2, 3, 4, 8, 9, 16):
        assert torch.equal(decide(torch.ones(rows)), torch.full((rows,), 2.0))
    assert counter.frame_count == 1
    assert torch.equal(decide(torch.ones(17)), torch.full((17,), 3.0)) and counter.frame_count == 2


def test_blas_rows_of_a_plan_pack_nothing():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    mode = PackedLinear(layer, plan=KernelPlan({(8, 16): RowPlan((1, 4), (False, True))}))
    with mode, torch.no_grad():
        layer(torch.randn(1, 16))
        assert len(mode) == 0 and mode.packed_bytes == 0  # one row: BLAS, no copy made
        got = layer(torch.randn(2, 3, 16))  # 6 rows: packed
    assert got.shape == (2, 3, 8)
    assert len(mode) == 1 and mode.packed_bytes == 16 * 8 * 4


def test_kernel_plan_is_measured_once_per_machine_and_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_BPD_CACHE", str(tmp_path))
    model = tiny_model("llama")
    plan, path, measured = cached_kernel_plan(model)
    assert measured and path.is_file() and path.is_relative_to(tmp_path)
    assert set(plan.shapes) == {tuple(layer.weight.shape) for layer in PackedLinear(model).layers}
    assert all(rows.sizes == KERNEL_PLAN_SIZES for rows in plan.shapes.values())
    again, path2, measured2 = cached_kernel_plan(tiny_model("llama", seed=5))  # same architecture
    assert (again, path2, measured2) == (plan, path, False)
    remeasured, _, measured3 = cached_kernel_plan(model, refresh=True)  # timings: may differ from the first
    assert measured3 is True
    assert fast_cpu(model).plan == remeasured  # fast_cpu and the drafters use the cached plan
    # weights of another precision are measured apart
    assert cached_kernel_plan(model, weights="q8_0")[1:] != (path, False)
    # a record measured without extra weights is measured again with them
    extra = torch.randn(24, model.config.hidden_size)
    with_extra, path4, measured4 = cached_kernel_plan(model, extra_weights=(extra,))
    assert measured4 and path4 == path and (24, model.config.hidden_size) in with_extra.shapes
    assert cached_kernel_plan(model, extra_weights=(extra,))[2] is False
    # an extra weight no kernel packs (bfloat16) is measured once, not at every call
    unpacked = torch.randn(40, model.config.hidden_size).bfloat16()
    assert cached_kernel_plan(model, extra_weights=(unpacked,))[2] is True
    assert cached_kernel_plan(model, extra_weights=(unpacked,))[2] is False


@pytest.mark.parametrize(
    "kwargs",
    [
        {"do_sample": False},
        {"do_sample": True, "temperature": 0.8, "top_p": 0.9},
        {"do_sample": False, "num_beams": 3},
        {"do_sample": False, "prompt_lookup_num_tokens": 4},
    ],
    ids=["greedy", "sampling", "beams", "prompt_lookup"],
)
def test_fast_cpu_serves_every_forward_of_any_generate_with_plain_outputs(kwargs):
    model = tiny_model("llama", eos_token_id=None)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 8, 9]])
    torch.manual_seed(0)
    ref = model.generate(ids, max_new_tokens=24, **kwargs)
    fast = fast_cpu(model)
    fast.plan, recorded = RecordingPlan(), fast.plan  # pack every row count, and see which ran
    try:
        torch.manual_seed(0)
        with fast:
            got = model.generate(ids, max_new_tokens=24, **kwargs)
        rows = fast.plan.rows
    finally:
        fast.plan = recorded
    assert got.tolist() == ref.tolist()
    assert 8 * kwargs.get("num_beams", 1) in rows  # the prefill (one row per beam)
    assert 1 in rows or kwargs.get("num_beams")  # one-token steps
    assert len(fast) > 0
    assert all("forward" not in layer.__dict__ for layer in fast.layers)  # nothing left patched


def test_fast_cpu_serves_batches_and_assisted_generation():
    model, small = tiny_model("llama", eos_token_id=None), tiny_model("llama", seed=1, eos_token_id=None)
    ids = torch.tensor([[1, 5, 6, 7], [5, 6, 7, 8]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=1)
    with fast_cpu(model):
        got = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=1)
    assert got.tolist() == ref.tolist()
    one = ids[1:]
    ref = model.generate(one, do_sample=False, max_new_tokens=16, assistant_model=small)
    with fast_cpu(model), fast_cpu(small):
        got = model.generate(one, do_sample=False, max_new_tokens=16, assistant_model=small)
    assert got.tolist() == ref.tolist()


def test_fast_cpu_refuses_what_it_cannot_serve_before_packing():
    with pytest.raises(ValueError, match="float32 models on a CPU; this one is torch.bfloat16"):
        fast_cpu(tiny_model("llama").to(torch.bfloat16))
    with pytest.raises(TypeError, match="fast_cpu takes a torch model"):
        fast_cpu("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_hf_bpd_runs_its_prefill_and_one_token_trees_on_the_shared_packed_weights():
    from test_decoding import copying_heads

    model = tiny_model("llama", eos_token_id=None)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=20)
    drafter = hf_bpd.BlockDrafter(copying_heads(model, 2), top_k=2, max_tree_tokens=1, packed_linear=True)
    shared = fast_cpu(model)
    shared.plan = RecordingPlan()
    got = model.generate(ids, do_sample=False, max_new_tokens=20, custom_generate=hf_bpd.generate, assistant=drafter)
    assert got.tolist() == ref.tolist()
    assert binding_of(drafter).linear_context is shared  # one packed copy per model
    assert 5 in shared.plan.rows and 1 in shared.plan.rows  # the prefill and the one-token trees
