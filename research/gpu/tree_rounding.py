"""Where a tree forward's logits part from the one-token steps' (why bfloat16 trees are not token-identical to
bfloat16 plain greedy on a GPU: claim `gpu_captured_step_135m_bf16_h200`), in one run that fits a device call.

Verification is exact only if every row of an n-token forward gives the bits a one-token forward gives for
the same position. For each `--shapes` pair (a random-weight Llama of `hf_bpd.tools.cost_model`), a random
prompt of `--context` tokens is prefilled into a `StaticCache`, then a chain of n random tokens (the simplest
tree, a path) is decoded twice from the same cache contents: as n one-token forwards (what plain
static-cache greedy runs) and as one n-token forward (what a tree's verification runs), both through the
model's own forward with `cache_position` and `position_ids`. One JSON line per (shape, dtype, setting, n):

- `rows_equal`, `argmax_equal`, `max_abs_diff`: the n rows of logits, bit for bit, by argmax, and at most;
- `first_divergence`: for each row that differs, the first module (forward hooks on every submodule, in the
  order their calls finish, so an op before the layer that holds it) whose output at that position differs,
  counted by its name with layer indices as `*`: which kind of op breaks the bits first (`... o_proj input`:
  attention's core, which is no module, before the output projection);
- `ops`: the op alone, on random inputs of the model's shapes: `F.linear` of n rows against each row alone
  (per distinct weight shape) and the final norm, rows equal.

Settings (`--settings`, each a separate line): `default`; `repeat` (the one-token steps against themselves run
again: run-to-run determinism, which must hold before batch variance means anything);
`no_reduced_bf16` (`torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False`); `cublaslt`
(`torch.backends.cuda.preferred_blas_library("cublaslt")`); `rowwise` (every `nn.Linear` computes its rows one
at a time: whether the linears alone break the bits); `math_sdpa` (scaled-dot-product attention on its math
backend). The two CUDA settings are skipped on a CPU.

    python -m research.gpu.tree_rounding --device cuda --output $OUT/rounding.jsonl      # on the GPU
    python -m research.gpu.tree_rounding --dry-run                                       # the path here
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
from collections import Counter

import torch
import torch.nn.functional as F

from hf_bpd.tools.cost_model import random_llama
from research.gpu.captured_step import run_environment, write_row

SETTINGS = ("default", "repeat", "no_reduced_bf16", "cublaslt", "rowwise", "math_sdpa")
CUDA_ONLY = ("no_reduced_bf16", "cublaslt")


def _rowwise_linear(self, x):
    return torch.cat([F.linear(x[..., i : i + 1, :], self.weight, self.bias) for i in range(x.shape[-2])], dim=-2)


@contextlib.contextmanager
def setting(name: str):
    """The numerical setting `name` (module docstring), undone on exit."""
    if name == "no_reduced_bf16":
        before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before
    elif name == "cublaslt":
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            yield
        finally:
            torch.backends.cuda.preferred_blas_library(before)
    elif name == "rowwise":
        before = torch.nn.Linear.forward
        torch.nn.Linear.forward = _rowwise_linear
        try:
            yield
        finally:
            torch.nn.Linear.forward = before
    elif name == "math_sdpa":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            yield
    else:
        yield


def layer_pattern(name: str) -> str:
    """A module's name with its layer index as `*`: `model.layers.3.mlp.up_proj` -> `model.layers.*.mlp.up_proj`."""
    return re.sub(r"\.\d+\.", ".*.", name)


class Recorder:
    """Forward hooks on every submodule of `model`: each call's first output tensor, in the order calls finish,
    and each linear's input as it starts (`<name> input`: so that what a module computes without being one,
    such as attention's core before `o_proj`, is told apart from the linear after it)."""

    def __init__(self, model) -> None:
        self.calls: list[tuple[str, torch.Tensor]] = []
        self.handles = []
        for name, module in model.named_modules():
            if not name:
                continue
            if isinstance(module, torch.nn.Linear):
                self.handles.append(module.register_forward_pre_hook(self._hook(f"{name} input", inputs=True)))
            self.handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name, inputs=False):
        def record(out):
            out = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(out, torch.Tensor) and out.dim() >= 2:
                self.calls.append((name, out.detach().clone()))

        if inputs:
            return lambda module, args: record(args)
        return lambda module, args, output: record(output)

    def take(self) -> list[tuple[str, torch.Tensor]]:
        calls, self.calls = self.calls, []
        return calls

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def first_divergence(chain_calls, step_calls) -> list[str | None]:
    """Per chain position i, the first module (in call order) whose output at position i differs between the
    n-token forward (`chain_calls`: (name, [1, n, ...])) and the i-th one-token forward (`step_calls[i]`: (name,
    [1, 1, ...])); None where every module's output agrees. Modules are matched by name and by their k-th call
    within the forward."""
    out = []
    for i, calls in enumerate(step_calls):
        seen: Counter = Counter()
        step_by = {}
        for name, t in calls:
            step_by[(name, seen[name])] = t
            seen[name] += 1
        seen = Counter()
        found = None
        for name, t in chain_calls:
            key = (name, seen[name])
            seen[name] += 1
            s = step_by.get(key)
            if s is None or t.dim() < 2 or t.shape[1] <= i or s.shape[1] != 1:
                continue
            if not torch.equal(t[:, i : i + 1], s):
                found = name
                break
        out.append(found)
    return out


class Runner:
    def __init__(self, args) -> None:
        self.args, self.device, self.t0 = args, torch.device(args.device), time.time()
        self.env = {"part": "rounding", **run_environment(self.device, args.tiny)}

    def emit(self, row: dict) -> None:
        write_row(row, self.env, self.t0, self.args.output)

    def forward(self, model, cache, ids: torch.Tensor, start: int):
        positions = torch.arange(start, start + ids.shape[1], device=self.device)
        out = model(
            input_ids=ids, past_key_values=cache, cache_position=positions, position_ids=positions[None], use_cache=True
        )
        return out.logits[0].float()

    @torch.no_grad()
    def chain(self, model, prompt, tokens, recorder=None):
        """(one-token steps' logits [n, V], each step's calls, the n-token forward's logits [n, V], its calls),
        each from the prompt's cache alone."""
        from transformers import StaticCache

        p, n = prompt.shape[1], tokens.shape[1]
        length = p + n + 8
        cache = StaticCache(config=model.config, max_cache_len=length)
        self.forward(model, cache, prompt, 0)
        snapshot = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        steps, step_calls = [], []
        if recorder:
            recorder.take()
        for i in range(n):
            steps.append(self.forward(model, cache, tokens[:, i : i + 1], p + i)[-1])
            step_calls.append(recorder.take() if recorder else [])
        for layer, (k, v) in zip(cache.layers, snapshot):  # back to the prompt's cache, in place
            layer.keys.copy_(k)
            layer.values.copy_(v)
        whole = self.forward(model, cache, tokens, p)
        chain_calls = recorder.take() if recorder else []
        return torch.stack(steps), step_calls, whole, chain_calls

    @torch.no_grad()
    def ops(self, model, n: int, dtype) -> dict:
        """Each distinct linear weight shape's `F.linear` and the final norm on random rows: n rows at once
        against each row alone, rows equal."""
        g = torch.Generator(device="cpu").manual_seed(1)
        result = {}
        shapes = {}
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                shapes.setdefault(tuple(module.weight.shape), (layer_pattern(name), module))
        for (out_f, in_f), (name, module) in shapes.items():
            x = torch.randn(1, n, in_f, generator=g).to(self.device, dtype)
            whole = F.linear(x, module.weight, module.bias)
            rows = torch.cat([F.linear(x[:, i : i + 1], module.weight, module.bias) for i in range(n)], dim=1)
            result[f"linear {in_f}->{out_f} ({name})"] = int((whole == rows).all(dim=-1).sum())
        norm = model.model.norm
        x = torch.randn(1, n, model.config.hidden_size, generator=g).to(self.device, dtype)
        rows = torch.cat([norm(x[:, i : i + 1]) for i in range(n)], dim=1)
        result["final norm"] = int((norm(x) == rows).all(dim=-1).sum())
        return result

    def shape(self, shape: str, dtype_name: str) -> None:
        args, dtype = self.args, getattr(torch, dtype_name)
        model = random_llama(shape, args.device, dtype_name)
        g = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        prompt = torch.randint(3, vocab, (1, args.context), generator=g).to(self.device)
        for n in args.chain:
            tokens = torch.randint(3, vocab, (1, n), generator=g).to(self.device)
            for name in args.settings:
                base = {"shape": shape, "dtype": dtype_name, "setting": name, "chain": n, "context": args.context}
                if name in CUDA_ONLY and self.device.type != "cuda":
                    self.emit({**base, "skipped": "a CUDA setting"})
                    continue
                recorder = Recorder(model)
                try:
                    with setting(name):
                        steps, step_calls, whole, chain_calls = self.chain(model, prompt, tokens, recorder)
                        if name == "repeat":  # the steps again, as the "tree"
                            whole, _, _, _ = self.chain(model, prompt, tokens)
                            chain_calls = []
                        ops = self.ops(model, n, dtype) if name != "repeat" else {}
                finally:
                    recorder.remove()
                first = first_divergence(chain_calls, step_calls) if chain_calls else []
                self.emit(
                    {
                        **base,
                        "rows": n,
                        "rows_equal": int((steps == whole).all(dim=-1).sum()),
                        "argmax_equal": int((steps.argmax(-1) == whole.argmax(-1)).sum()),
                        "max_abs_diff": float((steps - whole).abs().max()),
                        "first_divergence": dict(Counter(layer_pattern(f) for f in first if f is not None)),
                        "ops": ops,
                    }
                )
        if self.device.type == "cuda":
            model.to("meta")
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU: the script's path")
    parser.add_argument("--shapes", type=lambda s: tuple(s.split(":")), nargs="+", default=[("135m", "bfloat16")])
    parser.add_argument("--chain", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    args.tiny = args.dry_run
    if args.dry_run:
        args.device, args.context = "cpu", 12
        args.shapes = [("tiny", dtype) for _, dtype in args.shapes]
        args.chain = sorted({min(n, 4) for n in args.chain})
    runner = Runner(args)
    for shape, dtype in args.shapes:
        runner.shape(shape, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
