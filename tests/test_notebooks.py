"""Notebooks are valid, open with an install cell, and run top to bottom on the real model (in CI)."""

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


def run_notebook(name: str) -> None:
    """Every code cell, in order, in one namespace (what a user running the notebook gets)."""
    data = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / name).read_text())
    namespace: dict = {}
    for i, cell in enumerate(data["cells"]):
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{name}[{i}]", "exec"), namespace)


def test_every_notebook_opens_with_an_install_cell():
    for nb in NOTEBOOKS:
        first_code = next(c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
        assert "pip" in "".join(first_code["source"]) and "find_spec" in "".join(first_code["source"]), nb.name


@pytest.mark.real
def test_quickstart_notebook_runs_on_the_real_model(capsys):
    run_notebook("quickstart.ipynb")
    out = capsys.readouterr().out
    assert "identical: True" in out and "acceptance multipliers:" in out
    assert "identical: False" not in out


@pytest.mark.real
def test_train_heads_notebook_distills_trains_decodes_and_shares(capsys):
    run_notebook("train_heads.ipynb")
    out = capsys.readouterr().out
    assert out.count("identical: True") == 2 and "identical from the saved folder: True" in out
    assert "identical: False" not in out and "drafter.json" in out


@pytest.mark.real
def test_paper_analyses_notebook_runs_the_analyses_and_plots(capsys):
    run_notebook("paper_analyses.ipynb")
    out = capsys.readouterr().out
    assert "analysed categories: ['math', 'summarization', 'translation', 'writing']" in out
    assert "entropy_hmax.png" in out
