"""What compiling the forward costs a user on this CPU, the first time and with inductor's on-disk cache warm:

    python -m research.compile_cache --output benchmarks/speed/compile_cache_amd.json

Why: the same drafter on a `torch.compile`d forward (inductor freezing, dynamic shapes) is the fastest way
to run it on a CPU, and its cost is compilation: minutes per process in the bench's warm-up. PyTorch keeps
compiled kernels in an on-disk cache (`TORCHINDUCTOR_CACHE_DIR`; the FX graph cache admits frozen graphs
in open-source builds, AOTAutograd's cache does not), so a second process on the same machine may pay far
less. This runs the bench's compiled warm-up (`hf-bpd bench ... --methods greedy_compiled hf_bpd_compiled`,
one prompt, a few tokens: every graph a decode meets is compiled before its timed turn) in `--processes`
fresh processes in a row sharing one empty cache folder, and reports each process's compilation seconds
(`compile_seconds` of its result file) and wall time. Run with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hf_bpd.tools.bench import environment

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_dev.jsonl"


def run_process(cache_dir: Path, output: Path, data: Path, methods: list[str], max_new_tokens: int) -> dict:
    """One bench process on one prompt with `methods`, inductor's cache in `cache_dir`: its compile
    seconds by method and its wall time."""
    command = [
        sys.executable,
        "-m",
        "hf_bpd.cli",
        "bench",
        str(data),
        "--limit",
        "1",
        "--max-new-tokens",
        str(max_new_tokens),
        "--methods",
        *methods,
        "--output",
        str(output),
        "--no-progress",
    ]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    t0 = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    result = json.loads(output.read_text())
    return {"compile_seconds": result["compile_seconds"], "wall_seconds": wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--methods", nargs="+", default=["greedy_compiled", "hf_bpd_compiled"])
    parser.add_argument("--processes", type=int, default=2, help="processes in a row on one cache (first cold)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    if not args.data.is_file():
        parser.error(f"--data {args.data} is not a file")
    env = environment("cpu", "float32")  # taken before the runs: the result file it goes in is not written yet
    with tempfile.TemporaryDirectory(prefix="inductor_cache_") as tmp:
        cache_dir = Path(tmp) / "cache"
        cache_dir.mkdir()
        runs = []
        for i in range(args.processes):
            run = run_process(cache_dir, Path(tmp) / f"run{i}.json", args.data, args.methods, args.max_new_tokens)
            run["cache"] = "cold (empty folder)" if i == 0 else "warm (the processes before wrote it)"
            runs.append(run)
            print(f"process {i}: {run}", flush=True)
    report = {"environment": env, "args": {k: str(v) for k, v in vars(args).items()}, "processes": runs}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
