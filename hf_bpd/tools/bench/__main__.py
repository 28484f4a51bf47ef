"""`python -m hf_bpd.tools.bench`: the same command as `hf-bpd bench`."""

from .cli import main

raise SystemExit(main())
