"""The cost model: what a plan communicates, holds and computes per rank and step.

Below the techniques and the search, above the layouts: it reads a plan's layouts, the
redistribution steps and what each technique reports (``Technique.collectives``,
``Technique.memory``), never an op's name. The display, the plots, ``plan.cost()`` and the
search all count with it.

Example:
    >>> from autopar.cost import Cost, collectives
    >>> for c in collectives(plan): print(c)            # every collective of one step
    >>> Cost(plan).at(B=64)["memory"]                    # bytes per rank at batch 64
"""

from autopar.cost.collectives import Comm, collectives, make_comm
from autopar.cost.formulas import PlanSymbols, simplify
from autopar.cost.op_time import split_factor
from autopar.cost.plan_cost import Cost, formula_of, layer_of

__all__ = [
    "Comm",
    "Cost",
    "PlanSymbols",
    "collectives",
    "formula_of",
    "layer_of",
    "make_comm",
    "simplify",
    "split_factor",
]
