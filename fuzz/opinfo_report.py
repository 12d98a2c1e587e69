"""docs/opinfo.md from a run of fuzz/opinfo.py (its ``--json`` file): the recipe, the counts per
class (ops and cases), the ops still on fallback and why, the ops left out.

Run: ``python -m fuzz.opinfo_report fuzz/opinfo-results.json docs/opinfo.md`` (``make opinfo``
does both).
"""

from __future__ import annotations

import collections
import json
import re
import sys

from fuzz.opinfo import ILL_CONDITIONED, MESHES, ONLY_REPLICATED, RANDOM, SAMPLES_PER_OP

INTRO = """# PyTorch's OpInfo database against autopar

PyTorch ships its own op tests: the OpInfo database
(`torch.testing._internal.common_methods_invocations.op_db`, with `op.sample_inputs(...)`), the
samples DTensor's sharding tests run on. `make opinfo` (`fuzz/opinfo.py`) holds autopar's rules
against it as an outside tester would:

- every float32 CPU OpInfo with autograd, less the ops left out below;
- the first {samples} samples of each op that have a floating tensor with a dim dividing by 2, each
  wrapped as `forward(x, *tensors)`: `x` the sample's first floating tensor, `tensors` every other
  tensor of its input, args and kwargs (each requiring grad where the sample's does), the
  non-tensor arguments fixed;
- planned with `x` placed `S(d)` on each dim `d` that divides, on meshes {meshes} (on the second
  axis another such dim, or `R`), and checked by `plan.check`: every rank's outputs and every
  rank's gradient of every input against serial (fp32 tolerances, 1e-5 / 1e-6).

A case ends in one class: **pass** (every op under a rule, equal to serial), **fallback** (equal to
serial, but some op had no rule and ran gathered, with its warning), **refused** (a clear
`ap.PlanError` before running), **untraceable** (`torch.export` could not trace it), or a failure:
**wrong** (`PlanMismatch`: a silent wrong number) or **error** (anything else). An op's class is its
worst case's; **fallback** too when in every case a rule offered nothing but replication for a split
input (a rule that only replicates does not count as split); **no split dim** when no sample has a
dim that divides by 2 (not counted among the eligible ops). A passing case may still run gathered
where the cost model finds that cheaper (all other inputs require grad and are replicated): the
rule's split strategies are then checked by `tests/simulated/test_rules_families.py`, which forces
them.

Left out: random ops and samples (their samples draw on every call: serial and ranks differ by
design; see [randomness.md](randomness.md) for dropout; attention samples with `dropout_p > 0`), sparse layouts (nothing strided to split), and the
decompositions, inverses and solvers of linear algebra (ill-conditioned gradients on random inputs,
results unique only up to sign or order).
"""


# why an op stays on fallback, for the ops of the last run (by kind)
_NOT_SPLITTABLE = "every sample reduces or sorts over all dims, or over its only dim that divides: nothing left split"
_DATA_DEPENDENT = "output size depends on the values (data-dependent): no layout to plan"
_NO_RULE = "no rule yet: each output position depends on the whole input"
OP_NOTES = {
    **dict.fromkeys(
        ["linalg.vector_norm", "masked.amax", "masked.amin", "masked.logsumexp", "masked.norm", "masked.prod"],
        _NOT_SPLITTABLE,
    ),
    **dict.fromkeys(["mode", "nanmean", "prod", "quantile", "nanquantile", "sort"], _NOT_SPLITTABLE),
    **dict.fromkeys(
        ["masked_select", "repeat_interleave", "_segment_reduce.lengths", "_segment_reduce.offsets"], _DATA_DEPENDENT
    ),
    **dict.fromkeys(["block_diag", "combinations", "diag", "diagflat", "gradient", "index_reduce.prod"], _NO_RULE),
    **dict.fromkeys(
        ["as_strided", "as_strided.partial_views", "as_strided_copy", "as_strided_scatter"],
        "addresses the input's storage, not its elements: gathered (refused where it reads past the input)",
    ),
    "masked.normalize": "new_full (creation) offers no split for its input",
    "nn.functional.embedding_bag": "no rule for embedding_bag yet",
    "nn.functional.linear_cross_entropy.chunked": "torch_nn custom op of torch 2.13: no rule",
    "nn.functional.linear_cross_entropy.chunked_none": "torch_nn custom op of torch 2.13: no rule",
    "nn.functional.pixel_unshuffle": "samples split H or W into pieces the downscale factor does not divide",
    "stft": "reflect padding of the split signal: pad's rule gathers it",
}


def write_report(data: dict, path: str) -> None:
    s, cases = data["summary"], data["cases"]
    seconds = s.get("seconds")
    lines = [INTRO.format(samples=SAMPLES_PER_OP, meshes=" and ".join(map(str, MESHES)))]
    eligible = s["eligible_ops"]
    lines += ["## Last run", ""]
    if seconds is not None:
        lines.append(
            f"`make opinfo` on this project's 2-vCPU machine (shared with other jobs), {seconds / 60:.0f} min."
        )
    lines += [
        "",
        "| class | ops | cases |",
        "|---|---|---|",
    ]
    for cls in ("pass", "fallback", "refused", "untraceable", "wrong", "error", "no split dim"):
        lines.append(f"| {cls} | {s['ops'].get(cls, 0)} | {s['cases'].get(cls, 0)} |")
    share = s["fallback_share"]
    lines += [
        "",
        f"Eligible ops (a traced case): {eligible}; on fallback: {s['ops'].get('fallback', 0)} ({share:.1%}).",
        "",
        "## Ops still on fallback, and the ATen ops without a rule behind them",
        "",
    ]
    lines += _fallback_lines(s, cases)
    lines += ["", "## Refused and untraceable ops", ""]
    lines += _other_lines(s, cases)
    lines += ["", "## Left out", ""]
    lines.append("Random: " + ", ".join(sorted(RANDOM)) + ".")
    lines.append("")
    lines.append("Ill-conditioned linear algebra: " + ", ".join(sorted(ILL_CONDITIONED)) + ".")
    lines.append("")
    lines.append("Sparse: every OpInfo whose name holds `sparse`.")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _fallback_lines(s: dict, cases: list) -> list[str]:
    why = collections.defaultdict(set)
    for c in cases:
        if s["per_op"].get(c["op"]) != "fallback":
            continue
        if c["status"] == "fallback" or (c["status"] == "pass" and c["detail"].startswith(ONLY_REPLICATED)):
            why[c["op"]].update(x for x in c["detail"].split(": ", 1)[-1].split(", ") if x)
    out = ["| op | ATen ops without a rule, or replicating | why |", "|---|---|---|"]
    out += [f"| `{op}` | {', '.join(sorted(why[op])) or '-'} | {OP_NOTES.get(op, '')} |" for op in sorted(why)]
    return out


def _other_lines(s: dict, cases: list) -> list[str]:
    first = {}
    for c in cases:
        if s["per_op"].get(c["op"]) in ("refused", "untraceable") and c["status"] in ("refused", "untraceable"):
            first.setdefault(c["op"], (c["status"], re.sub(r"at \S+/(\w+\.py:\d+)", r"at \1", c["detail"])[:160]))
    out = ["| op | class | first reason |", "|---|---|---|"]
    out += [f"| `{op}` | {cls} | {detail.replace('|', '/')} |" for op, (cls, detail) in sorted(first.items())]
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        data = json.load(f)
    write_report(data, sys.argv[2])
