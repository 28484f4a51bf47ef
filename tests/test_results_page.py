"""RESULTS.md and README.md's results block are what the committed result files say (benchmarks/results.py)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_results_pages_match_the_result_files():
    command = [sys.executable, "benchmarks/results.py", "--check"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_claim_names_its_provenance_and_its_file_exists():
    claims = json.loads((ROOT / "benchmarks" / "claims.json").read_text())
    # one claim per model feeds the README's tables
    readme_models = [c.get("model", "SmolLM2") for c in claims if c.get("readme")]
    assert readme_models and len(readme_models) == len(set(readme_models)), readme_models
    for claim in claims:
        for key in ("title", "what", "settings", "command", "commit", "machine", "file", "kind"):
            assert claim.get(key), (claim.get("id"), key)
        assert (ROOT / claim["file"]).is_file(), claim["file"]
        runnable = ("hf-bpd ", "python -m tests.", "python -m research.")
        assert claim["command"].startswith(runnable)
        # the command writes the file, or the folder it lies in (`hf-bpd analyze --output FOLDER`)
        assert claim["file"] in claim["command"] or f"--output {Path(claim['file']).parent} " in claim["command"] + " "


def test_readme_numbers_come_only_from_the_generated_block():
    """Outside the generated block the README quotes no τ or speedup: such a number would not be checked."""
    import re

    text = (ROOT / "README.md").read_text()
    begin, end = "<!-- results:", "<!-- /results -->"
    outside = text.split(begin)[0] + text.split(end)[1]
    assert not re.search(r"τ\s*(=|of)?\s*\d\.\d", outside)
    assert not re.search(r"\d\.\d+\s*×", outside)


def test_superseded_claims_name_a_current_claim_and_leave_results_md():
    """RESULTS.md holds the current claims, one per question; a claim another run replaced names that claim in
    `superseded_by` and is shown on docs/results-archive.md instead."""
    claims = json.loads((ROOT / "benchmarks" / "claims.json").read_text())
    by_id = {c["id"]: c for c in claims}
    assert len(by_id) == len(claims)
    results = (ROOT / "RESULTS.md").read_text()
    archive = (ROOT / "docs" / "results-archive.md").read_text()
    for claim in claims:
        heading = f"## {claim['title']}\n"
        new = claim.get("superseded_by")
        if new is None:
            assert heading in results and heading not in archive, claim["id"]
            continue
        assert new in by_id and new != claim["id"] and not by_id[new].get("superseded_by"), (claim["id"], new)
        assert heading in archive and heading not in results, claim["id"]
    assert not any(c.get("superseded_by") for c in claims if c.get("readme")), "the README quotes current claims"


def test_the_levers_table_links_every_lever_claim_to_its_section():
    """Issue #59's ablation table on RESULTS.md: one row per current claim with a `lever`, each linking to the
    anchor of that claim's own heading on the same page (a superseded claim leaves the table)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from results import heading_anchor

    claims = json.loads((ROOT / "benchmarks" / "claims.json").read_text())
    results = (ROOT / "RESULTS.md").read_text()
    table = results.split("## Better drafts (issue #59): what each lever gave\n")[1].split("\n## ")[0]
    levers = [c for c in claims if c.get("lever")]
    assert levers
    for claim in levers:
        link = f"[{claim['id']}](#{heading_anchor(claim['title'])})"
        assert (link in table) == (not claim.get("superseded_by")), claim["id"]
        if not claim.get("superseded_by"):
            assert f"## {claim['title']}\n" in results
