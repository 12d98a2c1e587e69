"""Replay a saved fuzz failure: `python -m fuzz.replay fuzz/failures/<hash>.json`.

Prints the plan and the outcome ('ok', a PlanError, or the traceback of the failure).
"""

from __future__ import annotations

import json
import sys
import traceback

from .spec import plan_case, run_case


def main(path: str) -> int:
    with open(path) as f:
        data = json.load(f)
    case = data.get("case", data)
    print(json.dumps(case))
    try:
        print(plan_case(case, cache=False)[0])
        print("outcome:", run_case(case))
        return 0
    except Exception:  # noqa: BLE001 - shown in full
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
