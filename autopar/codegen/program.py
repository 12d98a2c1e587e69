"""One compiled program, many rank modules: fx code generated once per plan.

Emission writes one graph for every rank (emit.py: what differs between ranks is read from
module attributes). Turning a graph into a GraphModule costs mostly its Python code
generation and ``compile``, about 0.5 s for a 48-layer GPT; done once per rank, it was
most of the time to build all ranks' modules. A ``Program`` builds one private GraphModule
(the carrier, never run) and makes each rank's module an instance of a subclass of the
carrier's class: the generated ``forward`` is shared, parameters and rank attributes are
the rank's own.

Each rank's class is its own subclass, so ``gm.recompile()`` after editing a rank's graph
replaces that rank's forward only. The graph object itself is shared by the ranks of a plan:
``copy.deepcopy(gm)`` first to edit one rank's graph alone.

Example:
    >>> prog = Program(emit_graph(plan))
    >>> gm = prog.instance("Rank3Module")          # no parameters yet
    >>> set_attr(gm, "fc.weight", nn.Parameter(w)); gm.autopar_rank = 3
"""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from autopar.codegen.device_args import bind_device
from autopar.codegen.fast_calls import fast_codegen
from autopar.codegen.rank_module import RankModule

_MODULE_KEYS = frozenset(nn.Module().__dict__)  # what nn.Module.__init__ makes for every instance


class Program:
    """``slots``: the parameters and buffers the program reads, target -> the dict of its module
    that holds it (``tensor_slots(plan)``), read directly by the generated code."""

    def __init__(self, graph: fx.Graph, class_name: str = "RankModule", slots: dict | None = None):
        bind_device(graph)  # the program makes its tensors where its module is (device_args.py)
        graph._codegen = fast_codegen(graph._codegen, slots)  # the fast per-op calls (fast_calls.py)
        root = {n.target: None for n in graph.nodes if n.op == "get_attr"}
        self.carrier = fx.GraphModule(root, graph, class_name=class_name)
        # fx's own state of a GraphModule (graph, generated code, line maps, codegen specs),
        # not the placeholders the carrier holds for the program's attributes:
        attrs = {t.split(".")[0] for t in root}
        self._fx_state = {k: v for k, v in self.carrier.__dict__.items() if k not in _MODULE_KEYS and k not in attrs}

    @property
    def graph(self) -> fx.Graph:
        return self.carrier.graph

    def instance(self, class_name: str) -> fx.GraphModule:
        """A new, empty module running this program (attributes are the caller's to set); its
        class carries the rank-module protocol (codegen/rank_module.py)."""
        cls = type(class_name, (RankModule, type(self.carrier)), {})
        gm = object.__new__(cls)
        nn.Module.__init__(gm)
        for k, v in self._fx_state.items():  # containers copied: hooks or meta set on one rank stay there
            gm.__dict__[k] = v.copy() if isinstance(v, (dict, list)) else v
        return gm
