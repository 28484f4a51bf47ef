"""A float32 linear kernel for the few rows of decoding (one token, a draft tree, a small batch) on x86-64
CPUs with AVX2 and FMA, or AVX-512: one candidate of the measured kernel plan (`packed_linear.KernelPlan`),
beside BLAS and oneDNN's packed weights.

Why: at 1 to ~16 rows a linear layer should cost about one read of its weight from memory, since the
arithmetic is small. BLAS and oneDNN run these shapes well below that on some CPUs: the weight is streamed
and the arithmetic done one after the other rather than overlapped. This kernel packs each weight once
into panels of one vector register's output columns (8 on AVX2, 16 on AVX-512), laid out in the order they
are read, computes each panel for a group of rows at once (one accumulator per row; for fewer rows several
panels at once, so that enough independent FMA chains keep the CPU's FMA units busy while the weight
streams in) and asks for the panels' next lines before it needs them (`csrc/streamed_linear.cpp`). Every
output is one FMA chain along the input in order, so a row gives the same numbers alone or among others,
and on either instruction set (the plan may still send different row counts to different kernels).
Whether it wins is measured per weight shape and row count on the machine (`measure_kernel_plan`); the
numbers are in RESULTS.md. A weight that a compact copy holds exactly is packed as that copy (`pack`):
int8 values with one scale per 32 weights of a row (a weight dequantised from GGUF's Q8_0, as both
packaged models' LM heads are, or Q5_0, as most of Gemma-3-270M's linears are), a quarter of the bytes, or
4-bit values with a scale and an offset per 32 (from GGUF's Q4_1, as SmolLM2-135M's linears are, or Q4_K),
under a sixth. Each value is multiplied out as it is loaded, exactly, so the outputs are the float32 panels'
bit for bit.

The C++ source is built on first use by torch's extension loader (a compiler and ninja are needed; the
build is cached by torch, in `TORCH_EXTENSIONS_DIR` or `~/.cache/torch_extensions`): for AVX-512 where
torch runs its own kernels with it, else for AVX2, and with OpenMP so that a call uses torch's intra-op
threads (ATen's `parallel_for` is inline OpenMP: built without it, the kernel runs on one thread). A
compiler without OpenMP gets the one-thread build. Where the CPU lacks AVX2/FMA, the build fails or its
results disagree with `F.linear`, `available()` is False and the plan keeps to BLAS and oneDNN;
`unavailable_reason()` says why. `build_info()` says how the build came out.

Compiled graphs: the kernel is also the `torch.library` custom op `hf_bpd::streamed_linear` (`OP`,
registered at import with a fake implementation giving the output's shape), which `linear` calls inside a
`torch.compile` trace, so a forward on packed linears compiles to one graph (`fullgraph=True`) with the
kernel in it (inductor calls it as an extern kernel); eagerly `linear` calls the extension directly.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import log

SOURCE = Path(__file__).with_name("csrc") / "streamed_linear.cpp"
OP = "hf_bpd::streamed_linear"  # the kernel as a torch.library custom op (`streamed_linear_op`)


@functools.cache
def _extension():
    """The built extension module, or the reason it cannot be had (a string)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"needs an x86-64 CPU, this is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"needs AVX2 and FMA, this CPU offers {capability}"
    if not SOURCE.is_file():
        return f"its source {SOURCE} is missing from the installation"
    try:
        with log.logged("building the streamed linear kernel (once per machine, cached by torch)"):
            module = build(SOURCE)
    except Exception as err:  # any build failure (compiler, ninja, headers): the plan keeps the other kernels
        return f"its C++ build failed ({type(err).__name__}: {str(err).strip().splitlines()[-1][:200]})"
    g = torch.Generator().manual_seed(0)  # never the global stream: a user's seeded sampling must not move
    weight, x = torch.randn(21, 37, generator=g), torch.randn(13, 37, generator=g)
    if not torch.allclose(module.linear(x, module.pack(weight), 21), F.linear(x, weight), rtol=1e-4, atol=1e-4):
        return "its results disagree with F.linear on this machine"
    return module


def build_flags() -> list[list[str]]:
    """The compiler flags to try, best first: AVX-512 where torch's own CPU kernels use it (else AVX2), with
    OpenMP, then the same without OpenMP (a compiler that lacks it still gets a one-thread kernel)."""
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    isa = ["-mavx512f", "-mavx2", "-mfma"] if avx512 else ["-mavx2", "-mfma"]
    return [["-O3", *isa, "-fopenmp"], ["-O3", *isa]]


def build(source: Path, flag_choices: list[list[str]] | None = None):
    """The kernel's C++ `source` built with torch's extension loader, with the first of `flag_choices`
    (default `build_flags()`) that builds (raises where none does). The digest of the source and flags is in
    the module's name: an edited kernel or another build is built again, never an old build loaded."""
    from torch.utils.cpp_extension import load

    error = None
    for flags in flag_choices or build_flags():
        name = f"hf_bpd_streamed_linear_{_digest(source, flags)}"
        ldflags = ["-fopenmp"] if "-fopenmp" in flags else []
        try:
            return load(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=ldflags, verbose=False)
        except Exception as err:  # the next flags, if any
            error = err
    raise error


def _digest(source: Path, flags: list[str] | None = None) -> str:
    return hashlib.sha1(source.read_bytes() + " ".join(flags or []).encode()).hexdigest()[:10]


def build_info() -> dict:
    """How the kernel was built here: its panel width (output columns per packed panel: 8 on AVX2, 16 on
    AVX-512), instruction set ("avx2" or "avx512") and whether OpenMP spreads a call over torch's threads."""
    return dict(_module().build_info())


@functools.cache
def version() -> str | None:
    """A digest of the kernel's source and of the flags it would be built with first (None where the source
    is missing): what measurements made with the kernel (kernel plans, forward-cost curves) are keyed by, so
    an edited kernel or another build is measured again."""
    return _digest(SOURCE, build_flags()[0]) if SOURCE.is_file() else None


def available() -> bool:
    """The kernel is built (now, or earlier and cached) and agrees with `F.linear` here."""
    return not isinstance(_extension(), str)


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True)."""
    ext = _extension()
    return ext if isinstance(ext, str) else None


def compact_disagreement(module) -> str | None:
    """Why `module`'s compact copies cannot be used here (None where they can): built to fit, a weight must
    pack as each copy and give the float32 panels' bits. A miscompiled or mis-dispatched copy is then never
    used; `pack` keeps to float32 panels."""
    g = torch.Generator().manual_seed(0)  # never the global stream
    scales = torch.rand(21, 2, 1, generator=g).half().float() + 0.5
    offsets = -torch.rand(21, 2, 1, generator=g).half().float()
    sub_scales = torch.rand(21, 4, 1, generator=g).half().float() * torch.randint(1, 128, (21, 4, 1), generator=g)
    int8 = torch.randint(-127, 128, (21, 2, 32), generator=g).double()
    six_bit = torch.randint(-32, 32, (21, 4, 16), generator=g).double()
    nibbles = torch.randint(0, 16, (21, 2, 32), generator=g).double()
    # each block's extremes as the GGUF quantisers leave them: ±127 in an int8 block, -32 in a Q6_K sub-block,
    # 0 and 15 in a 4-bit one
    int8[..., 0], six_bit[..., 0] = 127 * torch.sign(torch.randn(21, 2, generator=g)), -32
    nibbles[..., 0], nibbles[..., 1] = 0, 15
    x = torch.randn(13, 64, generator=g)
    for kind, weight, pack_exact, linear in (
        ("int8", int8 * scales, module.pack_int8_exact, module.linear_int8),
        ("int8 per 16", six_bit * sub_scales, _per_16(module), module.linear_int8),
        ("4-bit", nibbles * scales + offsets, module.pack_4bit_exact, module.linear_4bit),  # exact, then rounded once
    ):
        weight = weight.float().flatten(1)
        packed = pack_exact(weight)
        if not packed.numel():
            return f"its {kind} copy does not hold a weight built to fit it"
        if not torch.equal(linear(x, packed, 21), module.linear(x, module.pack(weight), 21)):
            return f"its {kind} copy's results differ from the float32 panels' on this machine"
    return None


@functools.cache
def _compact_refused() -> str | None:
    reason = compact_disagreement(_module())
    if reason is not None:
        log.logger.warning("the streamed kernel's compact weight copies are off: %s; float32 panels are used", reason)
    return reason


def pack(weight: torch.Tensor, compact: bool = True) -> torch.Tensor:
    """`weight` [N, K] (float32, CPU) in the kernel's layout: where `compact` and a compact copy holds it
    exactly, that copy, giving the same bits: int8 with one scale per 32 weights of a row (a weight
    dequantised from GGUF's Q8_0 or Q5_0), int8 [ceil(N / panel), panel bytes]; else 4-bit values with a
    scale and an offset per 32 (from Q4_1 or Q4_K), uint8 [ceil(N / panel), panel bytes]; else int8 with one
    scale per 16 (from Q6_K), int8 [ceil(N / panel), panel bytes] (the bytes tell it apart). Else float32 panels
    [ceil(N / panel), K, panel] (`build_info()`'s panel width), the same bytes as the weight padded to
    whole panels. Each copy's search stops at the first block that no copy holds."""
    module, weight = _module(), weight.detach()
    if compact and _compact_refused() is None:
        for pack_exact in (module.pack_int8_exact, module.pack_4bit_exact, _per_16(module)):
            packed = pack_exact(weight)
            if packed.numel():
                return packed
    return module.pack(weight)


def round_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] (K a multiple of 32) rounded to GGUF Q8_0's values: per block of 32 weights of a row,
    the nearest multiple of the block's largest magnitude / 127. `pack` holds the result exactly as its
    int8 copy, a quarter of the float32 bytes."""
    if weight.dim() != 2 or weight.shape[1] % 32:
        raise ValueError(f"Q8_0 rounds [N, K] weights with K a multiple of 32, got {tuple(weight.shape)}")
    blocks = weight.detach().float().reshape(-1, 32)
    step = blocks.abs().amax(dim=1, keepdim=True) / 127
    step = torch.where(step == 0, torch.ones_like(step), step)
    return (torch.round(blocks / step) * step).reshape(weight.shape).to(weight.dtype)


def _per_16(module):
    return functools.partial(module.pack_int8_exact, block=16)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for `packed = pack(weight)`: x [..., K] float32 on the CPU. Inside a
    `torch.compile` trace it is the custom op `hf_bpd::streamed_linear` (`OP`), which stays in the graph;
    run eagerly it calls the extension directly (the same kernel, without the op's dispatch)."""
    rows = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():
        out = torch.ops.hf_bpd.streamed_linear(rows, packed, out_features)
        if bias is not None:
            out = out + bias
    else:
        out = _kernel(packed)(rows, packed, out_features)
        if bias is not None:
            out += bias
    return out.reshape(*x.shape[:-1], out_features)


@torch.library.custom_op(OP, mutates_args=())
def streamed_linear_op(rows: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The kernel as a `torch.library` custom op, `torch.ops.hf_bpd.streamed_linear(rows [M, K], packed,
    out_features) -> [M, out_features]`: what `torch.compile` keeps in its graph (dynamo cannot trace into
    the pybind extension; an op it can), inductor calling it as an extern kernel. Registered at import;
    the extension is built on the first call, not here."""
    return _kernel(packed)(rows, packed, out_features)


@streamed_linear_op.register_fake
def _(rows: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    torch._check(rows.dim() == 2, lambda: "hf_bpd::streamed_linear takes 2D rows [M, K]")
    torch._check(
        (packed.dim() == 3 and packed.shape[1] == rows.shape[1] and packed.shape[2] in (8, 16))
        or (packed.dim() == 2 and packed.dtype in (torch.int8, torch.uint8)),
        lambda: "hf_bpd::streamed_linear: the packed weight does not match the rows",
    )
    return rows.new_empty(rows.shape[0], out_features)  # contiguous, as the kernel's output


def _kernel(packed: torch.Tensor):
    """The extension's function for `packed`'s layout: float32 panels, the int8 or the 4-bit copy (`pack`)."""
    module = _module()
    return {torch.int8: module.linear_int8, torch.uint8: module.linear_4bit}.get(packed.dtype, module.linear)


def _module():
    ext = _extension()
    if isinstance(ext, str):
        raise RuntimeError(f"hf_bpd's streamed linear kernel is unavailable: {ext}")
    return ext
