"""`hf-bpd demo`'s timing: every method keeps its fastest round, rounds run the methods alike."""

import pytest
import torch

from hf_bpd.tools.demo import fastest_rounds


def _scripted_clock(times: dict[str, list[float]], calls: list[str]):
    """A `timed` that runs the call and reports the next scripted time of the method it belongs to."""

    def timed(run):
        name = run()
        calls.append(name)
        return torch.tensor([len(name)]), times[name].pop(0)

    return timed


def test_each_method_keeps_its_fastest_round_and_every_round_runs_all_methods_in_order():
    times = {"plain": [3.0, 2.0], "hf_bpd": [1.0, 4.0]}
    calls: list[str] = []
    runs = {name: (lambda name=name: name) for name in times}
    best = fastest_rounds(runs, ["hf_bpd", "plain"], 2, timed=_scripted_clock(times, calls))
    assert calls == ["hf_bpd", "plain", "hf_bpd", "plain"]
    assert {name: (kept.seconds, kept.round, kept.varied) for name, kept in best.items()} == {
        "plain": (2.0, 1, False),
        "hf_bpd": (1.0, 0, False),
    }


@pytest.mark.parametrize("times", [[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
def test_a_method_whose_output_changes_in_any_round_is_marked_varied_whichever_round_is_kept(times):
    outputs = iter([torch.tensor([1, 2]), torch.tensor([1, 3]), torch.tensor([1, 2])])
    timings = iter(times)
    kept = fastest_rounds({"plain": lambda: None}, ["plain"], 3, timed=lambda run: (next(outputs), next(timings)))
    assert kept["plain"].varied and kept["plain"].seconds == 1.0
