"""Property: every random case either matches serial (forward and gradients) or raises a PlanError.

Derandomized, so CI runs the same 200 cases every time; `make fuzz` runs many more.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from fuzz.spec import run_case
from fuzz.strategies import cases


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
@given(cases())
def test_fuzz_plans_match_serial_or_raise_plan_error(case):
    run_case(case)


def test_failures_are_saved_with_a_replay_command(tmp_path, monkeypatch):
    import json

    from fuzz import replay, run

    monkeypatch.setattr(run, "FAILURES", str(tmp_path))
    case = {
        "seed": 1,
        "vocab": 0,
        "d": 4,
        "batch": 2,
        "seq": 2,
        "blocks": [{"kind": "linear", "out": 4}],
        "mesh": [[2], ["a0"]],
        "dp": "a0",
        "annotations": [["blocks.0", "colwise", "a0"]],
    }
    try:
        raise RuntimeError("pretend the plan was wrong")
    except RuntimeError as e:
        path = run.save_failure(case, e)
    saved = json.load(open(path))
    assert saved["case"] == case and "pretend" in saved["error"] and "fuzz.replay" in saved["replay"]
    assert replay.main(path) == 0  # this case is fine: the replay says ok
