"""Each pipeline stage as its own GraphModule, per rank, with the plan's tp/dp layout inside.

``StageEmitter`` is the plan's Emitter restricted to one stage's nodes: values received
from earlier stages and the user inputs the stage reads become placeholders (in that
order), parameters it reads become attributes, and its outputs are the values later stages
need (in the stage's ``send`` order) followed, on the last stage, by the model's outputs.
A value is sent in the layout its producer left it in, so collectives on the non-pipeline
axes are emitted where it is consumed, exactly as in the unpipelined program.

Example:
    >>> params = {}
    >>> gm = build_stage_module(plan, rank=1, stage=1, params=params)   # program emitted once per stage
    >>> outs = gm(*received, *user_inputs)
"""

from __future__ import annotations

import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.codegen.emit import Emitter, keep_meta
from autopar.parallel.grad_scaler import mark_rank_params
from autopar.parallel.optimizer import mark_pieces
from autopar.codegen.device_args import bind_device
from autopar.codegen.program import Program
from autopar.codegen.rank_module import build_rank_module, tensor_slots


class StageEmitter(Emitter):
    def __init__(self, plan, stage):
        super().__init__(plan)
        self.stage = stage

    def run(self) -> fx.Graph:
        st, plan = self.stage, self.plan
        nodes = {n.name: n for n in plan.graph.nodes}
        for name, _src in st.recv:
            self.env[nodes[name]] = self.graph.placeholder(f"recv_{name}")
        for name in st.inputs:
            self.env[nodes[name]] = self.graph.placeholder(name)
        for name in st.attrs:
            self.env[nodes[name]] = self.graph.get_attr(plan.attr_name(name))
        for name in st.nodes:
            node = nodes[name]
            new = getattr(self, f"_{node.op}")(node)
            keep_meta(node, new)
            self.env[node] = new
        outs = [self.env[nodes[name]] for name, _ in st.send]
        if st.has_output:
            out_node = next(n for n in plan.graph.nodes if n.op == "output")
            flat = pytree.tree_leaves(out_node.args[0])[: plan.traced.n_user_outputs]
            outs += [self._user_output(v) if isinstance(v, fx.Node) else v for v in flat]
        self.graph.output(tuple(outs))
        return self.graph


def build_stage_module(plan, rank: int, stage: int, params: dict, state: dict | None = None) -> fx.GraphModule:
    """Stage ``stage``'s module for ``rank`` (codegen/rank_module.py, as every rank module);
    ``params`` (fqn -> tensor) is shared by the stages of one rank so that a weight two of its
    stages read is one Parameter; ``state``: full tensors to cut the pieces from (default: the
    model's values; a dry run's fake ones)."""
    names = [plan.attr_name(ph) for ph in plan.stage_layout.stages[stage].attrs]
    gm = build_rank_module(
        plan,
        rank,
        _program(plan, stage),
        class_name=f"Rank{rank}Stage{stage}",
        names=names,
        state=state,
        pieces=params,
        before_techniques=[mark_pieces, mark_rank_params],  # a whole-tensor optimizer, a plain scaler: refused
    )
    gm.autopar_stage = stage
    return gm


def _program(plan, stage: int) -> Program:
    """Stage ``stage``'s program, emitted once for every rank (what differs is in rank_attrs)."""
    programs = plan.stage_layout.programs
    if stage not in programs:
        graph = StageEmitter(plan, plan.stage_layout.stages[stage]).run()
        bind_device(graph)  # before the rewrites: an outlined region gets the device as an input
        for technique in plan.options.techniques:  # e.g. zero=3's gathers of the stage's buckets
            technique.rewrite_program(plan, graph)
        graph.lint()
        programs[stage] = Program(graph, class_name=f"Stage{stage}", slots=tensor_slots(plan))
    return programs[stage]
