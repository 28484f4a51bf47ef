"""The README's test command is exactly what CI runs; the README stays short and its links resolve."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```bash\n")[1:3]
    return [b.split("\n```")[0].strip() for b in blocks]


def ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


def test_ci_runs_the_readme_test_command():
    demo, tests = readme_commands()
    assert "hf-bpd demo" in demo and "pytest" in tests
    assert tests in ci_lines()


def test_ci_runs_the_readme_first_command_in_a_fresh_venv_with_empty_caches():
    """A new user's first command, exactly as written, on a fresh environment: it must not lean on what the
    test command installs (accelerate came only with the `train` extra once)."""
    demo, tests = readme_commands()
    lines = ci_lines()
    assert demo in lines
    first = lines.index(demo)
    assert first < lines.index(tests)
    before = "\n".join(lines[:first])
    assert "python -m venv" in before and 'source "$fresh/venv/bin/activate"' in before
    for cache in ("HF_HOME=", "XDG_CACHE_HOME=", "PIP_CACHE_DIR="):
        assert cache in before


def test_ci_runs_the_readme_test_command_in_the_fresh_venv_with_empty_caches():
    """The test command too runs where nothing installed earlier on the machine can hide a missing or too-old
    dependency: the venv made for the run is active for the whole script (activated outside any subshell),
    and the test step gets caches of its own."""
    demo, tests = readme_commands()
    lines = ci_lines()
    activated = lines.index('source "$fresh/venv/bin/activate"')
    assert activated < lines.index("(") < lines.index(demo)  # at the top level, before the demo's subshell
    between = "\n".join(lines[lines.index(demo) : lines.index(tests)])
    assert "deactivate" not in "\n".join(lines)
    for cache in ("HF_HOME=", "XDG_CACHE_HOME=", "TORCH_EXTENSIONS_DIR="):
        assert cache in between


def test_readme_is_at_most_200_lines():
    """A newcomer reads the README in five minutes: longer material goes to docs/ and is linked from it."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/"


def test_readme_and_docs_local_links_resolve():
    """Every relative link of the README and of the docs pages names a file that exists."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"
