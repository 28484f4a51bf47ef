"""A GPU smoke check before timing anything there: tiny random Llama models on CUDA (float32 and bfloat16),
random draft heads, hf_bpd's greedy trees against plain greedy `generate` (on the default and on a static
cache) and seeded sampling against plain sampling (same seed). Prints one JSON line per dtype; exits
non-zero on a float32 mismatch or an error (bfloat16 mismatches are reported, not failed: a tree forward
rounds differently from a one-token step)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import hf_bpd
from hf_bpd import BlockDrafter

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import random_heads, tiny_model  # noqa: E402  (the tests' tiny model: sharpened, far from ties)

DEVICE = os.environ.get("SMOKE_DEVICE", "cuda")


def main() -> int:
    failures = 0
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model("llama").to(DEVICE, dtype)
        drafter = BlockDrafter(random_heads(model), top_k=4, max_tree_tokens=12)
        g = torch.Generator().manual_seed(1)
        cases = same = 0
        for i in range(8):
            ids = torch.randint(3, 97, (1, 6 + i), generator=g).to(DEVICE)
            plain = model.generate(ids, do_sample=False, max_new_tokens=32)
            tree = model.generate(
                ids, do_sample=False, max_new_tokens=32, custom_generate=hf_bpd.generate, assistant=drafter
            )
            cases, same = cases + 1, same + int(torch.equal(plain, tree))
            if i < 2:  # a static cache: on a GPU, the compiled call and graph-sized trees (`static_cache.py`)
                static = {"cache_implementation": "static", "do_sample": False, "max_new_tokens": 32}
                plain_c = model.generate(ids, **static)
                tree_c = model.generate(ids, **static, custom_generate=hf_bpd.generate, assistant=drafter)
                cases, same = cases + 1, same + int(torch.equal(plain_c, tree_c))
            if i < 4:
                torch.manual_seed(100 + i)
                plain_s = model.generate(ids, do_sample=True, temperature=0.8, max_new_tokens=24)
                torch.manual_seed(100 + i)
                tree_s = model.generate(
                    ids,
                    do_sample=True,
                    temperature=0.8,
                    max_new_tokens=24,
                    custom_generate=hf_bpd.generate,
                    assistant=drafter,
                )
                cases, same = cases + 1, same + int(torch.equal(plain_s, tree_s))
        row = {"dtype": str(dtype), "cases": cases, "equal": same, "tau": drafter.stats.block_efficiency}
        print(json.dumps(row), flush=True)
        failures += cases - same if dtype == torch.float32 else 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
