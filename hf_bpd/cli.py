"""`hf-bpd` command line: demo, calibrate, distill, train-heads, export, ..."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "demo": "hf_bpd.tools.demo",
        "calibrate": "hf_bpd.tools.calibrate",
        "bench": "hf_bpd.tools.bench",
        "analyze": "hf_bpd.tools.analyze",
        "replay": "hf_bpd.tools.replay",
        "cost-model": "hf_bpd.tools.cost_model",
        "export": "hf_bpd.io.export",
        "distill": "hf_bpd.training.distill",
        "train-heads": "hf_bpd.training.train_heads",
        "train-eagle": "hf_bpd.training.train_eagle",
        "train-ngram": "hf_bpd.training.train_ngram",
        "train-rescorer": "hf_bpd.training.train_rescorer",
    }
    if not argv or argv[0] not in commands:
        print("usage: hf-bpd {" + ",".join(commands) + "} [options]   (hf-bpd COMMAND --help for each)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
