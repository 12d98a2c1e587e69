"""ap.Float8: nn.Linear matmuls in float8 with torchao's recipes, equal to the serial float8 model.

``ap.plan(model, mesh, ..., float8=ap.Float8("tensorwise"))`` (or ``"rowwise"``,
``"rowwise_with_gw_hp"``: torchao's recipe names) runs every ``nn.Linear`` of the model (but
those matching ``skip``, fnmatch patterns of module paths) as torchao's ``Float8Linear``
with that recipe does. Before propagation each Linear's matmul (``aten.linear`` without its
bias, which the trace splits off into an add) becomes one ``autopar::float8_mm`` node (ops.py);
its rule and lowering (rule.py) place it as a Linear and reduce each scale's amax over the
axes that split its tensor, so every rank casts its piece with the serial model's scale. The
result is the serial torchao model's: forward, gradients and training steps (docs/float8.md
states the tolerances).

A model already converted with torchao's ``convert_to_float8_training`` plans the same way:
its Float8Linear modules are traced as Linears and then become float8_mm with their own recipe
(float8= may then be left out).

Example:
    >>> plan = ap.plan(model, ap.Mesh((2, 2), ("dp", "tp")), args=(x,), annotations=MLP_TP,
    ...                data_parallel="dp", float8=ap.Float8("tensorwise", skip=("lm_head",)))
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from dataclasses import dataclass

import torch

from autopar.errors import PlanError
from autopar.parallel.float8 import rule  # noqa: F401 - registers float8_mm's rule and lowering
from autopar.parallel.float8.recipes import RECIPES, config, recipe_of
from autopar.parallel.registry import register_technique
from autopar.parallel.technique import Technique
from autopar.trace.module_paths import module_path

aten = torch.ops.aten
F8 = torch.ops.autopar.float8_mm.default


def _linear_class(node) -> type | None:
    """The innermost module class ``node`` came from, where it is an nn.Linear (or subclass)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    cls = list(stack.values())[-1][1]
    if isinstance(cls, str):  # export may record the class by its qualified name
        return torch.nn.Linear if cls.rsplit(".", 1)[-1] in ("Linear", "Float8Linear") else None
    return cls if isinstance(cls, type) and issubclass(cls, torch.nn.Linear) else None


@contextlib.contextmanager
def _as_linears(model):
    found = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    try:
        for m in found:
            m.forward = functools.partial(torch.nn.Linear.forward, m)
        yield
    finally:
        for m in found:
            m.__dict__.pop("forward", None)


@register_technique
@dataclass(frozen=True)
class Float8(Technique):
    """torchao float8 training for the model's Linears (module docstring)."""

    recipe: str = "tensorwise"
    skip: tuple = ()  # fnmatch patterns of module paths whose Linears stay in high precision
    name = "float8"
    order = 25  # its graph rewrite is local to the Linears: after the layout techniques, before the casts

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise PlanError(
                f"ap.Float8(recipe={self.recipe!r}): the recipes are {', '.join(RECIPES)} (torchao's names)."
            )
        object.__setattr__(self, "skip", tuple(self.skip))

    @classmethod
    def of(cls, value):
        if isinstance(value, str):  # float8="rowwise"
            return cls(value)
        return super().of(value)

    @classmethod
    def implied(cls, model):
        """The Float8 a torchao-converted model asks for (its Float8Linears' recipe, its plain
        Linears skipped), or None for a model without Float8Linear."""
        converted = {p: m for p, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
        if not converted:
            return None
        recipes = {recipe_of(m.config) for m in converted.values()}
        if len(recipes) > 1:
            raise PlanError(
                f"Float8Linear modules with different recipes ({sorted(recipes)}): convert with one recipe."
            )
        plain = [p for p, m in model.named_modules() if isinstance(m, torch.nn.Linear) and p not in converted]
        return cls(recipes.pop(), tuple(plain))

    def tracing(self, model):
        """While tracing, a torchao Float8Linear is traced as the Linear it is (torch.export cannot
        trace its float8 tensor subclass); prepare_graph then makes it float8_mm."""
        return _as_linears(model)

    def validate(self, mesh, options, annotations) -> None:
        config(self.recipe)  # torchao present, or the PlanError saying how to install it

    def converts(self, path: str) -> bool:
        """Whether the Linear at module path ``path`` runs in float8."""
        return not any(fnmatch.fnmatchcase(path, p) for p in self.skip)

    def prepare_graph(self, traced) -> None:
        """Each converted Linear's ``aten.linear(x, w)`` as ``autopar::float8_mm(x, w, recipe)``."""
        graph = traced.gm.graph
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not aten.linear.default or len(node.args) > 2:
                continue
            if _linear_class(node) is None or not self.converts(module_path(node)):
                continue
            with graph.inserting_before(node):
                new = graph.call_function(F8, (*node.args[:2], self.recipe, [], [], [], 0))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        graph.lint()

    def describe(self, plan) -> str:
        n = sum(1 for node in plan.graph.nodes if node.target is F8)
        return f"float8 ({self.recipe}): {n} Linear matmuls in float8, each scale from the whole tensor's amax"

    def fields(self) -> dict:
        return {"recipe": self.recipe, "skip": list(self.skip)}

    @classmethod
    def from_fields(cls, fields: dict):
        return cls(fields["recipe"], tuple(fields.get("skip", ())))
