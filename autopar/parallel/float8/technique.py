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

``fp8_all_gather=True`` (torchao's ``enable_fsdp_float8_all_gather``, which a converted model's
config carries over): under ``ap.DataParallel(zero=3)`` the float8 weights are all-gathered as fp8
bytes, cast on each rank with the whole weight's scale (gather.py); tensorwise only, as torchao.

Example:
    >>> plan = ap.plan(model, ap.Mesh((2, 2), ("dp", "tp")), args=(x,), annotations=MLP_TP,
    ...                data_parallel="dp", float8=ap.Float8("tensorwise", skip=("lm_head",)))
    >>> ap.Float8("tensorwise", fp8_all_gather=True)   # with ap.DataParallel("dp", zero=3)
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from dataclasses import dataclass

import torch

from autopar.cost import make_comm
from autopar.cost.execution import OpExtra
from autopar.errors import PlanError
from autopar.parallel.float8 import rule  # noqa: F401 - registers float8_mm's rule and lowering
from autopar.parallel.float8.cost import cast_bytes, float8_linears, fsdp_shards, lm_heads, scale_seconds
from autopar.parallel.float8.rule import AMAX_BYTES, tp_pairs
from autopar.parallel.float8.gather import Float8Wire
from autopar.parallel.float8.recipes import RECIPES, config, recipe_of
from autopar.parallel.param_names import canonical_names
from autopar.parallel.registry import register_technique
from autopar.parallel.technique import Technique
from autopar.runtime.ring import ring_bytes
from autopar.sharding.propagate import layout_of
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
    # zero=3 gathers the float8 weights in fp8 (torchao's enable_fsdp_float8_all_gather): gather.py
    fp8_all_gather: bool = False
    name = "float8"
    order = 25  # its graph rewrite is local to the Linears: after the layout techniques, before the casts

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise PlanError(
                f"ap.Float8(recipe={self.recipe!r}): the recipes are {', '.join(RECIPES)} (torchao's names)."
            )
        object.__setattr__(self, "skip", tuple(self.skip))
        if self.fp8_all_gather and self.recipe != "tensorwise":
            raise PlanError(
                f"ap.Float8({self.recipe!r}, fp8_all_gather=True): the fp8 all-gather needs one scale per "
                "weight (torchao's enable_fsdp_float8_all_gather supports tensorwise only): use "
                "recipe='tensorwise' or fp8_all_gather=False."
            )

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
        recipes = {(recipe_of(m.config), m.config.enable_fsdp_float8_all_gather) for m in converted.values()}
        if len(recipes) > 1:
            raise PlanError(
                f"Float8Linear modules with different recipes or enable_fsdp_float8_all_gather "
                f"({sorted(recipes)}): convert with one config."
            )
        plain = [p for p, m in model.named_modules() if isinstance(m, torch.nn.Linear) and p not in converted]
        recipe, gather = recipes.pop()
        return cls(recipe, tuple(plain), gather)

    def tracing(self, model):
        """While tracing, a torchao Float8Linear is traced as the Linear it is (torch.export cannot
        trace its float8 tensor subclass); prepare_graph then makes it float8_mm."""
        return _as_linears(model)

    def validate(self, mesh, options, annotations) -> None:
        config(self.recipe)  # torchao present, or the PlanError saying how to install it

    def stored(self, plan, rank: int, fqn: str, local):
        """A converted model's weights as plain tensors: torchao wraps them for FSDP2's fp8 all-gather
        (WeightWithDynamicFloat8CastTensor, enable_fsdp_float8_all_gather), which autopar's zero=3
        does itself (gather.py); wrapped, zero=3's flat storage would not hold them."""
        return local._tensor if type(local).__name__ == "WeightWithDynamicFloat8CastTensor" else local

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

    def gather_wire(self, plan) -> dict:
        """With ``fp8_all_gather`` under zero=3: the weights gathered in fp8 (gather.py)."""
        if not self.fp8_all_gather or not any(t.gathers_weights() for t in plan.options.techniques):
            return {}
        if "float8_wire" not in plan.built:
            plan.built["float8_wire"] = fp8_gathered(plan, self.recipe)
        return plan.built["float8_wire"]

    def rewrite_program(self, plan, graph) -> None:
        """Each matmul reading a weight gathered in fp8 gets its fp8 data and scale (the gather's
        outputs after the stand-ins: gather.py's unpack)."""
        wired = [n for t in plan.options.techniques for n in t.wired_gathers(plan, graph)]
        for gather in wired:
            n = len(gather.args) - 2
            for item in [u for u in gather.users if u.args[1] < n]:
                bad = [u for u in item.users if u.target is not F8 or u.args[1] is not item]
                if bad:
                    raise PlanError(
                        f"float8 fp8_all_gather: {item.name} is read by {bad[0].name}, not a float8 matmul's "
                        "weight (an internal error: report it; fp8_all_gather=False avoids it)."
                    )
                with graph.inserting_after(item):
                    scale = graph.call_function(item.target, (gather, 2 * n + item.args[1]))
                    data = graph.call_function(item.target, (gather, n + item.args[1]))
                for u in list(item.users):
                    if u.target is F8:
                        u.args = (*u.args[:7], data, scale, *u.args[9:])

    def collectives(self, plan, symbols) -> list:
        """The gathered weights' amaxes: one all-reduce (max) of a float32 each, per forward."""
        wires = set(self.gather_wire(plan).values())
        if not wires:
            return []
        (wire,) = wires
        group = plan.mesh.group(tuple(plan.mesh.axis_names[a] for a in wire.axes), 0)
        n = sum(len(t.wired_params(plan, 0)) for t in plan.options.techniques)
        if len(group) < 2 or not n:
            return []
        label = plan.mesh.axis_label(wire.axes if len(wire.axes) > 1 else wire.axes[0])
        size = ring_bytes("all_reduce", AMAX_BYTES * n, len(group))
        why = f"float8 fp8 all-gather: the amax of the {n} weights gathered in fp8, all at once, so each rank scales its piece as serial"
        return [make_comm(symbols, "all_reduce", label, "forward", size, "float8 weight scales", "", reason=why)]

    @classmethod
    def op_extras(cls, plan, sy, profile, fused: bool) -> dict:
        """Under a profile pricing float8 (``profile.float8``: the search's, ap.predict's), the
        converted Linears' matmuls at the fp8 rate and their casts' bytes (cost.py's cast_bytes,
        ``fused``: compiled, a shared input cast once); with it or with ap.Float8 in the plan, the
        scales' amax all-reduces beside each Linear (cost.py's scale_seconds)."""
        priced = getattr(profile, "float8", False)
        fp8 = float8_linears(plan) if priced else {}
        casts = cast_bytes(plan, sy, fused, fsdp_shards(plan)) if priced and profile.memory_bandwidth else {}
        converted = priced or getattr(plan.options, "float8", None) is not None
        scales = scale_seconds(plan, profile) if converted and hasattr(profile, "link") else {}
        return {
            name: OpExtra(
                rate=profile.fp8_ratio if name in fp8 else None, nbytes=casts.get(name), seconds=scales.get(name)
            )
            for name in {*fp8, *casts, *scales}
        }

    def process_groups(self, plan) -> list:
        """The groups the fp8 gather's amax all-reduce runs over where they span several mesh axes
        (dp x tp): torch.distributed makes them on every rank (ap.parallelize)."""
        axes = {w.axes for w in self.gather_wire(plan).values()}
        if not axes or len(next(iter(axes))) < 2:
            return []
        names = tuple(plan.mesh.axis_names[a] for a in axes.pop())
        return sorted({plan.mesh.group(names, r) for r in plan.mesh.ranks()})

    def describe(self, plan) -> str:
        f8 = [node for node in plan.graph.nodes if node.target is F8]
        text = f"float8 ({self.recipe}): {len(f8)} Linear matmuls in float8, each scale from the whole tensor's amax"
        pairs = [tp_pairs(node) for node in f8]  # torchao's float8 tensor parallel (rule.py's Float8TensorParallel)
        inputs, outputs = sum(bool(g) for g, _ in pairs), sum(bool(s) for _, s in pairs)
        if inputs or outputs:
            text += (
                f"; tensor parallel in fp8: {inputs} read their input gathered, {outputs} gather their output gradient"
            )
        if self.fp8_all_gather:
            g = len(self.gather_wire(plan))
            text += f"; zero=3 gathers {g} weights in fp8" if g else "; fp8_all_gather: no zero=3 gather here"
        return text

    def fields(self) -> dict:
        return {"recipe": self.recipe, "skip": list(self.skip), "fp8_all_gather": self.fp8_all_gather}

    @classmethod
    def from_fields(cls, fields: dict):
        return cls(fields["recipe"], tuple(fields.get("skip", ())), fields.get("fp8_all_gather", False))

    # ---- the search's hooks (parallel/protocols/search.py)
    @classmethod
    def search_adds(cls, model, chosen: dict, auto):
        """Where ``auto`` prices the Linears in float8 (ap.Auto(float8=True), cost.py), the
        plan runs them so: every Linear but the LM head (torchtitan's filter), and where the chosen
        data parallel gathers weights (zero=3) it gathers them in fp8, as they were priced."""
        if not auto.choices_for(cls.name, auto.float8):
            return None
        gathers = any(t is not None and t.gathers_weights() for t in chosen.values() if hasattr(t, "gathers_weights"))
        return cls("tensorwise", skip=lm_heads(model), fp8_all_gather=gathers)

    @classmethod
    def priced_wire_params(cls, plan, profile) -> set:
        """Under a profile pricing float8 (``profile.float8``), the weights of the Linears float8
        training converts: a zero=3 plan the search returns gathers them in fp8."""
        return set(float8_linears(plan).values()) if getattr(profile, "float8", False) else set()


def fp8_gathered(plan, recipe: str) -> dict:
    """Canonical name -> Float8Wire of each weight zero=3 can gather in fp8: every read of it is a
    float8 matmul's weight, in the layout it is stored in (nothing between the gather and the
    matmul). The wire's axes: the shard group's and every axis splitting one of them."""
    canon, bad, names = canonical_names(plan), set(), set()
    axes = {a for t in plan.options.techniques for a in t.gather_axes(plan)}
    for node in plan.graph.nodes:
        fqn = plan.traced.param_fqn.get(node.name) if node.op == "placeholder" else None
        if fqn is None or not node.users:
            continue
        name, spec = canon.get(fqn, fqn), layout_of(node).spec
        direct = all(
            u.target is F8 and u.args[1] is node and u.args[0] is not node and layout_of(u).input_targets[1] == spec
            for u in node.users
        )
        (names if direct else bad).add(name)
        axes |= {a for a, p in enumerate(spec) if p.is_shard()} if direct else set()
    wire = Float8Wire(recipe, tuple(sorted(axes)))
    return {n: wire for n in sorted(names - bad)}
