"""Notebooks are valid and their code cells compile; the slow test runs the quickstart on the real model."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_notebooks_parse_and_compile():
    assert NOTEBOOKS
    for nb in NOTEBOOKS:
        data = json.loads(nb.read_text())
        assert data["nbformat"] == 4
        for i, cell in enumerate(data["cells"]):
            if cell["cell_type"] == "code":
                compile("".join(cell["source"]), f"{nb.name}[{i}]", "exec")


@pytest.mark.slow
@pytest.mark.real
def test_quickstart_notebook_runs_on_the_real_model(capsys):
    """Every code cell, in order, in one namespace (what a user running the notebook gets)."""
    data = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb").read_text())
    namespace: dict = {}
    for i, cell in enumerate(data["cells"]):
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"quickstart.ipynb[{i}]", "exec"), namespace)
    out = capsys.readouterr().out
    assert "identical: True" in out and "acceptance multipliers:" in out
