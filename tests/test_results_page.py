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


def test_a_claim_naming_another_processor_maker_than_its_result_file_is_an_error(tmp_path):
    """Machines of one kind here differ by processor (an AMD EPYC one day, an Intel Xeon another), and which
    plain method is fastest differs with them: a claim must name the maker its result file ran on."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("results_page", ROOT / "benchmarks" / "results.py")
    results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results)
    assert results.processor_maker("cpu (Intel(R) Xeon(R) Processor, 2 cores, 2 threads)") == "Intel"
    assert results.processor_maker("cpu (AMD EPYC, 2 cores, 2 threads)") == "AMD"
    assert results.processor_maker("cuda") == results.processor_maker("cpu (x86_64, 2 threads)") == ""
    env = {"commit": "abc1234", "device": "cpu (Intel(R) Xeon(R) Processor, 2 cores, 2 threads)"}
    (tmp_path / "run.json").write_text(json.dumps({"environment": env}))
    claim = {"id": "c", "commit": "abc1234", "file": str(tmp_path / "run.json")}  # absolute: ROOT / it is it
    amd = {**claim, "machine": "2-core AMD EPYC CPU (family 25, KVM), 24 GB"}
    assert results.provenance_errors([amd]) == [
        f"c: its machine is {amd['machine']!r}; its result file ran on {env['device']!r}"
    ]
    assert results.provenance_errors([{**claim, "machine": "2-core Intel Xeon CPU (KVM), 24 GB"}]) == []


def test_every_current_claim_has_a_topic_and_the_contents_link_it_there():
    """RESULTS.md opens with its contents: each topic's claims, linked by id to their sections, which stand
    together in the topics' order (benchmarks/results.py TOPICS)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from results import TOPICS, heading_anchor, topic_errors

    claims = json.loads((ROOT / "benchmarks" / "claims.json").read_text())
    assert topic_errors(claims) == []
    assert topic_errors([{"id": "x", "topic": "elsewhere"}]) == [f"x: topic 'elsewhere' is none of {sorted(TOPICS)}"]
    results = (ROOT / "RESULTS.md").read_text()
    contents = results.split("## Contents\n")[1].split("\n## ")[0]
    current = [c for c in claims if not c.get("superseded_by")]
    for claim in current:
        line = next(line for line in contents.splitlines() if line.startswith(f"- **{TOPICS[claim['topic']]}**"))
        assert f"[{claim['id']}](#{heading_anchor(claim['title'])})" in line, claim["id"]
    order = list(TOPICS)
    positions = [(order.index(c["topic"]), results.index(f"## {c['title']}\n")) for c in current]
    assert [topic for topic, _ in sorted(positions, key=lambda p: p[1])] == sorted(t for t, _ in positions)
