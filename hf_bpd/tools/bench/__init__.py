"""`hf-bpd bench` (`python -m hf_bpd.tools.bench`) and the pieces research scripts reuse, by module:

- `data`: the prompts (`DEFAULT_DATA`: the bundled demo prompts; Spec-Bench-format files) and row selection;
- `methods`: the decoding methods compared and the timed, interleaved loop (`run_bench`);
- `batch`: batched decoding against plain batched greedy (`--batch-size`);
- `journal`: the row-by-row journal a run resumes from and split runs merge from;
- `report`: summaries (speedups over the fastest plain method), tables, plot, environment, result files;
- `cli`: the command line.

Every name below is public and re-exported here (`from hf_bpd.tools.bench import run_bench`).
"""

from .batch import left_padded_batch, row_tokens, run_batch_bench
from .cli import main, rescorer_specs
from .data import BUNDLED_PROMPTS, DEFAULT_DATA, bundled_prompts, check_data_file, read_prompts, select_rows
from .journal import (
    RESUME_KEYS,
    append_records,
    load_journal,
    merge_journals,
    merged_environment,
    read_journal,
    state_digest,
)
from .methods import (
    COMPILE_SECONDS,
    GREEDY,
    STATIC,
    Method,
    answer_nll,
    assisted_method,
    bpd_method,
    captured_capacity,
    captured_method,
    compiled_method,
    fast_cpu_method,
    greedy_bpd_method,
    greedy_method,
    learned,
    load_drafter,
    prompt_lookup_method,
    reference_name,
    run_bench,
    static_cache_method,
    static_compiled_method,
    window_warm_up,
)
from .report import (
    PLAIN_METHODS,
    MethodTotals,
    baseline_line,
    drafted_step_share,
    environment,
    fastest_plain,
    markdown_table,
    plot,
    round_speedups,
    summarize,
    turn_key,
    write_report,
)

__all__ = [
    "BUNDLED_PROMPTS",
    "COMPILE_SECONDS",
    "DEFAULT_DATA",
    "GREEDY",
    "PLAIN_METHODS",
    "RESUME_KEYS",
    "STATIC",
    "Method",
    "MethodTotals",
    "answer_nll",
    "append_records",
    "assisted_method",
    "baseline_line",
    "bpd_method",
    "captured_capacity",
    "captured_method",
    "bundled_prompts",
    "check_data_file",
    "compiled_method",
    "drafted_step_share",
    "environment",
    "fast_cpu_method",
    "fastest_plain",
    "greedy_bpd_method",
    "greedy_method",
    "learned",
    "left_padded_batch",
    "load_drafter",
    "load_journal",
    "main",
    "markdown_table",
    "merge_journals",
    "merged_environment",
    "plot",
    "prompt_lookup_method",
    "read_journal",
    "read_prompts",
    "reference_name",
    "rescorer_specs",
    "round_speedups",
    "row_tokens",
    "run_batch_bench",
    "run_bench",
    "select_rows",
    "state_digest",
    "static_cache_method",
    "static_compiled_method",
    "summarize",
    "turn_key",
    "window_warm_up",
    "write_report",
]
