"""PyTorch's own op tests against autopar: every OpInfo sample planned and checked against serial.

The recipe (issue 31), as an outside tester would hold autopar to a suite nobody here wrote:
each float32 CPU OpInfo of ``torch.testing._internal.common_methods_invocations.op_db`` with
autograd, minus the ops left out below, gives its samples; each sample becomes a module
``forward(x, *tensors)`` (``x`` the sample's first floating tensor, ``tensors`` every other
tensor of its input, args and kwargs, the non-tensor arguments fixed), planned with ``x``
placed ``S(d)`` on each eligible dim (one whose size divides by the axis) on meshes (2,) and
(2, 2) (there a second eligible dim on the second axis, or R), and checked by ``plan.check``:
every rank's outputs and every input's gradient against serial.

Each case ends in one class:
- ``pass``: planned with every op under a rule and checked equal to serial;
- ``fallback``: equal to serial, but some op had no rule and ran replicated (its warning);
- ``refused``: a clear ``ap.PlanError`` (not a trace error) before running;
- ``untraceable``: torch.export could not trace the sample (``ap.TraceError``);
- ``wrong`` (a ``PlanMismatch``: a silent wrong number) or ``error`` (anything else): failures.

An op's class is its worst case's (wrong, error, fallback, refused, pass), ``untraceable`` when
none of its cases traced, ``no split dim`` when no sample of it has a dim that divides by 2
(not counted among the eligible ops), and ``fallback`` when in every case of it some rule
offered nothing but replication for an input that arrived split (a rule that only ever
replicates does not count as split; one case of it may, where the op cannot split that dim,
as a max over it). A passing case may still run replicated where the cost model finds
gathering ``x`` cheaper than splitting the inputs that require grad (its detail says so). Left out (``LEFT_OUT``): random ops (their samples draw on every call,
so serial and ranks differ by design: see docs/randomness.md for dropout), sparse layouts (no
strided tensor to split), and linear-algebra decompositions and solvers (their gradients are
ill-conditioned on random inputs and their results are unique only up to signs or order).

Run: ``python -m fuzz.opinfo [--ops NAME ...] [--samples N] [--json FILE]``, then
``python -m fuzz.opinfo_report FILE docs/opinfo.md`` (``make opinfo`` does both);
tests/simulated/test_opinfo.py runs a fixed subset in ``make test``.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import autopar as ap
from autopar.placement import Replicate, Shard
from autopar.sharding.propagate import layout_of, op_info
from autopar.sharding.rules import get_rule

R = Replicate()
MESHES = ((2,), (2, 2))
SAMPLES_PER_OP = 6  # the first samples of each op (their order is the OpInfo's own, seeded)
FAILURES = ("wrong", "error")
REPLICATED = "every op ran replicated (gathering was cheaper)"  # a passing case's detail
ONLY_REPLICATED = "a rule offered only replication for a split input: "  # and this one
CLASS_ORDER = ("wrong", "error", "fallback", "refused", "pass", "untraceable")  # worst first

RANDOM = {
    "bernoulli", "normal", "rrelu", "nn.functional.rrelu", "multinomial", "uniform", "exponential",
    "geometric", "cauchy", "log_normal", "randn", "randn_like", "rand_like", "randint_like",
    "randint", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "pca_lowrank", "svd_lowrank", "native_dropout_backward",
    "nn.functional.multi_head_attention_forward",  # its samples train with dropout_p 0.5 (positional)
}  # fmt: skip
# decompositions, inverses and solvers: ill-conditioned gradients, results unique up to sign/order
ILL_CONDITIONED = {
    "cholesky", "cholesky_inverse", "cholesky_solve", "inverse", "lu", "lu_solve", "lu_unpack", "qr",
    "svd", "pinverse", "det", "logdet", "matrix_exp", "ormqr", "geqrf", "triangular_solve", "symeig",
    "linalg.cholesky", "linalg.cholesky_ex", "linalg.cond", "linalg.det", "linalg.eig", "linalg.eigh",
    "linalg.eigvals", "linalg.eigvalsh", "linalg.householder_product", "linalg.inv", "linalg.inv_ex",
    "linalg.lstsq", "linalg.lu", "linalg.lu_factor", "linalg.lu_factor_ex", "linalg.lu_solve",
    "linalg.matrix_power", "linalg.matrix_rank", "linalg.pinv", "linalg.qr", "linalg.slogdet",
    "linalg.solve", "linalg.solve_ex", "linalg.solve_triangular", "linalg.svd", "linalg.svdvals",
    "linalg.tensorinv", "linalg.tensorsolve", "linalg.ldl_factor", "linalg.ldl_factor_ex",
    "linalg.ldl_solve", "linalg.matrix_norm", "linalg.norm", "nuclear_norm", "slogdet",
}  # fmt: skip


def left_out(name: str) -> str | None:
    """Why the op named ``name`` is not run (None: it is)."""
    if name in RANDOM:
        return "random"
    if name in ILL_CONDITIONED:
        return "ill-conditioned linalg"
    if "sparse" in name:
        return "sparse"
    return None


def eligible_ops(names=None) -> list:
    """The float32 CPU OpInfos with autograd that the run covers, in op_db's order."""
    from torch.testing._internal.common_methods_invocations import op_db  # needs expecttest

    ops = [o for o in op_db if o.supports_autograd and torch.float32 in o.supported_dtypes("cpu")]
    ops = [o for o in ops if left_out(o.name) is None]
    if names:
        ops = [o for o in ops if o.name in names or f"{o.name}.{o.variant_test_name}" in names]
    return ops


def op_key(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


class SampleModule(nn.Module):
    """``forward(x, *tensors)``: the OpInfo's op on the sample, its tensors put back in their
    places (``x`` was tensor ``x_at`` of the sample, the others follow in order)."""

    def __init__(self, op, structure, x_at: int):
        super().__init__()
        self.op, self.structure, self.x_at = op, structure, x_at

    def forward(self, x, *tensors):
        flat, spec = self.structure
        it = iter((*tensors[: self.x_at], x, *tensors[self.x_at :]))
        inp, args, kwargs = pytree.tree_unflatten([next(it) if v is _SLOT else v for v in flat], spec)
        out = self.op(inp, *args, **kwargs)
        return tuple(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


_SLOT = object()  # where a tensor of the sample goes back


def sample_case(op, sample):
    """(module, x, tensors) of an OpInfo sample; None without a floating tensor to split, with
    an empty one, or with a dropout probability (a random sample)."""
    if sample.kwargs.get("dropout_p"):  # attention with dropout draws at random: left out as random ops are
        return None
    flat, spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    tensors = [v for v in flat if isinstance(v, torch.Tensor)]
    x_at = next((i for i, t in enumerate(tensors) if t.dtype.is_floating_point and t.dim()), None)
    if x_at is None or any(t.numel() == 0 for t in tensors):
        return None
    marked = [_SLOT if isinstance(v, torch.Tensor) else v for v in flat]
    module = SampleModule(op.op, (marked, spec), x_at)
    return module, tensors[x_at], tensors[:x_at] + tensors[x_at + 1 :]


@dataclass
class Case:
    op: str
    sample: int
    mesh: tuple
    placements: tuple
    shape: tuple
    status: str = ""
    detail: str = ""
    no_rule: list = field(default_factory=list)  # aten ops that ran replicated for lack of a rule


def placements_for(shape: tuple, mesh_shape: tuple) -> list[tuple]:
    """One layout of x per eligible dim: S(d) on the first axis; on a second axis another
    eligible dim (the next one, cyclically) or R."""
    dims = [d for d, s in enumerate(shape) if s >= mesh_shape[0] and s % mesh_shape[0] == 0]
    out = []
    for k, d in enumerate(dims):
        layout = [Shard(d)]
        for n in mesh_shape[1:]:
            others = [e for e in dims[k + 1 :] + dims[:k] if e != d and shape[e] % n == 0]
            layout.append(Shard(others[0]) if others else R)
        out.append(tuple(layout))
    return out


def run_case(module, x, tensors, mesh_shape, placements) -> tuple[str, str, list]:
    """(class, detail, ops without a rule) of one planned and checked case."""
    mesh = ap.Mesh(mesh_shape, ("a", "b", "c")[: len(mesh_shape)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plan = ap.plan(module, mesh, args=(x, *tensors), annotations={"x": ap.place(*placements)})
        except ap.TraceError as e:
            return "untraceable", _first_line(e), []
        except ap.PlanError as e:
            return "refused", f"{type(e).__name__}: {_first_line(e)}", []
        except Exception as e:  # noqa: BLE001 - an internal error is a finding, not a crash of the run
            return "error", f"plan: {type(e).__name__}: {_first_line(e)}", []
        no_rule = sorted({_no_rule_op(str(w.message)) for w in caught if "no sharding rule" in str(w.message)})
        try:
            plan.check(x, *tensors)
        except ap.PlanMismatch as e:
            return "wrong", _first_line(e), no_rule
        except ap.PlanError as e:
            return "refused", f"{type(e).__name__}: {_first_line(e)}", no_rule
        except Exception as e:  # noqa: BLE001
            return "error", f"check: {type(e).__name__}: {_first_line(e)}", no_rule
    if no_rule:
        return "fallback", "no rule: " + ", ".join(no_rule), no_rule
    replicating = _replicating_rules(plan)
    if replicating:
        return "pass", ONLY_REPLICATED + ", ".join(replicating), []
    return "pass", "" if _anything_split(plan) else REPLICATED, []


def _no_rule_op(message: str) -> str:
    return message.split("no sharding rule for ", 1)[1].split(" ", 1)[0]


def _replicating_rules(plan) -> list[str]:
    """Ops whose rule offered nothing but replication although an input arrived split: a rule
    that only replicates is a fallback too (its inputs are gathered, without the warning)."""
    found = set()
    for node in plan.graph.nodes:
        lay = node.meta.get("autopar")
        rule = get_rule(node.target) if node.op == "call_function" else None
        if rule is None or lay is None or not lay.outputs or not lay.inputs:
            continue
        if all(layout_of(i).spec is None or all(p.is_replicate() for p in layout_of(i).spec) for i in lay.inputs):
            continue
        # a strategy that reads split inputs is not replication, whatever it returns (a mean over
        # split rows is whole on every rank: its lowering sums over the ranks)
        if all(p.is_replicate() for s in rule(op_info(node)) for p in (*s.inputs, *s.outputs)):
            found.add(f"{node.target} (rule replicates only)")
    return sorted(found)


def _anything_split(plan) -> bool:
    """Did any op of the program compute on split (or partial) pieces?"""
    for node in plan.graph.nodes:
        lay = node.meta.get("autopar")
        if (
            node.op == "call_function"
            and lay is not None
            and lay.outputs
            and any(s is not None for s in lay.strategies)
        ):
            if any(not p.is_replicate() for spec in lay.outputs for p in spec):
                return True
    return False


def _first_line(e) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def op_cases(op, samples: int = SAMPLES_PER_OP, meshes=MESHES):
    """Every case of ``op``: (Case, thunk running it)."""
    torch.manual_seed(0)
    try:
        made = list(op.sample_inputs("cpu", torch.float32, requires_grad=True))
    except Exception as e:  # noqa: BLE001 - an OpInfo that cannot make samples here
        yield Case(op_key(op), -1, (), (), (), "untraceable", f"no samples: {_first_line(e)}"), None
        return
    taken = 0
    for i, sample in enumerate(made):
        if taken >= samples:
            break
        parts = sample_case(op, sample)
        if parts is None:
            continue
        module, x, tensors = parts
        any_case = False
        for mesh_shape in meshes:
            for placements in placements_for(tuple(x.shape), mesh_shape):
                any_case = True
                case = Case(op_key(op), i, mesh_shape, placements, tuple(x.shape))
                yield case, (lambda m=module, x=x, t=tensors, ms=mesh_shape, p=placements: run_case(m, x, t, ms, p))
        taken += any_case


def op_class(cases: list[Case]) -> str:
    """The worst class of the op's traced cases (``untraceable`` when none traced); ``fallback``
    too when in every case a rule offered nothing but replication."""
    if not cases:
        return "no split dim"
    traced = [c for c in cases if c.status != "untraceable"]
    if not traced:
        return "untraceable"
    worst = min((c.status for c in traced), key=CLASS_ORDER.index)
    if worst == "pass" and all(c.detail.startswith(ONLY_REPLICATED) for c in traced):
        return "fallback"  # its rule never offered a split: it only ever replicates
    return worst


def run_ops(ops, samples: int = SAMPLES_PER_OP, meshes=MESHES, log=None) -> dict[str, list[Case]]:
    results: dict[str, list[Case]] = {}
    for op in ops:
        cases = results.setdefault(op_key(op), [])
        for case, thunk in op_cases(op, samples, meshes):
            if thunk is not None:
                case.status, case.detail, case.no_rule = thunk()
            cases.append(case)
            if log and case.status in FAILURES:
                log(
                    f"{case.status}: {case.op} sample {case.sample} mesh {case.mesh} x{case.shape} {case.placements}: {case.detail}"
                )
        if log:
            log(f"op {op_key(op)}: {op_class(cases)} ({len(cases)} cases)")
    return results


def summary(results: dict[str, list[Case]]) -> dict:
    per_op = {name: op_class(cases) for name, cases in results.items()}
    case_counts = collections.Counter(c.status for cases in results.values() for c in cases)
    op_counts = collections.Counter(per_op.values())
    eligible = sum(n for k, n in op_counts.items() if k not in ("untraceable", "no split dim"))
    missing = collections.Counter(op for cases in results.values() for c in cases for op in c.no_rule)
    return {
        "ops": dict(op_counts),
        "cases": dict(case_counts),
        "eligible_ops": eligible,
        "fallback_share": op_counts.get("fallback", 0) / eligible if eligible else 0.0,
        "per_op": per_op,
        "missing_rules": dict(missing.most_common()),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="*", help="OpInfo names (default: every eligible op)")
    parser.add_argument("--samples", type=int, default=SAMPLES_PER_OP)
    parser.add_argument("--json", default=None, help="write every case and the summary here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for noisy in ("torch._export", "torch.fx.experimental.symbolic_shapes"):  # per sample, not findings
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    start = time.time()
    results = run_ops(eligible_ops(args.ops), args.samples, log=lambda m: print(m, flush=True))
    s = summary(results) | {"seconds": round(time.time() - start)}
    cases = [c.__dict__ | {"placements": [repr(p) for p in c.placements]} for cs in results.values() for c in cs]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": s, "cases": cases}, f, indent=1, default=str)
    fallback = sorted(k for k, v in s["per_op"].items() if v == "fallback")
    print(json.dumps({k: v for k, v in s.items() if k != "per_op"}, indent=1))
    print("fallback ops:", ", ".join(fallback))
    print(f"{time.time() - start:.0f} s")
    return 1 if any(s["ops"].get(k) for k in FAILURES) else 0


if __name__ == "__main__":
    raise SystemExit(main())
