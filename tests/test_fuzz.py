"""Property: every random case either matches serial (forward and gradients) or raises a PlanError.

Derandomized, so CI runs the same 200 cases every time; `make fuzz` runs many more.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from fuzz.spec import run_case
from fuzz.strategies import cases


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck), print_blob=True)
@given(cases())
def test_fuzz_plans_match_serial_or_raise_plan_error(case):
    run_case(case)
