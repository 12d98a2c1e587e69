"""ap.opaque(): keep a submodule out of the trace; every rank runs it whole, as one op.

A submodule that torch.export cannot trace (data-dependent control flow, Python side
effects, ...) is traced as a single call of the custom op ``autopar::opaque_call(key,
tensors)``: its parameters, buffers and tensor inputs go in as one list, its tensor outputs
come out as one list, and the op's implementation calls the original submodule through
``torch.func.functional_call`` with the tensors it was given. autopar has no sharding rule
for the op, so it runs replicated: split inputs are gathered first (a warning says so).

Gradients: the op's backward recomputes the submodule under autograd (like activation
checkpointing) and differentiates it, so the submodule's parameters get exact gradients.
Its buffers are read, not updated (running statistics of a BatchNorm inside stay as they
were), and random ops inside would draw again in the backward.

Shapes: the op's output shapes for tracing are recorded by running the model once on the
example inputs; an output dim equal to an input's dynamic dim follows it (batch, sequence).

Example:
    >>> plan = ap.plan(model, mesh, args=(x,), annotations={"encoder.weird": ap.opaque(),
    ...                                                   "head": ap.colwise("tp")})
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
import threading
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.func import functional_call

from autopar.placement import Annotation
from autopar.errors import AnnotationError, close_matches


@dataclass(frozen=True)
class opaque(Annotation):
    """Run the matched submodules untraced and replicated (see the module docstring)."""

    def __repr__(self) -> str:
        return "opaque()"


# Marks a tensor's slot among a call's input leaves: None cannot, it is a value HF passes
# (T5's attention gets mask=None, position_bias=None, past_key_values=None).
TENSOR = object()


@dataclass
class _Site:
    """One traced call of an opaque submodule."""

    module: torch.nn.Module
    path: str
    names: list[str]  # parameter and buffer names, in the order they are passed
    in_spec: object = None
    consts: list = field(default_factory=list)  # non-tensor input leaves (TENSOR where a tensor goes)
    out_spec: object = None
    example_outputs: list = field(default_factory=list)  # (shape, dtype) per output, recorded
    example_inputs: list = field(default_factory=list)  # shapes of the tensor inputs, recorded

    def run(self, tensors):
        n = len(self.names)
        state = dict(zip(self.names, tensors[:n]))
        it = iter(tensors[n:])
        leaves = [next(it) if c is TENSOR else c for c in self.consts]
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        # functional_call swaps the module's tensors in and out: simulated ranks (threads)
        # share the module, so one call at a time (it holds no collective: no deadlock)
        with _LOCK:
            return functional_call(self.module, state, tuple(args), kwargs, tie_weights=False)


_LOCK = threading.RLock()


_SITES: dict[str, _Site] = {}
_COUNTER = itertools.count()


@torch.library.custom_op("autopar::opaque_call", mutates_args=())
def opaque_call(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Call the opaque submodule registered under ``key`` with its state and inputs."""
    site = _SITES[key]
    outs = pytree.tree_leaves(site.run(list(tensors)))
    ptrs = {t.untyped_storage().data_ptr() for t in tensors}
    # a custom op may not return its inputs or views of them
    return [o.clone() if o.untyped_storage().data_ptr() in ptrs else o for o in outs]


@opaque_call.register_fake
def _(key, tensors):
    site = _SITES[key]
    inputs = list(tensors)[len(site.names) :]
    return [
        torch.empty(
            _fake_shape(shape, inputs, site.example_inputs), dtype=dtype, device=tensors[0].device if tensors else "cpu"
        )
        for shape, dtype in site.example_outputs
    ]


def _fake_shape(shape, inputs, example_inputs):
    """Each output dim follows the first input dim of the same example size (dynamic or not)."""
    out = []
    for d, size in enumerate(shape):
        found = size
        candidates = [(i, d) for i in range(len(inputs))] + [
            (i, k) for i, s in enumerate(example_inputs) for k in range(len(s))
        ]
        for i, k in candidates:
            if (
                i < len(example_inputs)
                and i < len(inputs)
                and k < len(example_inputs[i])
                and example_inputs[i][k] == size
                and k < inputs[i].dim()
            ):
                found = inputs[i].shape[k]
                break
        out.append(found)
    return out


def _setup(ctx, inputs, output):
    ctx.key, ctx.tensors = inputs[0], list(inputs[1])


def _backward(ctx, grads):
    site = _SITES[ctx.key]
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in ctx.tensors]
        outs = pytree.tree_leaves(site.run(leaves))
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [t for t in leaves if t.requires_grad]
        got = (
            torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
            if pairs and wanted
            else [None] * len(wanted)
        )
    it = iter(got)
    return None, [next(it) if t.requires_grad else None for t in leaves]


opaque_call.register_autograd(_backward, setup_context=_setup)


def opaque_paths(annotations: dict | None, model: torch.nn.Module) -> list[str]:
    """Module paths matched by ap.opaque() patterns (every pattern must match a module)."""
    names = [n for n, _ in model.named_modules() if n]
    paths = []
    for pattern, ann in (annotations or {}).items():
        if isinstance(ann, opaque):
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise AnnotationError(
                    f"ap.opaque() pattern {pattern!r} matches no submodule. "
                    f"Closest module paths: {close_matches(pattern, names)}."
                )
            paths += [h for h in hits if not any(h.startswith(p + ".") for p in paths)]
    return sorted(set(paths))


@contextlib.contextmanager
def keep_opaque(model: torch.nn.Module, paths: list[str], args: tuple, kwargs: dict):
    """While tracing, each submodule at ``paths`` is one ``opaque_call`` op."""
    if not paths:
        yield
        return
    modules = dict(model.named_modules())
    records = _record(model, [modules[p] for p in paths], args, kwargs)
    try:
        for path in paths:
            modules[path].forward = _wrapper(modules[path], path, records[id(modules[path])])
        yield
    finally:
        for path in paths:
            modules[path].__dict__.pop("forward", None)


def _record(model, modules, args, kwargs) -> dict:
    """Run the model once on the example; note each opaque call's input and output shapes."""
    records: dict[int, list] = {id(m): [] for m in modules}

    def hook(module, a, k, out):
        ins = [tuple(t.shape) for t in pytree.tree_leaves((a, k)) if isinstance(t, torch.Tensor)]
        leaves = pytree.tree_leaves(out)
        if not all(isinstance(o, torch.Tensor) for o in leaves):
            raise AnnotationError(
                f"ap.opaque(): {type(module).__name__} returns non-tensor values "
                f"({[type(o).__name__ for o in leaves]}); an opaque submodule must "
                "return tensors or (nested) tuples/lists/dicts of tensors."
            )
        spec = pytree.tree_structure(out)
        records[id(module)].append((ins, [(tuple(o.shape), o.dtype) for o in leaves], spec))

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    try:
        with torch.no_grad():
            model(*args, **(kwargs or {}))
    finally:
        for h in handles:
            h.remove()
    return records


def _wrapper(module, path, records):
    calls = itertools.count()
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]

    def forward(*args, **kwargs):
        n = next(calls)
        # the n-th call of a forward (export may run forward twice: dynamic, then static)
        ins, outs, out_spec = records[n % len(records)]
        leaves, in_spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        site = _Site(
            module,
            path,
            names,
            in_spec,
            [TENSOR if isinstance(x, torch.Tensor) else x for x in leaves],
            out_spec=out_spec,
            example_outputs=outs,
            example_inputs=ins,
        )
        state = dict(module.named_parameters())
        state.update(module.named_buffers())
        key = f"{path}#{next(_COUNTER)}"
        _SITES[key] = site
        result = torch.ops.autopar.opaque_call(key, [state[n] for n in names] + tensors)
        return pytree.tree_unflatten(list(result), site.out_spec)

    return forward
