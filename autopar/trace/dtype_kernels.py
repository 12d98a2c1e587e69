"""Does the device have a kernel for every op of a policy's trace in the policy's dtype?

A precision policy runs the model in ``param_dtype`` (trace/in_dtype.py). Some ops have no kernel
for a low-precision dtype on a device: on CPU in torch 2.13, bfloat16 and float16 have none for
LAPACK's decompositions (``linalg.qr``, ``cholesky``, ``eigh``, ``svd``, ``det``, ``solve``: "geqrf_cpu
not implemented for 'BFloat16'") nor for the FFTs and ``linalg.inv`` (these refuse already while
export traces, in their meta functions). Found at the first step, the plan is made, the ranks
started, the job lost. So the planner asks here, before anything else is planned:

- ``export_refusal``: export's own refusal of a dtype (fft, inv) turned into a PlanError that names
  the module and the source line;
- ``check_kernels``: each distinct ATen op of the traced forward with a floating input in the
  compute dtype, run once on the device on real tensors of its smallest call's shapes (ops whose
  inputs hold more than PROBE_ELEMENTS elements are left unchecked: dtype support is a property
  of the kernel, not of the sizes, and a planner must not run a big model's forward). A missing
  kernel counts, and so do inputs meeting in two dtypes where the kernel wants one (an fp32 buffer
  the policy does not cast meeting bf16 weights: XGLM); any other error of a probe (a value check on
  random inputs) is not ours.

Either error says what to write: the op kept in fp32 in the model's own code (the policy's trace
keeps the model's casts, as HF's RMSNorm's ``.to(torch.float32)``), or another ``param_dtype``
(float16 is probed too, and named where it has the kernel).

Example:
    >>> check_kernels(traced.gm.graph, torch.bfloat16, torch.device("cpu"), model)
    PlanError: ... aten.linalg_qr.default (node linalg_qr, module 'mix') has no kernel for torch.bfloat16 on cpu ...
"""

from __future__ import annotations

import linecache
import re
import traceback

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.errors import PlanError
from autopar.trace.module_paths import module_path

PROBE_ELEMENTS = 1 << 22  # 8 MiB of bf16: an op's inputs larger than this are not run
_MISSING = re.compile(r"not implemented for '(BFloat16|Half)'|Unsupported dtype|Low precision dtypes not supported")
# an op whose inputs meet in two dtypes where its kernel wants one (XGLM's fp32 sinusoidal positions
# added to bf16 embeddings, then a LayerNorm with bf16 weights): FSDP2's recipe fails there too
_MIXED = re.compile(r"mixed dtype|to have the same dtype|expected scalar type \S+ but found")


def missing_kernel(e: BaseException) -> bool:
    """Whether ``e`` says a kernel lacks the dtype (not a value or shape error)."""
    return isinstance(e, (NotImplementedError, RuntimeError)) and bool(_MISSING.search(str(e)))


def check_kernels(graph: fx.Graph, dtype: torch.dtype | None, device, model=None) -> None:
    """Raise a PlanError for the first op of ``graph`` reading a ``dtype`` tensor that has no
    kernel for it on ``device`` (None, or the meta device: nothing runs there, nothing checked)."""
    if dtype is None or dtype == torch.float32 or device is None or torch.device(device).type == "meta":
        return
    device = torch.device(device)
    # the probes draw random inputs: the user's generators are left as they were
    with torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type):
        for node in _smallest_calls(graph, dtype).values():
            try:
                _probe(node, device)
            except Exception as e:  # noqa: BLE001 - only a missing kernel or mixed dtypes are ours to name
                if missing_kernel(e):
                    other = _other_dtype(node, dtype, device)
                    raise PlanError(_message(node, dtype, device, e, other, model)) from e
                if isinstance(e, RuntimeError) and _MIXED.search(str(e)):
                    raise PlanError(_mixed_message(node, dtype, e, model)) from e


def _smallest_calls(graph: fx.Graph, dtype) -> dict:
    """Each distinct (op, its tensor inputs' dtypes) reading a ``dtype`` tensor: its call with the
    fewest input and output elements (within PROBE_ELEMENTS), in graph order."""
    best: dict = {}
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target.namespace != "aten":  # a user's torch.library op may have side effects: not run
            continue
        vals = [v for v in _input_vals(node) if isinstance(v, torch.Tensor)]
        if not any(v.dtype == dtype for v in vals):
            continue
        outs = [v for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
        sizes = [_numel(v) for v in vals + outs]
        if None in sizes:  # a data-dependent size (MoE dispatch's rows): no shape to run it at
            continue
        size = sum(sizes)
        key = (node.target, tuple(v.dtype for v in vals))
        if size <= PROBE_ELEMENTS and (key not in best or size < best[key][0]):
            best[key] = (size, node)
    return {k: n for k, (_, n) in best.items()}


def _input_vals(node):
    return [a.meta.get("val") for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]


def _probe(node: fx.Node, device, dtype=None) -> None:
    """Run ``node``'s op once on real tensors of its inputs' shapes on ``device`` (its floating
    inputs in ``dtype`` where given)."""

    def real(a):
        if not isinstance(a, fx.Node):
            return a
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            shape = [_hint(d) for d in v.shape]
            if v.is_floating_point():
                return torch.randn(shape, dtype=dtype or v.dtype, device=device)
            return torch.zeros(shape, dtype=v.dtype, device=device)
        if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
            return _hint(v)
        return v

    args, kwargs = pytree.tree_map(real, (node.args, node.kwargs), is_leaf=lambda x: isinstance(x, fx.Node))
    with torch.no_grad():
        node.target(*args, **kwargs)


def _hint(d):
    """A symbolic size's example value; None for a data-dependent one (an unbacked symbol)."""
    if isinstance(d, torch.SymInt | torch.SymFloat | torch.SymBool):
        if d.node.hint is not None:
            return d.node.hint
        return d.node.shape_env.size_hint(d.node.expr, allow_none=True)
    return d


def _numel(v) -> int | None:
    n = 1
    for d in v.shape:
        h = _hint(d)
        if h is None:
            return None
        n *= int(h)
    return n


def _other_dtype(node, dtype, device):
    """The other low-precision dtype if the op has a kernel for it on ``device``, else None."""
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    try:
        _probe(node, device, other)
    except Exception:  # noqa: BLE001 - any failure: do not recommend it
        return None
    return other


def _fix(where: str, dtype, other, probed=True) -> str:
    """What to write: the op kept in fp32 by the model's code, or the dtype that has the kernel
    (``other``: the other low-precision dtype where probed and found, else fp32)."""
    second = "torch.float16" if dtype == torch.bfloat16 else "torch.bfloat16"
    if other is not None:
        alt = f"or plan with param_dtype={other} (it has the kernel here)"
    elif probed:
        alt = f"or plan with param_dtype=torch.float32 ({second} has no kernel for it here either)"
    else:
        alt = "or plan with param_dtype=torch.float32"
    return (
        f"Keep that op in fp32 in the forward of {where}: compute it on its input's .float() and cast the "
        "result back with .to(x.dtype) (the policy's trace keeps the model's own casts, as HF's RMSNorm's "
        f".to(torch.float32)), {alt}."
    )


def _message(node, dtype, device, e, other, model) -> str:
    path = module_path(node)
    where = f"module {path!r}" if path else f"the model's forward ({type(model).__name__})" if model else "the model"
    return (
        f"The precision policy computes in {dtype}, but {node.target} (node {node.name}, {where}) has "
        f"no kernel for {dtype} on {torch.device(device).type}: {str(e).splitlines()[0]}\n"
        + _fix(f"module {path!r}" if path else "the model", dtype, other)
    )


def _mixed_message(node, dtype, e, model) -> str:
    path = module_path(node)
    where = f"module {path!r}" if path else f"the model's forward ({type(model).__name__})" if model else "the model"
    dtypes = ", ".join(f"{a.name}: {str(v.dtype).removeprefix('torch.')}" for a, v in _named_vals(node))
    return (
        f"The precision policy computes in {dtype}, but {node.target} (node {node.name}, {where}) reads "
        f"tensors of different dtypes ({dtypes}): {str(e).splitlines()[0]}. A buffer or constant the "
        f"policy does not cast (it casts the parameters and the floating inputs, as FSDP2's "
        f"MixedPrecisionPolicy does, which fails here too) meets the {dtype} parameters. Cast it in the "
        f"model's code where it is read (e.g. `.to(x.dtype)`); where the model reads a parameter in fp32 on "
        f"purpose (a router's weight), name its module in the model's `_keep_in_fp32_modules_strict` class "
        f"attribute, as HF models do (the policy keeps those in fp32); or plan without the policy."
    )


def _named_vals(node):
    args = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
    return [(a, a.meta["val"]) for a in args if isinstance(a.meta.get("val"), torch.Tensor)]


def export_refusal(e: BaseException, dtype: torch.dtype | None, model: torch.nn.Module) -> PlanError | None:
    """A PlanError for export refusing the policy's dtype (an op's meta function checks it: fft,
    linalg.inv), naming the module whose forward called it and the source line; None for any other
    export failure."""
    cause = e.__cause__ or e
    if dtype is None or not missing_kernel(cause):
        return None
    names = {id(m): n for n, m in model.named_modules()}
    path, line = None, None  # the innermost module of the model on the stack; the innermost user line
    for frame, lineno in traceback.walk_tb(cause.__traceback__):
        if _library(frame.f_code.co_filename):
            continue
        line = f"{frame.f_code.co_filename}:{lineno}: {_source(frame.f_code.co_filename, lineno)}"
        if id(frame.f_locals.get("self")) in names:
            path = names[id(frame.f_locals["self"])]
    where = f"module {path!r}" if path else f"{type(model).__name__}'s forward" if path == "" else "the model"
    at = f" (at {line})" if line else ""
    return PlanError(
        f"The precision policy computes in {dtype}, but an op of {where}{at} has no kernel for {dtype}: "
        f"{str(cause).splitlines()[0]}\n" + _fix(f"module {path!r}" if path else "the model", dtype, None, probed=False)
    )


def _library(filename: str) -> bool:
    """torch's own frames (nn.Module.__call__ holds ``self`` too) and autopar's."""
    return "/torch/" in filename or "/autopar/" in filename


def _source(filename: str, lineno: int) -> str:
    return linecache.getline(filename, lineno).strip()
