"""docs/support.md (every causal-LM architecture transformers registers, `tests/all_architectures.py`) is
current: a spread of its rows is reproduced now (all of them in the slow test), it records no failure, and
the README's summary is rendered from it."""

from __future__ import annotations

import pytest
import torch
from all_architectures import (
    COMMAND,
    EXACT,
    FAILURES,
    PAGE,
    README,
    REFUSED,
    build,
    check,
    model_types,
    read_page,
    readme_block,
    spread,
    sweep,
    versions,
)

# refused models (recurrent state; an LM head reading a projected state) and windowed ones (sliding,
# chunked layers) besides the spread
CHOSEN = ("mamba", "rembert", "mistral", "gemma2", "llama4_text")


def subset() -> list[str]:
    registered = model_types()
    return sorted({*spread(registered, 18), *(t for t in CHOSEN if t in registered)})


def current(types: list[str]) -> list[str]:
    made, page_rows = read_page()
    return check(sweep(types), page_rows, made == versions())


def test_page_records_no_failure_and_every_registered_type():
    _, rows = read_page()
    assert [r.model_type for r in rows if r.status in FAILURES] == []
    assert {r.model_type for r in rows} == set(model_types()), f"run: {COMMAND}"


def test_readme_summarises_the_page():
    _, rows = read_page()
    assert readme_block(rows) in README.read_text(encoding="utf-8"), f"run: {COMMAND}"


def test_subset_has_a_refused_and_a_windowed_type():
    _, rows = read_page()
    status = {r.model_type: r.status for r in rows}
    chosen = subset()
    assert len(chosen) >= 20
    assert any(status.get(t) == REFUSED for t in chosen)
    assert "mistral" in chosen and "gemma2" in chosen  # sliding windows shorter than the text


def test_a_spread_of_rows_is_current():
    assert current(subset()) == [], f"run: {COMMAND} (page: {PAGE})"


def test_last_hidden_state_alone_is_the_one_every_hidden_state_ends_with():
    """hf_bpd asks its forwards for the last hidden state alone where that is safe
    (`compat.last_hidden_state_request`): on the spread's decoding types, and on Mllama (which skips its
    cross-attention layers on text alone, so an index would select nothing), it is the last of the hidden
    states `output_hidden_states=True` returns."""
    from hf_bpd.compat import LAST_HIDDEN_STATE, last_hidden_state_request

    _, rows = read_page()
    decoded = {r.model_type for r in rows if r.status == EXACT}
    checked = [t for t in subset() if t in decoded] + ["mllama"]
    assert len(checked) >= 15 and "mllama" in decoded
    asked = set()
    ids = torch.tensor([[5, 9, 13, 17, 3, 11]])
    for model_type in checked:
        model = build(model_type)
        with torch.no_grad():
            every = model(input_ids=ids, output_hidden_states=True).hidden_states
            alone = model(input_ids=ids, output_hidden_states=last_hidden_state_request(model)).hidden_states
        assert alone[-1] is not None and torch.equal(alone[-1], every[-1]), model_type
        asked.add(last_hidden_state_request(model))
    assert asked == {LAST_HIDDEN_STATE, True}  # both requests are exercised


@pytest.mark.slow
def test_every_row_is_current():
    assert current(model_types()) == [], f"run: {COMMAND} (page: {PAGE})"


def test_a_state_layer_that_counts_its_tokens_decodes_exactly():
    """Lfm3's first layer is a convolution: from transformers 5.25 its cache layer counts the tokens it has
    seen, and the model's `get_seq_length` reads that count, so after a rejected draft the count is restored
    with the conv states (`kv.token_counts`); left advanced, it shifted every later position."""
    [row] = sweep(["lfm3"])
    assert row.status == EXACT, row.reason
