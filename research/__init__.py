"""One-off experiments (ablations, tuning, oracles) behind results in RESULTS.md and docs/history.md;
not part of the installed package."""

# The held-out dev half of Spec-Bench, beside the project's checkout: the prompts these experiments ran on (and
# their default). `hf-bpd bench` itself defaults to the demo prompts bundled with the package.
SPEC_BENCH_DEV = "../shared/data/spec_bench_dev.jsonl"
