"""`hf-bpd calibrate`: the one-time work of a packaged model's first `generate` call, done ahead of time.

On a CPU that is building hf_bpd's streamed linear kernel, measuring which kernel runs each weight shape
fastest (the kernel plan, `fast_cpu`'s too) and, for the shipped drafter's "auto" trees, the forward-cost
curve they are sized by. Each is kept in hf_bpd's cache per machine and model, so later processes read it.
For another model, `hf_bpd.prepare(drafter, model)` does the same in Python.
"""

from __future__ import annotations

import argparse
import time

from ..log import show_info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-bpd calibrate", description=__doc__)
    parser.add_argument("--model", default=None, help='the packaged model: SmolLM2 (default) or "gemma-3-270m"')
    parser.add_argument("--again", action="store_true", help="measure the forward-cost curve again")
    args = parser.parse_args(argv)

    from ..decode.binding import prepare
    from ..io.packaged import load_packaged_drafter, load_packaged_model

    show_info()
    model, _ = load_packaged_model(args.model)
    drafter = load_packaged_drafter(model=args.model)
    t0 = time.perf_counter()
    setup = prepare(drafter, model, remeasure=args.again).setup
    seconds = time.perf_counter() - t0
    if setup:
        how = "measured" if setup["measured"] else "read from the cache"
        print(f"forward-cost curve {how}: {setup['forward_cost_file']}")
    print(f"ready in {seconds:.1f} s: later generate calls with this drafter start without measuring")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
