"""The streamed linear kernel (`hf_bpd.cpu.streamed_linear`): F.linear's numbers for any row count and shape,
one FMA chain per output (a row's result does not depend on the rows beside it), and its place in the
kernel plan (`packed_linear`): a shape the plan gives to it keeps its panels as its one packed copy, a plan
measured without it never names it, and the cached plan keeps each shape's format."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from hf_bpd.cpu import streamed_linear
from hf_bpd.cpu.packed_linear import (
    KERNEL_PLAN_SIZES,
    ONEDNN,
    STREAMED,
    KernelPlan,
    PackedLinear,
    RowPlan,
    cached_kernel_plan,
    measure_kernel_plan,
    packed_linear_available,
)

# the machines this project runs on (CI included) are x86-64 with AVX2: there the kernel must build
pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="the kernel needs AVX2 and FMA"
)


def test_the_kernel_builds_here():
    assert streamed_linear.available(), streamed_linear.unavailable_reason()
    assert streamed_linear.unavailable_reason() is None


def test_the_build_uses_the_cpus_widest_vectors_and_torchs_threads():
    # built without OpenMP, ATen's inline parallel_for runs every call on one thread (gcc, the compiler here
    # and in CI, has OpenMP); AVX-512 where torch's own kernels use it, with panels one register wide
    info = streamed_linear.build_info()
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert info == {"panel": 16 if avx512 else 8, "instructions": "avx512" if avx512 else "avx2", "openmp": True}


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads Linux's /proc")
def test_the_kernel_shares_torchs_openmp_runtime():
    # two OpenMP runtimes in one process would keep two thread pools spinning on the same cores
    assert streamed_linear.available()
    runtimes = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "gomp" in line}
    assert len({Path(r).name for r in runtimes}) == 1 and len(runtimes) == 1, runtimes


def test_another_build_of_the_kernel_gives_the_same_bits():
    # one FMA chain per output along the input, whatever the panel width or threads: the one-thread AVX2
    # build (what a compiler without OpenMP gets, and what an AVX2 CPU runs) equals the build used here;
    # built as a compiler that refuses the first flags falls back to the next
    refused = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fno-such-flag-hf-bpd"]
    other = streamed_linear.build(streamed_linear.SOURCE, [refused, ["-O3", "-mavx2", "-mfma"]])
    assert dict(other.build_info()) == {"panel": 8, "instructions": "avx2", "openmp": False}
    g = torch.Generator().manual_seed(3)
    for out_features, in_features, rows in [(100, 64, 1), (100, 64, 7), (37, 21, 16), (576, 192, 13), (24, 8, 40)]:
        weight, x = torch.randn(out_features, in_features, generator=g), torch.randn(rows, in_features, generator=g)
        here = streamed_linear.linear(x, streamed_linear.pack(weight), out_features)
        assert torch.equal(other.linear(x, other.pack(weight), out_features), here), (out_features, rows)
        # the int8 copy too: one FMA chain over the weights multiplied out as they are loaded
        weight = q8_0_weight(out_features, in_features, g)
        here = streamed_linear.linear(x, streamed_linear.pack(weight), out_features)
        there = other.linear_int8(x, other.pack_int8_exact(weight), out_features)
        assert torch.equal(there, here), (out_features, rows)
        # the int8 copy with a scale per 16
        weight = q6_k_weight(out_features, in_features, g)
        here = streamed_linear.linear(x, streamed_linear.pack(weight), out_features)
        there = other.linear_int8(x, other.pack_int8_exact(weight, 16), out_features)
        assert torch.equal(there, here), (out_features, rows)
        if in_features % 32 == 0:  # and the 4-bit copy
            weight = q4_1_weight(out_features, in_features, g)
            here = streamed_linear.linear(x, streamed_linear.pack(weight), out_features)
            there = other.linear_4bit(x, other.pack_4bit_exact(weight), out_features)
            assert torch.equal(there, here), (out_features, rows)


def q8_0_weight(out_features: int, in_features: int, g: torch.Generator) -> torch.Tensor:
    """A weight as transformers dequantises GGUF's Q8_0: int8 values times a float16 scale per 32 of a row,
    each block's largest value +-127 (as Q8_0's quantiser makes it)."""
    blocks = -(-in_features // 32)
    values = torch.randint(-127, 128, (out_features, blocks * 32), generator=g).float()
    values[:, ::32] = 127.0
    scales = (torch.rand(out_features, blocks, 1, generator=g) * 0.05 + 1e-3).half().float()
    return (values.view(out_features, blocks, 32) * scales).flatten(1)[:, :in_features].contiguous()


def gguf_weight(kind: str, out_features: int, in_features: int, g: torch.Generator) -> torch.Tensor:
    """A weight as GGUF's `kind` (Q4_1, Q5_0) quantises it and transformers (gguf's numpy code) dequantises it."""
    from gguf import GGMLQuantizationType, quants

    weight = torch.randn(out_features, in_features, generator=g) * torch.rand(out_features, 1, generator=g)
    stored = quants.quantize(weight.numpy(), GGMLQuantizationType[kind])
    return torch.from_numpy(quants.dequantize(stored, GGMLQuantizationType[kind]).copy()).reshape(weight.shape)


def q4_1_weight(out_features: int, in_features: int, g: torch.Generator) -> torch.Tensor:
    return gguf_weight("Q4_1", out_features, in_features, g)


def q5_0_weight(out_features: int, in_features: int, g: torch.Generator) -> torch.Tensor:
    return gguf_weight("Q5_0", out_features, in_features, g)


def q4_k_weight(out_features: int, in_features: int, g: torch.Generator) -> torch.Tensor:
    """A weight as transformers (gguf's numpy code) dequantises GGUF's Q4_K blocks (256 weights: a float16
    scale and minimum, 6-bit scales and minimums per 32, 4-bit values), some blocks without the values 0 or 15
    (as Q4_K's quantiser leaves a few)."""
    from gguf import GGMLQuantizationType, quants

    superblocks = out_features * -(-in_features // 256)
    scale, low = (torch.rand(superblocks, 2, generator=g) * 2e-3 + 1e-4).half().view(torch.uint8).split(2, 1)
    sc, m = torch.randint(0, 64, (2, superblocks, 8), generator=g, dtype=torch.uint8)
    scales = torch.cat(
        [sc[:, :4] | (sc[:, 4:] >> 4 << 6), m[:, :4] | (m[:, 4:] >> 4 << 6), sc[:, 4:] & 15 | m[:, 4:] << 4], 1
    )
    q = torch.randint(0, 16, (superblocks, 8, 32), generator=g, dtype=torch.uint8)
    q[::7, 3] = q[::7, 3].clamp(2, 13)  # blocks with neither 0 nor 15
    q = q.view(superblocks, 4, 2, 32)
    blocks = torch.cat([scale, low, scales, (q[:, :, 0] | q[:, :, 1] << 4).flatten(1)], 1)
    weight = quants.dequantize(blocks.numpy(), GGMLQuantizationType.Q4_K).reshape(out_features, -1)
    return torch.from_numpy(weight[:, :in_features].copy())


def q6_k_weight(out_features: int, in_features: int, g: torch.Generator) -> torch.Tensor:
    """A weight as transformers (gguf's numpy code) dequantises GGUF's Q6_K blocks (256 weights: a float16
    scale, int8 scales per 16, 6-bit values less 32), the scales of either sign, some 0."""
    from gguf import GGMLQuantizationType, quants

    superblocks = out_features * -(-in_features // 256)
    bits = torch.randint(0, 256, (superblocks, 128 + 64), generator=g, dtype=torch.uint8)
    scales = torch.randint(-128, 128, (superblocks, 16), generator=g, dtype=torch.int8)
    scales[::5, 2] = 0
    d = (torch.rand(superblocks, 1, generator=g) * 1e-3 + 1e-5).half().view(torch.uint8)
    blocks = torch.cat([bits, scales.view(torch.uint8), d], 1)
    weight = quants.dequantize(blocks.numpy(), GGMLQuantizationType.Q6_K).reshape(out_features, -1)
    return torch.from_numpy(weight[:, :in_features].copy())


# the compact copies: (the weight's GGUF type, a weight dequantised from it, the copy's dtype, how many times
# fewer bytes than float32 panels at least, where a row holds whole blocks of 32)
COMPACT = {
    "q8_0": (q8_0_weight, torch.int8, 3),
    "q5_0": (q5_0_weight, torch.int8, 3),  # its values q - 16 in 8 bits: most of Gemma-3-270M's linears
    "q4_1": (q4_1_weight, torch.uint8, 5),
    "q4_k": (q4_k_weight, torch.uint8, 5),  # 27 of Gemma-3-270M's linears
    "q6_k": (q6_k_weight, torch.int8, 3),  # int8 with a scale per 16: 9 of Gemma-3-270M's linears
}


@pytest.mark.parametrize(
    "kind,out_features,in_features",
    [(kind, n, k) for kind in COMPACT for n, k in [(8, 32), (21, 64), (192, 576), (300, 96)]]
    + [("q8_0", 21, 37), ("q8_0", 8, 16), ("q8_0", 1, 3)],  # int8 copies of partial blocks
)
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 13, 16, 40])
def test_a_weight_dequantised_from_gguf_is_packed_compact_and_gives_the_same_bits(
    kind, rows, out_features, in_features
):
    # Q8_0: both packaged models' LM heads; Q5_0 and Q4_K: most of Gemma-3-270M's linears; Q4_1: every linear
    # of the packaged SmolLM2. Fewer bytes read, and every output the float32 panels' FMA chain, bit for bit
    make, dtype, fewer = COMPACT[kind]
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight, x = make(out_features, in_features, g), torch.randn(rows, in_features, generator=g)
    packed = streamed_linear.pack(weight)
    floats = streamed_linear.pack(weight, compact=False)
    assert packed.dtype == dtype and floats.dtype == torch.float32
    if in_features >= 32:  # the blocks' scales (and offsets) are small beside the weights
        assert packed.numel() < floats.numel() * floats.element_size() / fewer  # bytes
    out = streamed_linear.linear(x, packed, out_features)
    assert torch.equal(out, streamed_linear.linear(x, floats, out_features))
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-4, atol=1e-4)


def test_a_q4_1_block_with_equal_weights_or_one_off_by_an_ulp():
    g = torch.Generator().manual_seed(9)
    weight = q4_1_weight(40, 64, g)
    weight[3, :32] = 0.25  # a block of equal weights: scale 0
    assert streamed_linear.pack(weight).dtype == torch.uint8
    x = torch.randn(3, 64, generator=g)
    floats = streamed_linear.linear(x, streamed_linear.pack(weight, compact=False), 40)
    assert torch.equal(streamed_linear.linear(x, streamed_linear.pack(weight), 40), floats)
    weight[7, 40] = torch.nextafter(weight[7, 40], torch.tensor(10.0))
    assert streamed_linear.pack(weight).dtype == torch.float32


def test_a_weight_no_int8_copy_holds_stays_float32():
    g = torch.Generator().manual_seed(7)
    assert streamed_linear.pack(torch.randn(64, 64, generator=g)).dtype == torch.float32
    weight = q8_0_weight(64, 64, g)
    weight[40, 33] = torch.nextafter(weight[40, 33], torch.tensor(1.0))  # one weight off by one ulp
    assert streamed_linear.pack(weight).dtype == torch.float32


def test_a_weight_rounded_to_q8_0_is_packed_as_int8_with_the_rounded_weights_bits():
    g = torch.Generator().manual_seed(8)
    weight = torch.randn(40, 96, generator=g)
    weight[3, 32:64] = 0.0  # a block of zeros keeps its zeros
    rounded = streamed_linear.round_q8_0(weight)
    assert torch.equal(streamed_linear.round_q8_0(rounded), rounded)  # rounding twice changes nothing
    assert (rounded - weight).abs().max() <= weight.abs().max() / 254 * 1.0001 and not rounded[3, 32:64].any()
    packed = streamed_linear.pack(rounded)
    assert packed.dtype == torch.int8
    x = torch.randn(3, 96, generator=g)
    floats = streamed_linear.pack(rounded, compact=False)
    assert torch.equal(streamed_linear.linear(x, packed, 40), streamed_linear.linear(x, floats, 40))
    with pytest.raises(ValueError, match="multiple of 32"):
        streamed_linear.round_q8_0(torch.randn(4, 40))


def test_compact_copies_are_used_only_where_they_give_the_float32_panels_bits(monkeypatch):
    module = streamed_linear._module()
    assert streamed_linear.compact_disagreement(module) is None  # this build, here

    class OneUlpOff:  # the real build but a 4-bit kernel that is one ulp off (as a miscompiled one might be)
        def __getattr__(self, name):
            return getattr(module, name)

        def linear_4bit(self, x, packed, out_features):
            out = module.linear_4bit(x, packed, out_features)
            out[3, 5] = torch.nextafter(out[3, 5], torch.tensor(1e9))
            return out

    class HoldsNothing(OneUlpOff):
        def pack_int8_exact(self, weight, block=32):
            return torch.empty(0, dtype=torch.int8)

    assert "4-bit copy's results differ" in streamed_linear.compact_disagreement(OneUlpOff())
    assert "int8 copy does not hold" in streamed_linear.compact_disagreement(HoldsNothing())
    # refused: every weight is packed as float32 panels, which give the same bits
    g = torch.Generator().manual_seed(4)
    weight, x = q8_0_weight(48, 64, g), torch.randn(5, 64, generator=g)
    expected = streamed_linear.linear(x, streamed_linear.pack(weight), 48)
    monkeypatch.setattr(streamed_linear, "_compact_refused", lambda: "a reason")
    assert streamed_linear.pack(weight).dtype == torch.float32
    assert torch.equal(streamed_linear.linear(x, streamed_linear.pack(weight), 48), expected)


def test_the_custom_op_serves_the_int8_copy():
    g = torch.Generator().manual_seed(8)
    weight, x = q8_0_weight(48, 64, g), torch.randn(5, 64, generator=g)
    packed = streamed_linear.pack(weight)
    assert torch.equal(torch.ops.hf_bpd.streamed_linear(x, packed, 48), streamed_linear.linear(x, packed, 48))
    torch.library.opcheck(torch.ops.hf_bpd.streamed_linear, (x, packed, 48))
    packed = streamed_linear.pack(q4_1_weight(48, 64, g))
    assert packed.dtype == torch.uint8
    assert torch.equal(torch.ops.hf_bpd.streamed_linear(x, packed, 48), streamed_linear.linear(x, packed, 48))
    torch.library.opcheck(torch.ops.hf_bpd.streamed_linear, (x, packed, 48))


@pytest.mark.parametrize("out_features,in_features", [(8, 16), (21, 37), (192, 576), (1, 3)])
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 12, 13, 16, 40])
def test_matches_f_linear_for_any_row_count_and_shape(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    packed = streamed_linear.pack(weight)
    panel = streamed_linear.build_info()["panel"]
    assert packed.shape == ((out_features + panel - 1) // panel, in_features, panel)
    got = streamed_linear.linear(x, packed, out_features)
    assert got.shape == (rows, out_features)
    # another summation order than BLAS's: equal up to float32 rounding of sums of up to 576 unit-scale terms
    close = {"rtol": 1e-5, "atol": 1e-4}
    torch.testing.assert_close(got, F.linear(x, weight), **close)
    torch.testing.assert_close(
        streamed_linear.linear(x, packed, out_features, bias), F.linear(x, weight, bias), **close
    )


def test_keeps_leading_dimensions_and_takes_a_one_dimensional_input():
    g = torch.Generator().manual_seed(1)
    weight, x = torch.randn(24, 16, generator=g), torch.randn(2, 3, 16, generator=g)
    packed = streamed_linear.pack(weight)
    torch.testing.assert_close(streamed_linear.linear(x, packed, 24), F.linear(x, weight))
    torch.testing.assert_close(streamed_linear.linear(x[0, 0], packed, 24), F.linear(x[0, 0], weight))


@pytest.mark.parametrize("out_features", [64, 100])  # whole panels; the last panel of 4 columns
def test_a_row_gives_the_same_bits_alone_or_among_others(out_features):
    # fewer rows take several panels per pass (and a weight's last panels fewer), more than a group's rows
    # split into groups: every count from 1 to 33
    g = torch.Generator().manual_seed(2)
    weight, x = torch.randn(out_features, 100, generator=g), torch.randn(33, 100, generator=g)
    packed = streamed_linear.pack(weight)
    alone = torch.cat([streamed_linear.linear(x[i : i + 1], packed, out_features) for i in range(33)])
    for rows in range(2, 34):
        assert torch.equal(streamed_linear.linear(x[:rows], packed, out_features), alone[:rows]), rows


def test_refuses_a_packed_weight_that_does_not_fit():
    packed = streamed_linear.pack(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="does not match"):
        streamed_linear.linear(torch.randn(2, 9), packed, 16)
    with pytest.raises(RuntimeError, match="does not match"):
        streamed_linear.linear(torch.randn(2, 8), packed, 24)


@pytest.mark.skipif(not packed_linear_available(), reason="this torch build has no oneDNN")
def test_a_plan_that_streams_a_shape_keeps_panels_as_its_one_packed_copy():
    torch.manual_seed(0)
    layer, other = torch.nn.Linear(16, 24), torch.nn.Linear(24, 8)
    rows = RowPlan((1, 4), (True, True))
    plan = KernelPlan({(24, 16): rows, (8, 24): rows}, {(24, 16): STREAMED})
    assert plan.format((24, 16)) == STREAMED and plan.format((8, 24)) == ONEDNN
    assert plan.description == "24x16: streamed for 1+ rows; 8x24: packed for 1+ rows"
    model = torch.nn.Sequential(layer, other)
    mode = PackedLinear(model, plan=plan)
    x = torch.randn(3, 16)
    with mode, torch.no_grad():
        got = model(x)
    torch.testing.assert_close(got, other(layer(x)))
    panels = mode.packed(layer.weight)
    panel = streamed_linear.build_info()["panel"]
    assert panels.shape == (-(-24 // panel), 16, panel)  # the kernel's layout, not oneDNN's
    assert mode.packed_bytes == panels.numel() * 4 + mode.packed(other.weight).numel() * 4
    with pytest.raises(ValueError, match="unknown packed formats"):
        KernelPlan({(24, 16): rows}, {(24, 16): "int8"})


@pytest.mark.skipif(not packed_linear_available(), reason="this torch build has no oneDNN")
def test_merged_plans_keep_each_shapes_format():
    a = KernelPlan({(4, 4): RowPlan((1,), (True,))}, {(4, 4): STREAMED})
    b = KernelPlan({(8, 4): RowPlan((1,), (True,))})
    merged = a.merged(b)
    assert set(merged.shapes) == {(4, 4), (8, 4)}
    assert merged.format((4, 4)) == STREAMED and merged.format((8, 4)) == ONEDNN


@pytest.mark.skipif(not packed_linear_available(), reason="this torch build has no oneDNN")
def test_a_plan_measured_without_the_kernel_never_names_it(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(streamed_linear, "available", lambda: False)
    plan = measure_kernel_plan(model, sizes=(1, 8), repeats=1)
    assert plan.formats == {} and set(plan.shapes) == {tuple(m.weight.shape) for m in PackedLinear(model).layers}


@pytest.mark.skipif(not packed_linear_available(), reason="this torch build has no oneDNN")
def test_the_cached_plan_keeps_each_shapes_format(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_BPD_CACHE", str(tmp_path))
    model = tiny_model("llama")
    sizes = KERNEL_PLAN_SIZES
    measured = {
        s: RowPlan(sizes, (True,) * (len(sizes) - 1) + (False,))
        for s in {tuple(m.weight.shape) for m in PackedLinear(model).layers}
    }
    streamed_shape = next(iter(measured))
    fake = KernelPlan(measured, {streamed_shape: STREAMED})
    monkeypatch.setattr(
        "hf_bpd.cpu.packed_linear.measure_kernel_plan", lambda model, extra_weights=(), progress=False: fake
    )
    plan, _, was_measured = cached_kernel_plan(model)
    assert was_measured and plan == fake
    again, _, was_measured = cached_kernel_plan(model)
    assert not was_measured and again == fake and again.format(streamed_shape) == STREAMED


@pytest.mark.skipif(not packed_linear_available(), reason="this torch build has no oneDNN")
def test_a_new_plan_that_streams_a_shape_repacks_its_weights_on_next_use():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 24)
    rows = RowPlan((1,), (True,))
    mode = PackedLinear(layer, plan=KernelPlan({(24, 16): rows}))
    x = torch.randn(2, 16)
    with mode, torch.no_grad():
        layer(x)
    assert mode.packed(layer.weight).dim() == 2  # oneDNN's blocked copy
    mode.plan = KernelPlan({(24, 16): rows}, {(24, 16): STREAMED})
    with mode, torch.no_grad():
        got = layer(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias))
    panel = streamed_linear.build_info()["panel"]
    assert mode.packed(layer.weight).shape == (-(-24 // panel), 16, panel) and len(mode) == 1


# ---------------------------------------------------------------------------------------- compiled graphs
def test_the_kernel_is_a_custom_op_that_passes_torch_s_checks():
    g = torch.Generator().manual_seed(3)
    weight, x = torch.randn(21, 37, generator=g), torch.randn(5, 37, generator=g)
    packed = streamed_linear.pack(weight)
    torch.library.opcheck(torch.ops.hf_bpd.streamed_linear, (x, packed, 21))  # schema, fake tensor, aot dispatch
    assert torch.equal(torch.ops.hf_bpd.streamed_linear(x, packed, 21), streamed_linear.linear(x, packed, 21))


def mixed_stack():
    """Linears of three shapes: one on the streamed kernel's panels, one on oneDNN's, one on BLAS; and the
    packed-linear block serving them."""
    torch.manual_seed(0)
    stack = torch.nn.Sequential(
        torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 40, bias=False), torch.nn.Linear(40, 8)
    )
    every = RowPlan(KERNEL_PLAN_SIZES, (True,) * len(KERNEL_PLAN_SIZES))
    plan = KernelPlan({(24, 16): every, (40, 24): every}, {(24, 16): STREAMED})  # (8, 40): BLAS
    return stack, PackedLinear(stack, plan=plan)


def compiled_stack_output(backend: str, rows: int = 3):
    """(eager output, compiled output, the ops in dynamo's graph) of `mixed_stack` inside its block,
    compiled fullgraph (a graph break raises) with `backend`."""
    stack, block = mixed_stack()
    x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(rows))
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.registry.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    with torch.no_grad(), block:
        eager = stack(x)
        assert block.pack_planned() == 2  # the packed copies a trace reads: its own forward cannot pack
        compiled = torch.compile(stack, backend=recording, fullgraph=True, dynamic=False)(x)
    torch._dynamo.reset()
    (graph,) = graphs
    ops = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    return eager, compiled, ops


@pytest.mark.skipif(not packed_linear_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("rows", [1, 3])
def test_a_packed_linear_block_compiles_to_one_graph_with_its_kernels_as_custom_ops(rows):
    eager, compiled, ops = compiled_stack_output("aot_eager", rows)
    assert torch.equal(compiled, eager)  # the same kernels in the graph as eagerly
    assert sum("hf_bpd.streamed_linear" in op for op in ops) == 1
    assert sum("hf_bpd.onednn_linear" in op for op in ops) == 1
    assert sum("linear" in op for op in ops) == 3  # and BLAS's F.linear for the third


@pytest.mark.slow
@pytest.mark.skipif(not packed_linear_available(), reason="this torch build has no oneDNN")
def test_inductor_compiles_a_packed_linear_block_with_its_kernels():
    eager, compiled, ops = compiled_stack_output("inductor")
    torch.testing.assert_close(compiled, eager)  # inductor fuses the bias and activation: rounding may move
    assert sum("hf_bpd." in op for op in ops) == 2
