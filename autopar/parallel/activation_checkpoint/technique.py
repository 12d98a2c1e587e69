"""Activation checkpointing: ``ap.ActivationCheckpoint(...)`` as ``activation_checkpoint=`` of
ap.plan / ap.parallelize.

Each chosen block's forward (the model's repeated blocks, or the modules ``pattern``
matches; every ``every``-th of them) runs in the one emitted program as a checkpointed
region (regions.py outlines it, recompute.py runs it):

- ``mode="full"``: the region keeps only its inputs; backward runs its forward again.
- ``mode="selective"``: per op, as torchtitan's and Megatron's selective recompute: the outputs
  of matmuls and attention (``save=``: other ATen ops to keep, replacing that default) and of
  every collective are kept, pointwise ops, norms, activations and dropout are recomputed.
  Keeping the collectives' outputs means the recompute sends nothing (a tensor-parallel
  all-reduce is not run again); full mode runs them again, as Megatron's full recompute does.
- ``offload=True``: what a region keeps lives in host memory until its backward (pinned where
  CUDA exists; offload.py): its activation inputs and, under the selective policy, the
  outputs the policy keeps; the cost model counts them as ``offloaded`` (host) bytes.

Random draws (dropout, every random op) are replayed: the recompute starts the rank's
generator where the forward started it, so it draws the forward's masks in both rng modes,
and leaves the generator where the forward left it. Without autograd (eval, no_grad) a
region is a plain call. Under torch.compile each region runs eagerly between compiled pieces.

Example:
    >>> plan = ap.plan(model, mesh, args=(idx, tg), annotations=MEGATRON,
    ...                activation_checkpoint=ap.ActivationCheckpoint("selective", every=2))
    >>> print(plan.module(0).code)      # ... checkpoint_blocks_0 = checkpoint_blocks_0(...)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from autopar.cost.activation_memory import saved_activations
from autopar.cost.collectives import graph_collectives
from autopar.errors import PlanError
from autopar.parallel.activation_checkpoint import memory as ac_memory
from autopar.parallel.activation_checkpoint.recompute import MODES, Region, is_collective
from autopar.parallel.activation_checkpoint.regions import chosen_blocks, outline, spans
from autopar.parallel.registry import register_technique
from autopar.parallel.technique import Technique

aten = torch.ops.aten

# What a selective policy keeps by default: matmul and attention outputs (graph ops and the
# ops they run as at dispatch, where the policy decides: aten.linear runs as addmm / mm).
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)
ATTENTION = (
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
)
# a graph op -> the dispatch ops it runs as (a save= entry names either)
RUNS_AS = {
    aten.linear.default: (aten.mm.default, aten.addmm.default),
    aten.matmul.default: (aten.mm.default, aten.bmm.default),
    aten.scaled_dot_product_attention.default: ATTENTION,
    aten.einsum.default: (aten.bmm.default, aten.mm.default),
}
DEFAULT_SAVE = (*MATMULS, *ATTENTION)


@register_technique
@dataclass(frozen=True)
class ActivationCheckpoint(Technique):
    """Recompute activations in backward instead of keeping them (see the module docstring).

    ``mode``: "full" or "selective"; ``every``: checkpoint blocks 0, k, 2k, ...; ``pattern``:
    fnmatch pattern over module paths (default: the repeated blocks); ``save``: ATen ops whose
    outputs a selective policy keeps (default: matmuls and attention); ``offload``: what a
    region keeps (its inputs, the policy's outputs) in host memory until its backward;
    ``save_every``: of the matmuls a selective policy keeps, only every k-th a block runs (the
    1st, (k+1)-th, ...), the others recomputed (torchtitan's op-level policy: 2).
    """

    mode: str = "full"
    every: int = 1
    pattern: str | None = None
    save: tuple | None = None
    offload: bool = False
    save_every: int = 1

    name = "activation_checkpoint"
    order = 90  # last: its regions take in what the other techniques wrote into the program

    def __post_init__(self):
        if self.mode not in MODES:
            raise PlanError(f"ActivationCheckpoint(mode={self.mode!r}): use one of {MODES}.")
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise PlanError(
                f"ActivationCheckpoint(every={self.every!r}) must be an int >= 1 (1: every block, k: blocks 0, k, 2k, ...)."
            )
        if self.save is not None:
            save = tuple(self.save) if isinstance(self.save, (list, tuple)) else (self.save,)
            bad = [op for op in save if not isinstance(op, torch._ops.OpOverload)]
            if bad:
                raise PlanError(
                    f"ActivationCheckpoint(save=...): {bad[0]!r} is not an ATen op overload; give ops such as "
                    "torch.ops.aten.mm.default (an overload, not the packet torch.ops.aten.mm)."
                )
            if self.mode != "selective":
                raise PlanError(
                    "ActivationCheckpoint(save=...) chooses what selective mode keeps: add mode='selective'."
                )
            object.__setattr__(self, "save", save)
        if not isinstance(self.save_every, int) or isinstance(self.save_every, bool) or self.save_every < 1:
            raise PlanError(f"ActivationCheckpoint(save_every={self.save_every!r}) must be an int >= 1.")
        if self.save_every > 1 and self.mode != "selective":
            raise PlanError(
                "ActivationCheckpoint(save_every=...) thins what selective mode keeps: add mode='selective'."
            )

    @classmethod
    def of(cls, value):
        if value is True or value == "full" or value == "selective":
            return cls("full" if value is True else value)
        return super().of(value)

    # ------------------------------------------------------------------ planning
    def save_ops(self) -> frozenset:
        """The dispatch ops whose outputs a selective region keeps (collectives are kept too)."""
        chosen = DEFAULT_SAVE if self.save is None else self.save
        return frozenset(d for op in chosen for d in (op, *RUNS_AS.get(op, ())))

    def graph_save_ops(self) -> frozenset:
        """The plan graph's ops whose outputs a selective region keeps (the cost model's view)."""
        chosen = set(DEFAULT_SAVE if self.save is None else self.save)
        return frozenset(chosen | {g for g, runs in RUNS_AS.items() if chosen & set(runs)})

    def after_plan(self, plan):
        """The blocks checkpointed (a PlanError when the pattern matches nothing, or save= names
        an op the program does not run)."""
        blocks = chosen_blocks(plan, self)
        if self.save is not None:
            present = _graph_ops(plan.graph)
            for op in self.save:
                if op not in present:
                    raise PlanError(
                        f"ActivationCheckpoint(save=[..., {op}, ...]): the model runs no {op}. "
                        f"Its matmul-like ops: {sorted(str(o) for o in present if o in RUNS_AS or o in MATMULS)}."
                    )
        return blocks

    def rewrite_program(self, plan, graph) -> None:
        blocks = plan.built[self.name]
        save = self.save_ops()

        def make_region(block, body, inputs, mutated):
            name = f"checkpoint_{block.replace('.', '_')}"
            kept = save if self.mode == "selective" else ()
            return Region(name, body, self.mode, mutated, kept, self.offload, self.save_every, MATMULS)

        made = outline(graph, blocks, make_region, frozenset(plan.model_tensors["buffers"]))
        for before, region in zip(made, made[1:]):  # offload: a recompute prefetches the one before
            region.before = before

    # ------------------------------------------------------------------ display
    def label(self) -> str:
        """The mode in a few words (the search's choices): "full", "selective", "selective, 1
        matmul in 2"."""
        return self.mode + (f", 1 matmul in {self.save_every}" if self.save_every > 1 else "")

    def describe(self, plan) -> str:
        blocks = plan.built[self.name]
        what = "keeps matmul/attention and collective outputs" if self.mode == "selective" else "keeps block inputs"
        what += f" (1 matmul in {self.save_every})" if self.save_every > 1 else ""
        off = ", kept tensors offloaded to host memory" if self.offload else ""
        shown = ", ".join(blocks[:4]) + (f", ... ({len(blocks)} blocks)" if len(blocks) > 4 else "")
        return f"activation checkpointing ({self.mode}, {what}{off}): {shown}"

    def explain_module(self, plan, path: str) -> list[str]:
        blocks = plan.built[self.name]
        if path not in blocks:
            inside = [b for b in blocks if b.startswith(path + ".")]
            return [f"  activation checkpointing: {len(inside)} of its blocks recomputed in backward"] if inside else []
        comms = sum(
            1
            for _, nodes in spans(plan.graph, [path])
            for n in nodes
            if is_collective(getattr(n.target, "default", n.target))
        )
        if self.mode == "full":
            why = "only its inputs are kept; backward runs its forward again"
            why += f" (its {comms} collectives too)" if comms else ""
        else:
            why = "matmul/attention and collective outputs kept; the rest recomputed in backward (no collective runs twice)"
        return [
            f"  activation checkpointing ({self.mode}): {why}; the program calls checkpoint_{path.replace('.', '_')}"
        ]

    # ------------------------------------------------------------------ memory
    def activations(self, plan, symbols, terms: dict) -> dict:
        """Activations as checkpointing keeps them, and ``recompute``: one block's recompute at its peak."""
        return ac_memory.checkpointed_terms(plan, self, symbols, terms)

    def kept_saves(self, plan, saves: list) -> list:
        return ac_memory.checkpointed_saves(plan, self)[0]

    def nodes_recompute(self, plan, symbols, nodes: set):
        """One block's recompute at its peak among ``nodes`` (a pipeline stage's blocks)."""
        return ac_memory.checkpointed_recompute(plan, self, symbols, only=nodes)

    def recomputed(self, plan) -> set:
        """The nodes of a checkpointed block that backward runs again: under the selective policy
        less the ops it keeps, and none after the last one that makes a tensor the block's
        backward keeps (torch's non-reentrant checkpoint stops its recompute there: a block's
        last matmul and residual add are not run again). Measured: a dry run's FLOPs of a GPT
        under full checkpointing were 0.93x the count of every block node, 1.0x with the stop."""
        where, keep = ac_memory.block_map(plan, set(plan.built[self.name])), self.kept_nodes(plan)
        order = {n.name: i for i, n in enumerate(plan.graph.nodes)}
        by_name = {n.name: n for n in where}
        last: dict = {}  # block -> the graph position of the last node its backward needs again
        for s in saved_activations(plan):
            made = s.producer or s.consumer
            node = by_name.get(made)
            if node is not None and where[node] == where.get(by_name.get(s.consumer)):
                last[where[node]] = max(last.get(where[node], -1), order[made])
        return {
            n.name
            for n, block in where.items()
            if n.op == "call_function" and n.name not in keep and order[n.name] <= last.get(block, -1)
        }

    def collectives(self, plan, symbols) -> list:
        """The forward collectives backward runs again: a full checkpoint recomputes its blocks
        (up to the last tensor their backward keeps, ``recomputed``) with their collectives; the
        selective policy keeps collective outputs (recompute.is_collective). Found by a
        dry run: LLaMA-70B on TP 8 + sp under full checkpointing sent 2 all-gathers and 1
        reduce-scatter a layer more than plan.collectives() listed."""
        if self.mode == "selective":
            return []
        again = self.recomputed(plan)
        return [
            dataclasses.replace(c, phase="recompute")
            for c in graph_collectives(plan, symbols)
            if c.phase == "forward" and c.node in again
        ]

    def kept_nodes(self, plan) -> set:
        """The graph nodes of the blocks whose outputs the selective policy keeps: its ops, of the
        matmuls every ``save_every``-th in each block's order (a graph matmul runs as one matmul
        kernel, which the run-time policy counts); none in full mode."""
        if self.mode != "selective":
            return set()
        ops, kept, count = self.graph_save_ops(), set(), {}
        where = ac_memory.block_map(plan, set(plan.built[self.name]))
        matmuls = set(MATMULS) | set(RUNS_AS) - {aten.scaled_dot_product_attention.default}
        for n in plan.graph.nodes:
            block = where.get(n) if n.op == "call_function" and n.target in ops else None
            if block is None:
                continue
            if n.target in matmuls:
                count[block] = count.get(block, 0) + 1
                if (count[block] - 1) % self.save_every:
                    continue
            kept.add(n.name)
        return kept

    def fields(self) -> dict:
        out = super().fields()
        out["save"] = None if self.save is None else [str(op) for op in self.save]
        return out

    @classmethod
    def from_fields(cls, fields: dict):
        save = fields.get("save")
        if save is not None:
            save = tuple(_op_by_name(s) for s in save)
        return cls(**{**fields, "save": save})

    # ------------------------------------------------------------------ the search's hooks (protocols/search.py)
    search_variant = True  # each choice is the same probe under other options (Plan.with_options)

    @classmethod
    def search_space(cls, mesh, facts, auto, structure=None) -> list:
        """The checkpointing of every repeated block the search may pick: the user's (costed as its
        mode on every block), else ``ap.Auto(activation_checkpoint=...)`` (or ``choices=
        {"activation_checkpoint": ...}``: None, mode names, ActivationCheckpoint values); by default
        none, selective, selective keeping every second matmul (torchtitan's op policy: between
        the two in memory and time) and full.

        Example: ap.Auto(activation_checkpoint=(None, "full")) -> [None, ActivationCheckpoint("full")]"""
        user = facts.user.get(cls.name)
        if user is not None:
            return [user]
        asked = auto.choices_for(cls.name, auto.activation_checkpoint)
        if asked is None:
            asked = (None, "selective", cls("selective", save_every=2), "full")
        return [m if m is None or isinstance(m, cls) else cls(m) for m in (tuple(asked) or (None,))]

    def search_label(self, mesh, structure) -> str:
        return f", {self.label()} checkpointing"

    def pairs_with(self, other) -> bool:
        """Not with a schedule that splits backward (zero-bubble): each region's recompute in B is
        kept by the graph until its W, so a stage holds a region's whole internals per micro-batch
        between the two, which the memory model does not count (a dry run of ZB-H1 + full
        checkpointing, LLaMA-shaped, pp 4: a middle rank measured 4.9x its predicted peak). The
        search leaves the pair out rather than choose a plan whose memory it cannot tell."""
        return not other.splits_backward()


def _graph_ops(graph) -> set:
    return {n.target for n in graph.nodes if n.op == "call_function"} | {
        d for n in graph.nodes if n.op == "call_function" for d in RUNS_AS.get(n.target, ())
    }


def _op_by_name(name: str):
    """'aten.mm.default' -> torch.ops.aten.mm.default."""
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)
