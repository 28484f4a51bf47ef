"""Notebooks are valid and their code cells compile (executing them is the real-model tests' job)."""

import json
from pathlib import Path

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_notebooks_parse_and_compile():
    assert NOTEBOOKS
    for nb in NOTEBOOKS:
        data = json.loads(nb.read_text())
        assert data["nbformat"] == 4
        for i, cell in enumerate(data["cells"]):
            if cell["cell_type"] == "code":
                compile("".join(cell["source"]), f"{nb.name}[{i}]", "exec")
