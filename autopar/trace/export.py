"""The torch.export front end: an ATen-level fx graph with parameters as named placeholders.

Batch and sequence dims (every dim of every tensor input, let export decide which stay
dynamic) are exported as dynamic so that the emitted modules run at other sizes. The
graph is then prepared for propagation: a linear's bias and addmm's input are split into
a separate add, so that a row-parallel layer can add its bias once, after the reduction.

Example:
    >>> traced = trace(model, (x,))
    >>> traced.param_fqn["p_fc_weight"]
    'fc.weight'
"""

from __future__ import annotations

import contextlib
import inspect
import re
import traceback
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind

from autopar.errors import TraceError
from autopar.trace.inline_wrappers import inline_wrappers
from autopar.trace.model_members import released
from autopar.trace.repeat_blocks import Repeated, copy_blocks, find_repeated, truncated

aten = torch.ops.aten


@dataclass
class Traced:
    """A traced model: the graph plus what each placeholder and output stands for."""

    gm: fx.GraphModule
    param_fqn: dict[str, str]  # placeholder name -> parameter name in the model
    buffer_fqn: dict[str, str]  # placeholder name -> buffer name
    constant_fqn: dict[str, str]  # placeholder name -> lifted constant name
    constants: dict[str, torch.Tensor]  # lifted constant name -> value
    user_inputs: list[str]  # placeholder names of the user's inputs, in order
    buffer_mutations: dict[int, str]  # output position -> buffer name it writes
    n_user_outputs: int
    in_spec: object
    out_spec: object
    forward_arg_names: list[str]
    dynamic: bool | str  # as exported: True, False, or "batch" (dim 0 only; trace()'s ``dynamic``)
    tied: dict[str, list[str]] = field(default_factory=dict)  # canonical param -> all its names
    repeated: object = None  # repeat.Repeated when blocks were copied, not exported
    training: bool = True  # the model's mode when traced (export bakes it into flags)
    materialize_device: object = None  # a meta-device model's rank pieces go here (trace/meta_device.py)
    example: tuple | None = None  # (args, kwargs) as meta tensors: to trace again (trace/in_dtype.py)
    example_device: object = None  # where the example inputs were (materialized: traced again there)
    opaque: tuple = ()  # the module paths traced as ap.opaque() calls
    dtype: object = None  # the floating parameters' dtype when traced under a precision policy (None: their own)
    kept_fp32: frozenset = frozenset()  # parameter names the policy left in fp32 (trace/in_dtype.kept_in_fp32)
    replan: object = None  # (options, seeds) -> a Plan traced again (planner.make_plan; another compute dtype)

    def placeholders(self) -> dict[str, fx.Node]:
        return {n.name: n for n in self.gm.graph.nodes if n.op == "placeholder"}


def trace(
    model: torch.nn.Module,
    args: tuple = (),
    kwargs: dict | None = None,
    dynamic: bool | str = True,
    repeat_blocks: bool = True,
) -> Traced:
    """Export ``model`` at ``args``/``kwargs`` and prepare the graph for propagation.

    ``dynamic``: True exports every dim of the tensor inputs as dynamic (static where export
    must specialise), False none, ``"batch"`` only their dim 0 (a pipeline's static trace: its
    stages run micro-batches, the batch cut along dim 0).

    With ``repeat_blocks``, a long list of identical blocks is exported two blocks deep and
    the rest copied (see repeat_blocks.py); the graph is the one a full export gives.
    """
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"autopar needs an nn.Module, got {type(model).__name__}.")
    with released():  # it swaps the model's modules (a truncated stack) while it runs
        return _trace(model, args, kwargs, dynamic, repeat_blocks)


def _trace(model, args, kwargs, dynamic, repeat_blocks) -> Traced:
    args = args if isinstance(args, tuple) else (args,)
    args, kwargs = _distinct_inputs(args, dict(kwargs or {}))
    found = find_repeated(model) if repeat_blocks else None
    if found is not None:
        try:
            with truncated(model, found):
                ep, used_dynamic = _export(model, args, kwargs, dynamic)
            traced = _prepared(ep, used_dynamic, model, found)
            if traced is not None:
                return traced
        except Exception:  # noqa: BLE001 - any trouble with the short model: export it whole
            pass
    ep, used_dynamic = _export(model, args, kwargs, dynamic)
    return _prepared(ep, used_dynamic, model)


def _prepared(ep, used_dynamic: bool, model, found: Repeated | None = None) -> Traced | None:
    """The Traced of an ExportedProgram: names of what each placeholder stands for, wrappers
    inlined, biases split, and with ``found`` the blocks copied (None if they cannot be)."""
    gm = ep.graph_module
    sig = ep.graph_signature
    traced = Traced(
        gm=gm,
        param_fqn={},
        buffer_fqn={},
        constant_fqn={},
        constants={},
        user_inputs=[],
        buffer_mutations={},
        n_user_outputs=0,
        in_spec=ep.call_spec.in_spec,
        out_spec=ep.call_spec.out_spec,
        forward_arg_names=list(ep.module_call_graph[0].signature.forward_arg_names or []),
        dynamic=used_dynamic,
        training=model.training,
    )
    for spec in sig.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            traced.param_fqn[name] = spec.target
        elif spec.kind == InputKind.BUFFER:
            traced.buffer_fqn[name] = spec.target
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            traced.constant_fqn[name] = spec.target
            traced.constants[spec.target] = ep.constants[spec.target]
        elif spec.kind == InputKind.USER_INPUT:
            traced.user_inputs.append(name)
        else:
            raise TraceError(f"Input {name!r} of kind {spec.kind.name} is not supported by autopar.")
    for i, spec in enumerate(sig.output_specs):
        if spec.kind == OutputKind.USER_OUTPUT:
            traced.n_user_outputs += 1
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            traced.buffer_mutations[i] = spec.target
        else:
            raise TraceError(
                f"Output {spec.arg} of kind {spec.kind.name} (the model mutates its "
                "inputs in place?) is not supported by autopar: return a new tensor."
            )
    traced.tied = _tied_parameters(model)
    _check_outputs(traced)
    inline_wrappers(gm)
    split_biases(gm.graph)
    if found is not None:
        if traced.buffer_mutations or not copy_blocks(traced, found):
            return None
        traced.repeated = found
    traced.gm = _lazily_compiled(gm)
    return traced


def _lazily_compiled(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its Python code made on its first call rather than now.

    Why: autopar reads the traced graph, it never runs it; generating the code of a deep
    model's graph (a fifth of a second at 48 layers) would be spent for nothing.
    """
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule

        return _LazyGraphModule(gm, gm.graph)
    except Exception:  # noqa: BLE001 - a torch without it: compile now
        gm.recompile()
        return gm


def _distinct_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example inputs with every tensor passed more than once replaced, after its first use,
    by a copy. torch.export makes one placeholder of a tensor object passed twice, so
    ``plan(model, args=(x, x))`` (ids as their own placeholder labels) traced a model that reads
    its first argument for both and ignores the second: a causal LM then trained on
    ``targets = inputs``, its loss falling fast and wrong."""
    seen: set[int] = set()

    def distinct(v):
        if not isinstance(v, torch.Tensor):
            return v
        if id(v) in seen:
            return v.detach().clone().requires_grad_(v.requires_grad)
        seen.add(id(v))
        return v

    return pytree.tree_map(distinct, (args, kwargs))


def _dynamic_shapes(model, args, kwargs, batch_only: bool = False):
    def spec(x):
        if isinstance(x, torch.Tensor):
            return {d: Dim.AUTO for d in range(min(x.dim(), 1) if batch_only else x.dim())}
        return None

    signature = inspect.signature(model.forward)
    var_args = any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values())
    if not kwargs and not var_args:
        return pytree.tree_map(spec, args)
    # With keyword inputs, or ``*args`` (export takes them as one tuple), export wants the specs
    # keyed by the forward's parameter names.
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    return {name: pytree.tree_map(spec, value) for name, value in bound.items()}


def _export(model, args, kwargs, dynamic):
    """torch.export, dynamic first; static shapes as a fallback (with a warning)."""
    errors = []
    for use_dynamic in [dynamic, False] if dynamic else [False]:
        shapes = _dynamic_shapes(model, args, kwargs, batch_only=use_dynamic == "batch") if use_dynamic else None
        try:
            with warnings.catch_warnings(), _no_fake_tensor_cache():
                warnings.simplefilter("ignore")
                ep = torch.export.export(model, args, kwargs, dynamic_shapes=shapes, strict=False)
            if use_dynamic is False and dynamic:
                warnings.warn(
                    f"autopar: {type(model).__name__} traced with static shapes only "
                    f"(dynamic export failed: {_first_line(errors[0])}); its modules then "
                    "accept only the example's sizes.",
                    stacklevel=3,
                )
            return ep, use_dynamic
        except Exception as e:  # noqa: BLE001 - export raises many kinds; we re-raise as TraceError
            errors.append(e)
    raise TraceError(_explain_export_failure(model, errors[-1])) from errors[-1]


def _no_fake_tensor_cache():
    """torch's fake-tensor dispatch cache switched off for the export, restored after.

    Why: with symbolic shapes a cache hit rebuilds the output's symbolic sizes and strides,
    which costs more than running the op's meta function again; without the cache a 2-block
    GPT exports in ~0.95 s instead of ~1.45 s (measured on torch 2.13). The cache only saves
    time: the graph is the same.
    """
    try:
        import torch._dynamo.config as dynamo_config

        return dynamo_config.patch(fake_tensor_cache_enabled=False)
    except (ImportError, AttributeError):  # a torch without the switch: nothing to change
        return contextlib.nullcontext()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def _explain_export_failure(model, e: BaseException) -> str:
    """Name the user's source line where export gave up, and what to do about it."""
    text = str(e)
    where = _user_frame(e, text)
    data_dep = "data-dependent" in text.lower() or "GuardOnDataDependent" in type(e).__name__
    if "in output" in text and "Found <class" in text:
        cache = re.search(r"Found <class '[\w.]*(Cache)'>", text)  # HF's DynamicCache, StaticCache, ...
        fix = (
            "\nIt is a key/value cache (transformers' past_key_values): plan with the cache off, "
            "model.config.use_cache = False (or pass use_cache=False among the example kwargs)."
            if cache
            else ""
        )
        return (
            f"{type(model).__name__} returns a value autopar cannot handle: {_first_line(e)}\n"
            f"autopar needs tensors or (nested) tuples/lists/dicts of tensors as outputs.{fix}"
        )
    hint = (
        "The model branches on tensor values (data-dependent control flow): replace "
        "`if tensor...` with torch.where / torch.cond, or keep the submodule that does it out of "
        "the plan: annotations={'path.to.submodule': ap.opaque()} runs it replicated, untraced."
        if data_dep
        else "Make the model exportable with torch.export.export(model, args, strict=False) first; "
        "see https://pytorch.org/docs/stable/export.html for what it supports."
    )
    return f"torch.export could not trace {type(model).__name__}{where}: {type(e).__name__}: {_first_line(e)}\n{hint}"


def _user_frame(e: BaseException, text: str) -> str:
    m = re.findall(r'File "([^"]+)", line (\d+)', text)
    frames = [(f, int(n)) for f, n in m if "site-packages" not in f and "/torch/" not in f]
    if not frames:
        tb = traceback.extract_tb(e.__traceback__)
        frames = [
            (f.filename, f.lineno)
            for f in tb
            if "site-packages" not in f.filename and "/torch/" not in f.filename and "autopar/" not in f.filename
        ]
    if not frames:
        return ""
    f, n = frames[-1]
    return f" at {f}:{n}"


def _tied_parameters(model) -> dict[str, list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {names[0]: names for names in by_id.values() if len(names) > 1}


def _check_outputs(traced: Traced) -> None:
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    for v in pytree.tree_leaves(out.args[0])[: traced.n_user_outputs]:
        if not isinstance(v, (fx.Node, int, float, bool, type(None))):  # a str, an object, ...
            raise TraceError(
                f"The model returns {type(v).__name__} {v!r:.40} among its outputs; autopar "
                "needs tensors or (nested) tuples/lists/dicts of tensors: drop it from "
                "forward's result."
            )
        if isinstance(v, fx.Node) and not isinstance(v.meta.get("val"), (torch.Tensor, torch.SymInt)):
            raise TraceError(
                f"The model returns {type(v.meta.get('val')).__name__} at output "
                f"{v.name!r}; autopar needs tensors or (nested) tuples/dicts of tensors."
            )


def split_biases(graph: fx.Graph) -> None:
    """linear(x, w, b) -> linear(x, w) + b and addmm(b, x, w) -> mm(x, w) + b.

    Why: a row-parallel layer's bias must be added once after the reduction; as its own
    add node, propagation places it there like any other op.
    """
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.linear.default and len(node.args) > 2 and node.args[2] is not None:
            x, w, b = node.args[:3]
            _replace_with_add(graph, node, aten.linear.default, (x, w), b)
        elif node.target is aten.addmm.default and not node.kwargs and len(node.args) == 3:
            b, x, w = node.args
            _replace_with_add(graph, node, aten.mm.default, (x, w), b)


def _replace_with_add(graph, node, op, op_args, bias):
    with graph.inserting_before(node):
        core = graph.call_function(op, op_args)
        core.meta = dict(node.meta)
        add = graph.call_function(aten.add.Tensor, (core, bias))
        add.meta = dict(node.meta)
    node.replace_all_uses_with(add)
    graph.erase_node(node)
