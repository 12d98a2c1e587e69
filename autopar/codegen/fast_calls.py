"""The emitted program's Python, as cheap per call as hand-written torch code.

fx writes every node as a call of its op overload (``torch.ops.aten.linear.default(x, w, b)``):
a Python ``__call__`` and the dispatcher's generic, schema-driven argument handling, about
2.5 us more per op than the ``torch.*`` function a hand-written module calls (``F.linear``),
and the collectives go through the dispatcher into their autograd.Function (about 10 us
more than calling it). At a small hidden size that was most of the distance between a rank
module and hand-written Megatron. The graph keeps its op overloads (every analysis reads
them); only the generated code changes, through fx's body transformer:

- an aten op of ``BINDINGS`` is written as its ``torch`` binding (``torch._C._nn.linear(...)``):
  the same aten op, reached through torch's Python argument parser, and traced as itself by
  torch.compile, make_fx and export;
- an autopar collective is written ``eager_autopar.<op>.default(...)``: in plain eager mode
  (collectives.plain_eager) its call site's autograd.Function directly, otherwise
  (torch.compile, a tracing mode) the op itself, so compiled and traced programs hold the ops;
- a parameter or buffer is read from its module's ``_parameters`` / ``_buffers`` dict, each
  module on the way bound once per forward (``self._modules['blocks']._modules['0']``), where
  fx writes the attribute path (``getattr(self.blocks, "0").ln_1.weight``: a Python
  ``nn.Module.__getattr__`` call per step of the path, three or four per tensor, about 1 us
  each time). The dicts are read at every call, so a tensor replaced by the module's own API
  (``load_state_dict(assign=True)``, ``module.to``, ``torch.func.functional_call``) is read
  anew; what is not a registered parameter or buffer of the plan keeps fx's attribute path;
- a program whose inputs are plain positional leaves skips fx's ``tree_flatten_spec`` of
  them, and one whose outputs are a flat tuple or list of values returns it as such instead of
  ``tree_unflatten`` (the same values, without pytree's Python walk).

Example:
    >>> graph._codegen = fast_codegen(graph._codegen, {"fc.weight": "_parameters"})
    >>> "torch._C._nn.linear(" in fx.GraphModule(root, graph).code
    True
"""

from __future__ import annotations

import re

import torch
from torch.fx.graph import CodeGen, _format_target, _PyTreeCodeGen

from autopar.runtime.collectives import eager_caller

aten = torch.ops.aten

# aten overload -> the torch binding of the same op (same schema names and order, same overload
# picked by the argument parser for the arguments a traced graph holds, same defaults for the
# arguments fx leaves out; the one-call-a-step ops are not worth a row)
BINDINGS = {
    aten.add.Tensor: "torch.add",
    aten.mul.Tensor: "torch.mul",
    aten.linear.default: "torch._C._nn.linear",
    aten.matmul.default: "torch.matmul",
    aten.layer_norm.default: "torch.layer_norm",
    aten.gelu.default: "torch._C._nn.gelu",
    aten.dropout.default: "torch.dropout",
    aten.transpose.int: "torch.transpose",
    aten.permute.default: "torch.permute",
    aten.reshape.default: "torch.reshape",
    aten.view.default: "torch.Tensor.view",
    aten.unbind.int: "torch.unbind",
    aten.softmax.int: "torch.softmax",
    aten.masked_fill.Scalar: "torch.masked_fill",
    aten.embedding.default: "torch.embedding",
    aten.tril.default: "torch.tril",
    aten.bitwise_not.default: "torch.bitwise_not",
    aten.sym_size.int: "torch.Tensor.size",
    aten.arange.default: "torch.arange",
    aten.ones.default: "torch.ones",
    aten.zeros.default: "torch.zeros",
    aten.full.default: "torch.full",
    aten.tanh.default: "torch.tanh",
    aten.relu.default: "torch.relu",
    aten.sigmoid.default: "torch.sigmoid",
    aten.silu.default: "torch._C._nn.silu",
    aten.exp.default: "torch.exp",
    aten.neg.default: "torch.neg",
    aten.rsqrt.default: "torch.rsqrt",
    aten.sub.Tensor: "torch.sub",
    aten.div.Tensor: "torch.div",
    aten.pow.Tensor_Scalar: "torch.pow",
    aten.ne.Scalar: "torch.ne",
    aten.mean.dim: "torch.mean",
    aten.sum.dim_IntList: "torch.sum",
    aten.t.default: "torch.t",
    aten.unsqueeze.default: "torch.unsqueeze",
    aten.squeeze.dim: "torch.squeeze",
    aten.select.int: "torch.select",
    aten.flatten.using_ints: "torch.flatten",
    aten.cat.default: "torch.cat",
    aten.clone.default: "torch.clone",
    # its binding's reduction default parses as 0 (None), not the schema's 1 (Mean): a wrapper
    # passes every argument (one Python frame, still less than the op overload's call)
    aten.cross_entropy_loss.default: "autopar_fast.cross_entropy_loss",
}
_TEXT = {f"torch.ops.aten.{op._schema.name.split('::')[1]}.{op._overloadname}(": f"{b}(" for op, b in BINDINGS.items()}
_CALL = re.compile(r"torch\.ops\.(aten|autopar)\.(\w+)\.(\w+)\(")
_ASSIGN = re.compile(r"^(\w+) = ([^;\n]*)(.*)$", re.S)  # a body line: name = expression[;  deletions]
EAGER_AUTOPAR = "eager_autopar"
MODULE_LOCAL = "autopar_mod_"  # the generated code's locals holding the modules on the tensors' paths


class _Namespace:
    """Attributes for the generated code (hashable, unlike SimpleNamespace: fx keys globals)."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def _cross_entropy_loss(x, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    return torch._C._nn.cross_entropy_loss(x, target, weight, reduction, ignore_index, label_smoothing)


AUTOPAR_FAST = "autopar_fast"
_WRAPPERS = _Namespace(cross_entropy_loss=_cross_entropy_loss)  # the table's autopar_fast.* calls


class _FastCalls:
    """Mixed into an fx CodeGen: rewrites the generated body (see the module docstring)."""

    def _fast_init(self, slots: dict | None) -> None:
        self._body_transformer = self._rewrite
        self._autopar = _Namespace()
        self._slots = dict(slots or {})  # target -> "_parameters" | "_buffers"

    def _rewrite(self, body: list[str]) -> list[str]:
        body = [_CALL.sub(self._replace, line) for line in body]
        return self._direct_reads(body) if self._slots else body

    def _direct_reads(self, body: list[str]) -> list[str]:
        """The lines reading a parameter or buffer through its attribute path, rewritten to read
        its owner's dict (see the module docstring); each module on the way is bound to a local
        once, on the line before its first use."""
        reads = {_format_target("self", t): t for t in self._slots}
        bound = {"": "self"}  # module path -> the local holding it
        out = []
        for entry in body:
            m = _ASSIGN.match(entry)
            target = reads.get(m.group(2)) if m else None
            if target is None:
                out.append(entry)
                continue
            path, _, leaf = target.rpartition(".")
            lines = self._bind(path, bound)
            lines.append(f"{m.group(1)} = {bound[path]}.{self._slots[target]}[{leaf!r}]{m.group(3)}")
            out.append("\n".join(lines[:-1] + [""]) + lines[-1] if len(lines) > 1 else lines[0])
        return out

    def _bind(self, path: str, bound: dict) -> list[str]:
        """Lines binding module ``path`` (and its parents not bound yet) to locals."""
        if path in bound:
            return []
        parent, _, name = path.rpartition(".")
        lines = self._bind(parent, bound)
        bound[path] = f"{MODULE_LOCAL}{len(bound) - 1}"
        return [*lines, f"{bound[path]} = {bound[parent]}._modules[{name!r}]"]

    def _replace(self, m: re.Match) -> str:
        ns, name, overload = m.groups()
        if ns == "aten":
            return _TEXT.get(m.group(0), m.group(0))
        if overload != "default":
            return m.group(0)
        if not hasattr(self._autopar, name):
            caller = eager_caller(name)
            if caller is None:  # not a collective (random draws): the op as fx wrote it
                return m.group(0)
            setattr(self._autopar, name, _Namespace(default=caller))
        return f"{EAGER_AUTOPAR}.{name}.default("

    def additional_globals(self) -> list:
        return [*super().additional_globals(), (EAGER_AUTOPAR, self._autopar), (AUTOPAR_FAST, _WRAPPERS)]


class FastCodeGen(_FastCalls, CodeGen):
    def __init__(self, slots: dict | None = None):
        super().__init__()
        self._fast_init(slots)


class FastPyTreeCodeGen(_FastCalls, _PyTreeCodeGen):
    """fx's pytree codegen, without the pytree walks where the inputs and outputs are flat."""

    def __init__(self, pytree_info, slots: dict | None = None):
        super().__init__(pytree_info)
        self._fast_init(slots)

    def gen_var_bindings(self, fn_args, free_vars, expanded_def) -> str:
        if _flat_inputs(self.pytree_info.in_spec, fn_args, free_vars):
            return self._format_annotations(free_vars, expanded_def)  # the arguments are the leaves
        return super().gen_var_bindings(fn_args, free_vars, expanded_def)

    def generate_output(self, output_args, *, descs=None, repr_fn=None) -> str:
        spec = self.pytree_info.out_spec if self.pytree_info else None
        if spec is not None and descs is None and _flat_outputs(spec, output_args):
            values = [(repr_fn or repr)(a) for a in output_args]
            if spec.is_leaf():
                return f"return {values[0]}"
            return f"return ({', '.join(values)},)" if spec.type is tuple else f"return [{', '.join(values)}]"
        return super().generate_output(output_args, descs=descs, repr_fn=repr_fn)


def _flat_inputs(spec, fn_args: list, free_vars: list) -> bool:
    """The forward's arguments (after self) are the leaves, in order: positional arguments
    only (no kwargs dict in the spec, or an empty one), each a leaf."""
    if spec is None:
        return False
    args = spec
    if spec.type is tuple and spec.num_children == 2 and spec.child(1).type is dict:
        if spec.child(1).num_children:
            return False
        args = spec.child(0)
    if args.type not in (tuple, list) or not all(args.child(i).is_leaf() for i in range(args.num_children)):
        return False
    names = [a for a in fn_args if a != "self"]
    leaves = [v.split(":")[0].split("#")[0].strip() for v in free_vars if v != "self"]
    return names == leaves and len(names) == args.num_children


def _flat_outputs(spec, output_args) -> bool:
    """The output is one value, or a tuple or list of them, as the program returns them."""
    if not isinstance(output_args, (tuple, list)):
        return False
    if spec.is_leaf():
        return len(output_args) == 1
    return (
        spec.type in (tuple, list)
        and spec.num_children == len(output_args)
        and all(spec.child(i).is_leaf() for i in range(spec.num_children))
    )


def fast_codegen(codegen: CodeGen, slots: dict | None = None) -> CodeGen:
    """``codegen`` (fx's plain or pytree one) with the fast calls; another kind is kept as is.
    ``slots``: the program's parameters and buffers, target -> the dict of its module holding
    it (``"_parameters"`` or ``"_buffers"``), read directly."""
    if type(codegen) is CodeGen:
        return FastCodeGen(slots)
    if type(codegen) is _PyTreeCodeGen:
        return FastPyTreeCodeGen(codegen.pytree_info, slots)
    return codegen
