"""Context parallel: ``ap.ContextParallel(axis, method=...)`` as ``context_parallel=`` of ap.plan /
ap.parallelize. Long sequences are split across the ranks of one mesh axis.

- Every user input of two or more dims is split on its sequence dim (``seq_dim``, 1: (batch,
  sequence, ...)) over ``axis`` unless an annotation placed it on that axis: ``plan.local_inputs``
  gives each rank 1/cp of every sequence (rank k: positions [k L/cp, (k+1) L/cp)).
- Token-wise ops (embeddings, norms, MLPs, the LM head) run on the local tokens as the layouts
  say; positions built with ``arange`` (RoPE, learned positions) are cut to the rank's positions
  by the ordinary replicated-to-split slice; the loss over split rows divides by the global count.
- ``scaled_dot_product_attention`` (causal or not, GQA, a mask given to it) meets the local
  queries with every key (context/attention_lowering.py): ``method="allgather"`` gathers K and V
  on the axis (backward reduce-scatters their gradients); ``method="ring"`` passes K/V blocks
  around the axis, merges the partial results with the log-sum-exp correction and skips the
  blocks the causal mask hides; its backward is exact (context/block_attention.py).
- An attention the rule cannot place on the split sequence (attention dropout, a mask
  broadcast along the keys) would gather the whole sequence: PlanError, naming the module.
  A model that reads or returns a KV cache (``past_key_values``) is refused too.

- ``load_balance=True``: each rank holds the head-tail pair of chunks r and 2cp-1-r of every
  split dim (placement.py's orders), so causal attention's work is the same on every rank. The
  order is a placement (``Shard(d, order="zigzag")``, sharding/piece_order.py says which values
  hold it): every redistribution on the axis reorders around its collective, ``plan.local_inputs``
  cuts the inputs so, and positions built with
  ``arange`` arrive permuted to match (RoPE, learned positions, HF's causal mask stay right).
  Every dim split on the axis must divide by 2 cp (PlanError otherwise).
- The eager attention form (matmul, scale, mask, softmax, matmul: HF's "eager", nanoGPT) is
  rewritten into one SDPA node before planning (context/eager_attention.py).

Example:
    >>> plan = ap.plan(model, ap.Mesh((4,), ("cp",)), args=(ids, labels),
    ...                context_parallel=ap.ContextParallel("cp", method="ring"))
    >>> plan.local_inputs(1, ids, labels)[0][0].shape     # (B, L/4)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import sympy
import torch

from autopar.cost.collectives import make_comm
from autopar.errors import PlanError
from autopar.mesh import SubAxis
from autopar.parallel.registry import register_technique
from autopar.parallel.technique import Technique
from autopar.parallel.context.attention_lowering import CONTEXT_ATTENTION, call_splits, local_heads, ulysses_repeat
from autopar.parallel.context.eager_attention import fuse_eager_attention
from autopar.placement import ZIGZAG, Replicate, Shard
from autopar.sharding.piece_order import piece_orders
from autopar.sharding.propagate import layout_of
from autopar.sharding.redistribute import Step, step_bytes
from autopar.sharding.rules.attention import ATTENTION_KERNELS
from autopar.trace.module_paths import module_path

METHODS = ("allgather", "ring", "ulysses")


@register_technique
@dataclass(frozen=True)
class ContextParallel(Technique):
    """``axis`` a mesh axis name and ``method`` one of METHODS; or hybrid: two adjacent axes
    (outer, inner) and a method per axis, "ring" or "allgather" on the outer one and "ulysses" on
    the inner one: ``ContextParallel(("cp_ring", "cp_uly"), method=("ring", "ulysses"))``. The two
    become one axis to plan on (``reshape_mesh``: the sequence split over both, rank (r, u) holding
    piece r |inner| + u), whose method is the pair."""

    axis: str | tuple
    method: str | tuple = "allgather"
    load_balance: bool = False
    seq_dim: int = 1

    name = "context_parallel"
    order = 15  # after data parallel (the batch split), before the others

    def __post_init__(self):
        for name in ("axis", "method"):  # a plan file's JSON lists back as tuples
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        axes = (self.axis,) if isinstance(self.axis, str) else self.axis
        if not isinstance(axes, tuple) or not 1 <= len(axes) <= 2 or not all(isinstance(a, str) for a in axes):
            raise PlanError(f"ContextParallel axis must be a mesh axis name (or two, hybrid), got {self.axis!r}.")
        methods = (self.method,) if isinstance(self.method, str) else self.method
        if not isinstance(methods, tuple) or any(m not in METHODS for m in methods):
            raise PlanError(
                f"ContextParallel(method={self.method!r}): 'allgather' (K/V gathered: short sequences, "
                "GQA), 'ring' (K/V blocks passed around the axis: memory ~1/cp) or 'ulysses' (an "
                "all-to-all to a head split: the heads must split over the axis); a pair for two axes "
                "(hybrid: ('ring', 'ulysses'))."
            )
        if len(methods) == 2 and (methods[0] == "ulysses" or methods[1] != "ulysses" or len(set(axes)) < len(axes)):
            raise PlanError(
                f"ContextParallel({self.axis!r}, method={self.method!r}): hybrid context parallel takes two "
                "axes, outer first, and one method per axis: 'ring' or 'allgather' on the outer one (across "
                "nodes), 'ulysses' on the inner one (inside a node), e.g. "
                "ContextParallel(('cp_ring', 'cp_uly'), method=('ring', 'ulysses'))."
            )
        if len(axes) == 2 and len(methods) != 2:
            raise PlanError(f"ContextParallel({self.axis!r}, method={self.method!r}): two axes take a method each.")
        if isinstance(self.seq_dim, bool) or not (isinstance(self.seq_dim, int) and self.seq_dim >= 1):
            raise PlanError(f"ContextParallel(seq_dim={self.seq_dim!r}): the inputs' sequence dim, an int >= 1.")

    def reshape_mesh(self, mesh):
        """Hybrid: the two axes merged into one (outer-major: Mesh.merge_axes), the method pair on it."""
        if isinstance(self.axis, str):
            return mesh, self
        outer, inner = self.axis
        i, j = mesh.axis_index(outer), mesh.axis_index(inner)
        if j != i + 1:
            raise PlanError(
                f"hybrid context parallel on {self.axis}: the mesh {mesh.axis_names} must have {inner!r} (Ulysses, "
                f"inside a node) right after {outer!r} ({self.method[0]}, across nodes); reorder the mesh's axes."
            )
        return mesh.merge_axes(outer, inner), dataclasses.replace(self, axis=f"{outer}_{inner}")

    @classmethod
    def of(cls, value):
        """``context_parallel="cp"`` (an axis name, the defaults) or an ap.ContextParallel."""
        if value is None or isinstance(value, ContextParallel):
            return value
        if isinstance(value, str):
            return cls(value)
        raise PlanError(f"context_parallel={value!r}: give a mesh axis name ('cp') or ap.ContextParallel('cp', ...).")

    def process_groups(self, plan) -> list:
        """Hybrid's inner (Ulysses) and outer (ring or all-gather) groups of the merged axis: not
        one mesh axis' groups (ap.parallelize makes them on every rank, in this order)."""
        part = next((p for p in plan.mesh.parts if p[0] == self.axis), None)
        if isinstance(self.method, str) or part is None:
            return []
        out, i = [], plan.mesh.axis_index(self.axis)
        for kind in ("inner", "outer"):
            for rank in plan.mesh.ranks():
                group = plan.mesh.group(SubAxis(i, part[3], kind), rank)
                if len(group) > 1 and group not in out:
                    out.append(group)
        return out

    def validate(self, mesh, options, annotations: dict) -> None:
        mesh.axis_index(self.axis)
        if not isinstance(self.method, str) and not any(part[0] == self.axis for part in mesh.parts):
            raise PlanError(f"ContextParallel({self.axis!r}, method={self.method!r}): a method pair takes two axes.")
        dp = options.data_parallel
        if dp is not None and dp.axis == self.axis:
            raise PlanError(
                f"context_parallel and data_parallel both on axis {self.axis!r}: one axis splits the batch, "
                "the other the sequence; give them different mesh axes."
            )

    def token_axes(self) -> tuple:
        return (self.axis,)  # the sequence's tokens: ZeRO may shard over the axis (DataParallel.shard_axes)

    def seed_inputs(self, seeds, mesh, inputs: dict) -> None:
        axis = mesh.axis_index(self.axis)
        n = mesh.shape[axis]
        if n == 1:
            return
        if self.load_balance:  # the zig-zag order: 2 chunks per rank of every split dim
            seeds.piece_multiple[axis] = 2
        for name, val in inputs.items():
            if not isinstance(val, torch.Tensor) or val.dim() <= self.seq_dim:
                continue
            current = list(seeds.inputs.get(name, (Replicate(),) * mesh.ndim))
            placed = name in seeds.inputs and not seeds.reasons.get(name, "").startswith("batch dim split")
            if placed or any(p.is_shard(self.seq_dim) for p in current):
                continue  # placed by an annotation (ap.place), or its sequence split elsewhere
            size = val.shape[self.seq_dim]
            hint = int(size.node.hint) if isinstance(size, torch.SymInt) and size.node.hint is not None else size
            pieces = 2 * n if self.load_balance else n
            if isinstance(hint, int) and hint % pieces:
                raise PlanError(
                    f"context_parallel on {self.axis!r}: input {name!r} has sequence length {hint} (dim "
                    f"{self.seq_dim}), which does not split into {pieces} equal pieces"
                    + (" (load_balance: 2 chunks per rank)" if self.load_balance else "")
                    + f". Pad the sequence to a multiple of {pieces}, or place the input yourself "
                    f"(annotations={{{name!r}: ap.place(...)}})."
                )
            current[axis] = Shard(self.seq_dim)
            seeds.inputs[name] = tuple(current)
            seeds.reasons[name] = f"sequence dim {self.seq_dim} split on context-parallel axis {self.axis!r}"

    def attention_method(self, axis: str) -> str | None:
        return self.method if axis == self.axis else None

    def prepare_graph(self, traced) -> None:
        """The eager matmul-softmax-matmul attention (HF ``attn_implementation="eager"``, nanoGPT)
        as one SDPA node, so that its rule and lowering keep the sequence split."""
        fuse_eager_attention(traced)

    def piece_order(self, axis: str) -> str | None:
        return ZIGZAG if self.load_balance and axis == self.axis else None

    def after_plan(self, plan):
        """Refuse a KV cache and an attention that gathers the split sequence; the attention
        calls lowered on the axis (kept as ``plan.built["context_parallel"]``)."""
        cache = [n for n in plan.traced.user_inputs if "past_key_values" in n]
        if cache or "past_key_values" in str(plan.traced.out_spec):
            raise PlanError(
                f"context_parallel on {self.axis!r}: the model reads or returns a KV cache (past_key_values"
                f"{': input ' + cache[0] if cache else ' in its outputs'}); its cached keys would be the rank's "
                "piece of the sequence only. Plan it without the cache (use_cache=False) for training and prefill."
            )
        axis = plan.mesh.axis_index(self.axis)
        if plan.mesh.shape[axis] == 1:
            return []  # one rank holds every sequence: nothing to do
        if not any(spec is not None and isinstance(spec[axis], Shard) for spec in plan.input_specs):
            raise PlanError(
                f"context_parallel on {self.axis!r}: no input is split on the axis (a plan made without it "
                "and given it by Plan.with_options, or a model without sequence inputs). Pass "
                "context_parallel= to ap.plan, which splits the sequences before placing the ops."
            )
        lowered = []
        for node in plan.graph.nodes:
            if (
                node.op != "call_function"
                or getattr(node.target, "__name__", "").split(".")[0] not in ATTENTION_KERNELS
            ):
                continue
            lay = node.meta.get("autopar")
            chosen = lay.strategies[axis] if lay is not None and lay.strategies else None
            if chosen is not None and chosen.lowering is CONTEXT_ATTENTION:
                self._check_heads(plan, node, axis)
                lowered.append(node.name)
                continue
            q = node.args[0]
            q_spec = q.meta["autopar"].spec if "autopar" in q.meta else None
            if q_spec is not None and isinstance(q_spec[axis], Shard):
                raise PlanError(
                    f"context_parallel on {self.axis!r}: the attention in module {module_path(node)!r} "
                    f"({node.name}) cannot run on the split sequence ({lay.reason if lay else 'no rule'}); "
                    "it would gather the whole sequence on every rank. Context parallel takes "
                    "scaled_dot_product_attention without dropout, causal or with a mask over "
                    "(..., queries, keys); drop the custom mask or its key broadcast, or set dropout to 0."
                )
        if self.load_balance:
            self._check_zigzag(plan, axis)
        return lowered

    def _check_heads(self, plan, node, axis: int) -> None:
        """Ulysses splits each rank's heads over the axis: they must divide (K/V heads are
        repeated as Megatron does where they are fewer, context/ulysses.kv_repeat)."""
        uly = call_splits(plan, node, axis)[0]
        if uly is None:
            return
        try:
            ulysses_repeat(plan, node, uly)
        except ValueError as e:
            heads = local_heads(plan, node, 0)
            raise PlanError(
                f"context_parallel on {plan.mesh.axis_label(uly.key)!r} by 'ulysses': the attention in module {module_path(node)!r} "
                f"({node.name}) has {heads} query heads per rank, which the {uly.size(plan.mesh)} ranks of the "
                f"axis cannot split ({e}). Use method='ring' or 'allgather', a cp size dividing the heads "
                "(after tp's split), or fewer tp ranks."
            ) from None

    def _check_zigzag(self, plan, axis: int) -> None:
        """Every dim split on the axis must cut into 2 x cp chunks (per block) for the zig-zag
        order, at the batch each program runs on (a pipeline's micro-batch: ``batch_pieces``)."""
        n = plan.mesh.shape[axis]
        pieces = math.prod(t.batch_pieces() for t in plan.options.techniques)
        at = _sizes_at(plan, pieces)
        for node in plan.graph.nodes:
            lay = node.meta.get("autopar")
            val = node.meta.get("val")
            if lay is None or not lay.outputs or not isinstance(val, torch.Tensor):
                continue
            p = lay.outputs[0][axis]
            if not isinstance(p, Shard) or p.dim >= val.dim():
                continue
            size = _size_at(val.shape[p.dim], at)
            if isinstance(size, int) and (size // p.blocks) % (2 * n):
                micro = f" (at the pipeline's micro-batch: the batch cut in {pieces})" if pieces > 1 else ""
                raise PlanError(
                    f"context_parallel on {self.axis!r} with load_balance: {node.name} in module "
                    f"{module_path(node)!r} is split on dim {p.dim} of {size} rows{micro}, which does not cut "
                    f"into 2 x {n} chunks{' per block' if p.blocks > 1 else ''}. Use sizes that divide by {2 * n} "
                    "(the sequence, and the batch where labels are regrouped"
                    + (", per micro-batch" if pieces > 1 else "")
                    + "), or load_balance=False."
                )

    def describe(self, plan) -> str:
        calls = plan.built.get(self.name) or []
        reorders = piece_orders(plan).reorders
        again = (
            f"; {len(reorders)} split value(s) reordered to zig-zag where they meet the sequence" if reorders else ""
        )
        return (
            f"context parallel on {self.axis!r} ({'+'.join(self._methods)}): every sequence split in "
            f"{plan.mesh.axis_size(self.axis)}, {len(calls)} attention calls meet every key{again}"
        )

    def collectives(self, plan, symbols) -> list:
        """The reorders between a split's plain and zig-zag orders (sharding/piece_order.py: a
        parameter split on the axis meeting the sequence): an all-gather forward, one backward."""
        out = []
        nodes = {n.name: n for n in plan.graph.nodes}
        for name, i, axis in piece_orders(plan).reorders:
            node = nodes[name]
            src = layout_of(node).inputs[i]
            spec = layout_of(src).spec
            local, n = symbols.local_bytes(src, spec), symbols.axes[axis]
            moved = step_bytes(Step("all_gather", axis, spec[axis].dim), local, n)
            phases = ("forward", "backward") if plan.ctx.needs_grad.get(src) else ("forward",)
            for phase in phases:
                why = "pieces reordered between the plain and the zig-zag order"
                out.append(
                    make_comm(symbols, "all_gather", self.axis, phase, moved, name, module_path(node), src.name, why)
                )
        return out

    def explain_module(self, plan, path: str) -> list[str]:
        calls = set(plan.built.get(self.name) or [])
        here = [n for n in plan.graph.nodes if n.name in calls and module_path(n).startswith(path)]
        if not here:
            return []
        return [f"  context parallel: {len(here)} attention call(s) on {self.axis!r} by {'+'.join(self._methods)}"]

    @property
    def _methods(self) -> tuple:
        return (self.method,) if isinstance(self.method, str) else self.method

    # ---- the search's hooks (parallel/protocols/search.py): the methods and orders it may pick
    search_roles = ("cp", "cp_inner")  # cp_inner: hybrid's Ulysses axis, right after cp

    @classmethod
    def search_methods(cls, facts, auto) -> tuple:
        """(the attention methods context parallel may use, whether an axis of n ranks takes the
        zig-zag order): the user's ContextParallel, else ``ap.Auto(context_parallel=...)``'s methods
        (or ``choices={"context_parallel": ...}``) where the model has sequence inputs (2-D or more:
        dim 1 split) and no experts (the expert dispatch on split sequences has not been run
        against serial); zig-zag (causal work even on every rank) where every sequence divides
        into 2n chunks."""
        user = facts.user.get(cls.name)
        if user is not None:
            return (user.method,), lambda n: user.load_balance
        lengths = facts.sequence_lengths
        if not lengths or facts.experts:
            return (), lambda n: False
        methods = tuple(auto.choices_for(cls.name, auto.context_parallel))
        return methods, lambda n: all(length % (2 * n) == 0 for length in lengths)

    @classmethod
    def search_choices(cls, mesh, free: list, methods: tuple, balanced) -> list:
        """Context parallel on each free axis (of ``free``, mesh axis indices) by each method, then
        hybrid where it fits: Ulysses on a free axis right after another free one (its inner, fast
        ranks: the mesh's later axis), the ring or all-gather across the outer axis, offered where
        Ulysses and the outer method are both among ``methods``; zig-zag ordered where
        ``balanced(ranks)``.

        Example: free [0, 1] of ("a", "b"), methods ("ring", "ulysses") -> ContextParallel("a", "ring"),
        ("a", "ulysses"), ("b", "ring"), ("b", "ulysses"), (("a", "b"), ("ring", "ulysses"))"""
        out = []
        for cp in free:
            lb = balanced(mesh.shape[cp])
            out += [cls(mesh.axis_names[cp], method=m, load_balance=lb) for m in methods if isinstance(m, str)]
        pairs = [(m, "ulysses") for m in ("ring", "allgather") if m in methods and "ulysses" in methods]
        for cp in free:
            if cp + 1 in free:
                lb = balanced(mesh.shape[cp] * mesh.shape[cp + 1])
                axes = (mesh.axis_names[cp], mesh.axis_names[cp + 1])
                out += [cls(axes, method=pair, load_balance=lb) for pair in pairs]
        return out

    @classmethod
    def search_space(cls, mesh, facts, auto, structure=None) -> list:
        """``search_choices`` on the axes ``structure`` leaves free."""
        free = [a for a in range(mesh.ndim) if mesh.shape[a] > 1 and (structure is None or not structure.uses(a))]
        return cls.search_choices(mesh, free, *cls.search_methods(facts, auto))

    def search_axes(self, mesh) -> dict:
        """{mesh axis index: role} of this choice: "cp", and hybrid's Ulysses axis "cp_inner"."""
        axes = (self.axis,) if isinstance(self.axis, str) else self.axis
        return {mesh.axis_index(a): role for a, role in zip(axes, self.search_roles)}

    def search_label(self, mesh, structure) -> str:
        method = self.method if isinstance(self.method, str) else "+".join(self.method)  # hybrid: "ring+ulysses"
        return f", cp {method}" + (" zig-zag" if self.load_balance else "")


def _sizes_at(plan, pieces: int) -> dict:
    """The example's value of every input dim's symbol, each batch (dim 0) cut in ``pieces``
    as the pipeline's runner cuts it (the first pieces the largest: ceiling)."""
    out = {}
    for node in plan.graph.nodes:
        val = node.meta.get("val")
        if node.op != "placeholder" or node.name not in plan.traced.user_inputs or not isinstance(val, torch.Tensor):
            continue
        for d, s in enumerate(val.shape):
            if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol) and s.node.hint is not None:
                hint = int(s.node.hint)
                out.setdefault(s.node.expr, -(-hint // pieces) if d == 0 else hint)
    return out


def _size_at(size, at: dict):
    """A dim's size with the symbols at ``at``'s values (an int), or its example value where
    another symbol is in it; None where unknown."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = size.node.expr
    if expr.free_symbols <= set(at):
        return int(expr.xreplace(at))
    return int(size.node.hint) if size.node.hint is not None else None
