"""autopar demo: plan a GPT-style model on a 2 x 2 mesh (dp x tp), show the plan, run every rank
in the simulator and for real with 4 gloo processes, and check both against the serial model.

    make demo        (or: python examples/demo.py)
"""

from __future__ import annotations

import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import autopar as ap  # noqa: E402
from autopar.runtime.gloo_pool import GlooPool  # noqa: E402
from tests.harness.models import MEGATRON, gpt_batch, small_gpt  # noqa: E402


def section(title):
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)))


def main():
    torch.set_num_threads(1)
    model = small_gpt(tied=True)
    idx, targets = gpt_batch()
    mesh = ap.Mesh((2, 2), ("dp", "tp"))

    section("annotations")
    for pattern, ann in MEGATRON.items():
        print(f"  {pattern:22s} {ann!r}")
    print("  batch split on 'dp'")

    section("plan")
    t = time.perf_counter()
    plan = ap.plan(model, mesh, args=(idx, targets), annotations=MEGATRON, data_parallel="dp")
    print(f"(traced, propagated and planned in {time.perf_counter() - t:.1f} s)\n")
    print(plan)

    section("rank 3's module (excerpt of its code)")
    code = plan.module(3).code.splitlines()
    lines = [ln for ln in code if "autopar" in ln or "linear" in ln][:10]
    print("\n".join(lines))
    w = plan.module(3).get_parameter("blocks.0.mlp.fc.weight")
    print(f"\nblocks.0.mlp.fc.weight on rank 3: {tuple(w.shape)} (serial {tuple(model.blocks[0].mlp.fc.weight.shape)})")

    section("simulated: all 4 ranks in this process vs the serial model")
    report = plan.check(idx, targets)
    print(
        f"outputs and all {report['grads']} parameter gradients equal serial "
        f"(max relative difference {report['max_rel']:.1e})"
    )

    section("real: 4 gloo processes, 3 SGD steps vs serial training")
    with GlooPool(4) as pool:
        results = pool.run("tests.gloo.jobs:gpt_step_matches_serial", (2, 2), ("dp", "tp"), "dp")
    r = results[0]
    for step, (a, s) in enumerate(zip(r["losses"], r["serial"])):
        print(f"  step {step}: autopar loss {a:.6f}   serial loss {s:.6f}")
    ok = all(x["max_rel_param"] < 1e-5 for x in results)
    print(
        f"parameters after training: max relative difference {max(x['max_rel_param'] for x in results):.1e} "
        f"-> {'OK' if ok else 'MISMATCH'}"
    )
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
