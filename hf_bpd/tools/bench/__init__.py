"""`hf-bpd bench` (`python -m hf_bpd.tools.bench`) and the pieces research scripts reuse, by module:

- `data`: the prompts (`DEFAULT_DATA`: the bundled demo prompts; Spec-Bench-format files) and row selection;
- `methods`: the decoding methods compared and the timed, interleaved loop (`run_bench`);
- `batch`: batched decoding against plain batched greedy (`--batch-size`);
- `journal`: the row-by-row journal a run resumes from and split runs merge from;
- `report`: summaries (speedups over the fastest plain method), tables, plot, environment, result files;
- `cli`: the command line.

Every public name of these modules can also be imported from here (`from hf_bpd.tools.bench import run_bench`).
"""

from . import batch, cli, data, journal, methods, report

_MODULES = (data, methods, batch, journal, report, cli)


def __getattr__(name: str):
    # the package re-exports its modules' public names without listing them a second time
    if not name.startswith("_"):
        for module in _MODULES:
            if hasattr(module, name):
                return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
