"""What a tree forward costs in a captured CUDA graph on a static cache: the design question after the
`gpu_plain_generate_*` claims (plain static-cache `generate` with CUDA graphs beats hf_bpd's eager and
compiled DynamicCache trees on a GPU).

For each tree size n, hf_bpd's verification of n tokens at positions P..P+n-1 of a `StaticCache` (the
prompt's P tokens cached; `verify.verify_tree`, which masks the cache's columns past the tree), through
`torch.compile(mode="reduce-overhead")` (CUDA graphs; one graph per n, as a bucketed tree would have).
(The claim `gpu_graph_trees_h200` ran this script's first version, 4b37ed9, which built the same mask and
positions itself and did not ask for hidden states.)
n = 1 is plain static-cache decoding's own step. Each size also checks its logits against the eager
DynamicCache forward of `verify.verify_tree` on the same tokens. One JSON line per size, as it finishes.

    python -m research.gpu.graph_trees --shape 135m --device cuda --sizes 1 4 16 64 --output rows.jsonl
"""

# ruff: noqa: B023  (each size's `forward` is called only within its own iteration)
from __future__ import annotations

import argparse
import json
import time
from statistics import median_high

import torch
from transformers import DynamicCache, StaticCache

from hf_bpd.decode.verify import verify_tree
from hf_bpd.drafting.tree import DraftTree, batch_trees
from hf_bpd.tools.cost_model import random_llama


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    model = random_llama(args.shape, args.device, args.dtype)
    device = torch.device(args.device)
    vocab, p = model.config.vocab_size, args.context
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, p), generator=g).to(device)
    length = p + max(args.sizes)
    static = StaticCache(config=model.config, max_cache_len=length)
    model(input_ids=prompt, past_key_values=static, cache_position=torch.arange(p, device=device), use_cache=True)
    dynamic = DynamicCache(config=model.config)
    model(input_ids=prompt, past_key_values=dynamic, use_cache=True)
    compiled = torch.compile(model.forward, mode="reduce-overhead")
    for n in args.sizes:
        ids = torch.randint(0, vocab, (1, n), generator=g).to(device)
        chain = DraftTree.from_paths(int(ids[0, 0]), [ids[0].tolist()[1:]], max_nodes=n)
        tree = batch_trees([chain], pad_token_id=0, device=device)
        assert tree.input_ids.shape[1] == n
        past_mask = torch.ones(1, p, device=device)

        def forward():
            # hf_bpd's own static-cache verification (`verify.verify_tree`: the mask over all the cache's key
            # columns), through the compiled call, then the cache put back with the cache API's crop
            logits = verify_tree(model, tree, static, past_mask, forward=compiled, capacity=length).logits
            static.crop(-n)
            return logits

        t0 = time.perf_counter()
        for _ in range(3):  # compiles and captures this size's graph
            logits = forward().clone()
        sync(device)
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            sync(device)
            t0 = time.perf_counter()
            forward()
            sync(device)
            times.append(time.perf_counter() - t0)
        eager = verify_tree(model, tree, dynamic, torch.ones(1, p, device=device)).logits
        dynamic.crop(-n)
        row = {
            "shape": args.shape,
            "dtype": args.dtype,
            "tree_tokens": n,
            "graph_forward_s": median_high(times),
            "compile_s": compile_s,
            "max_logit_difference_vs_eager_dynamic": float((logits.float() - eager.float()).abs().max()),
            "same_argmax": bool((logits.argmax(-1) == eager.argmax(-1)).all()),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
        }
        print(json.dumps(row), flush=True)
        if args.output:
            with open(args.output, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
