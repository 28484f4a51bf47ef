"""The differential fuzzer's fixed-seed slice (tests/fuzz.py): no mismatch against plain generate."""

from fuzz import draw_case, fuzz


def test_fuzz_slice_of_200_runs_has_no_mismatch():
    summary = fuzz(range(200))
    assert summary["outcomes"].get("mismatch", 0) == 0, summary["mismatches"][:3]
    # the slice exercises decoding, not just refusals
    assert summary["outcomes"].get("identical", 0) >= 120, summary["outcomes"]


def test_cases_are_reproducible_from_their_seed():
    assert draw_case(7) == draw_case(7) and draw_case(7) != draw_case(8)
