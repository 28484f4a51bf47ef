"""One-off experiments (ablations, tuning, oracles) behind results in RESULTS.md and docs/history.md;
not part of the installed package."""
