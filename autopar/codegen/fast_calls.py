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
  (collectives.plain_eager) its autograd.Function directly, otherwise (torch.compile, a
  tracing mode) the op itself, so compiled and traced programs hold the ops.

Example:
    >>> graph._codegen = fast_codegen(graph._codegen)   # before the GraphModule is made
    >>> "torch._C._nn.linear(" in fx.GraphModule(root, graph).code
    True
"""

from __future__ import annotations

import re

import torch
from torch.fx.graph import CodeGen, _PyTreeCodeGen

from autopar.runtime.collectives import eager_caller

aten = torch.ops.aten

# aten overload -> the torch binding of the same op (same schema names and order, same overload
# picked by the argument parser for the arguments a traced graph holds, same defaults for the
# arguments fx leaves out: not cross_entropy_loss, whose binding reads its reduction=Mean default
# otherwise; the one-call-a-step ops are not worth a row)
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
}
_TEXT = {f"torch.ops.aten.{op._schema.name.split('::')[1]}.{op._overloadname}(": f"{b}(" for op, b in BINDINGS.items()}
_CALL = re.compile(r"torch\.ops\.(aten|autopar)\.(\w+)\.(\w+)\(")
EAGER_AUTOPAR = "eager_autopar"


class _Namespace:
    """Attributes for the generated code (hashable, unlike SimpleNamespace: fx keys globals)."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


class _FastCalls:
    """Mixed into an fx CodeGen: rewrites the generated body (see the module docstring)."""

    def _fast_init(self) -> None:
        self._body_transformer = self._rewrite
        self._autopar = _Namespace()

    def _rewrite(self, body: list[str]) -> list[str]:
        return [_CALL.sub(self._replace, line) for line in body]

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
        return [*super().additional_globals(), (EAGER_AUTOPAR, self._autopar)]


class FastCodeGen(_FastCalls, CodeGen):
    def __init__(self):
        super().__init__()
        self._fast_init()


class FastPyTreeCodeGen(_FastCalls, _PyTreeCodeGen):
    def __init__(self, pytree_info):
        super().__init__(pytree_info)
        self._fast_init()


def fast_codegen(codegen: CodeGen) -> CodeGen:
    """``codegen`` (fx's plain or pytree one) with the fast calls; another kind is kept as is."""
    if type(codegen) is CodeGen:
        return FastCodeGen()
    if type(codegen) is _PyTreeCodeGen:
        return FastPyTreeCodeGen(codegen.pytree_info)
    return codegen
