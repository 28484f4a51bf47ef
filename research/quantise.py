"""Blockwise re-quantisation and quantisation-sized noise, GGUF-style: the other precisions a base model's
weights come in, for measuring what recognises a model in any of them (`research.lm_head_sketch_precision`)
and what its heads lose on one (`research.perturbed_base_tau`).

Every function takes a weight `[..., n]` whose last dimension is a multiple of `BLOCK` and works on
consecutive blocks of `BLOCK` weights along it, as llama.cpp's Q8_0, Q4_0 and Q4_1 do.
"""

from __future__ import annotations

import torch

from hf_bpd.cpu.streamed_linear import round_q8_0

BLOCK = 32


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"the last dimension ({weight.shape[-1]}) is not a multiple of {BLOCK}")
    return weight.detach().float().reshape(-1, BLOCK)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    """Q8_0: symmetric 8-bit, one scale per block (max |w| / 127), dequantised (the product's rounding of
    compact drafting weights, `streamed_linear.round_q8_0`, over any leading dimensions)."""
    _blocks(weight)
    return round_q8_0(weight.detach().float().reshape(-1, weight.shape[-1])).reshape(weight.shape)


def q4_0(weight: torch.Tensor) -> torch.Tensor:
    """Q4_0: symmetric 4-bit, the block's largest-magnitude weight at level -8, dequantised."""
    b = _blocks(weight)
    extreme = b.gather(1, b.abs().argmax(dim=1, keepdim=True))
    d = _nonzero(extreme / -8)
    return ((torch.clamp(torch.round(b / d) + 8, 0, 15) - 8) * d).reshape(weight.shape)


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """Q4_1: 4-bit with a minimum and a scale per block ((max - min) / 15), dequantised."""
    b = _blocks(weight)
    low = b.amin(dim=1, keepdim=True)
    d = _nonzero(q4_1_step(weight).reshape(-1, BLOCK)[:, :1])
    return (torch.clamp(torch.round((b - low) / d), 0, 15) * d + low).reshape(weight.shape)


def q4_1_step(weight: torch.Tensor) -> torch.Tensor:
    """Each weight's Q4_1 step: (max - min) / 15 of its block."""
    b = _blocks(weight)
    step = (b.amax(dim=1, keepdim=True) - b.amin(dim=1, keepdim=True)) / 15
    return step.expand_as(b).reshape(weight.shape)


def q8_0_step(weight: torch.Tensor) -> torch.Tensor:
    """Each weight's Q8_0 step: max |w| / 127 of its block."""
    b = _blocks(weight)
    return (b.abs().amax(dim=1, keepdim=True) / 127).expand_as(b).reshape(weight.shape)


def step_noise(weight: torch.Tensor, steps: float, generator: torch.Generator, step=q4_1_step) -> torch.Tensor:
    """`weight` plus uniform noise in [-steps, +steps] x each weight's `step`: at 0.5 Q4_1 steps, as far as
    Q4_1 rounding moves a weight at most, which is how far the un-quantised weights can lie from the
    dequantised ones."""
    noise = (torch.rand(weight.shape, generator=generator, dtype=torch.float32) * 2 - 1) * steps
    return (weight.detach().float() + noise * step(weight)).to(weight.dtype)


@torch.no_grad()
def perturb_weight_matrices(model, steps: float, seed: int = 0, step=q4_1_step) -> int:
    """Move every weight matrix of `model` (every 2-D parameter; a tied embedding once) in place by
    `step_noise` of `steps` steps, matrix i with seed `seed + i`. Returns how many matrices moved."""
    moved = 0
    for i, (_, param) in enumerate(p for p in model.named_parameters() if p[1].dim() == 2):
        param.copy_(step_noise(param, steps, torch.Generator().manual_seed(seed + i), step))
        moved += 1
    return moved
