"""CostHooks, the cost hooks of a technique.

What a technique costs: the collectives it adds, its share of a step, the memory and the
activations per rank as it changes them, the nodes it recomputes.

Called by the cost model (cost/), ``plan.memory_per_rank``, ``plan.collectives()``, ``ap.predict``
and the search. Every value may be a number or a sympy formula, as ``symbols`` gives them.

Example:
    >>> from autopar.parallel.protocols.cost import CostHooks
    >>> from autopar.parallel.technique import Technique
    >>> issubclass(Technique, CostHooks)
    True
"""

from __future__ import annotations


class CostHooks:
    """The cost hooks of a technique (all optional: each default changes nothing)."""

    def collectives(self, plan, symbols) -> list:
        """The collectives the technique adds per training step (cost.Comm)."""
        return []

    def bucket_comms(self, numel, dtype, n) -> list[tuple]:
        """(kind, phase, bytes per rank) of one gradient bucket of ``numel`` elements of ``dtype``
        over a group of ``n`` ranks that this technique reduces (``group_axes``): the cost model's."""
        return []

    def batch_pieces(self) -> int:
        """Into how many pieces the technique cuts each rank's batch (dim 0 of the inputs) at run
        time, beyond the mesh's split: a pipeline's micro-batches. Sizes the plan must divide
        (context parallel's zig-zag chunks) are checked at that batch."""
        return 1

    def step_shares(self, mesh, built=None) -> dict | None:
        """What one rank has under this technique of the per-rank step without it (the search's
        and ap.predict's cost model): ``time`` (share of the compute), ``state`` (of parameter,
        gradient and optimizer bytes), ``acts`` (of activation bytes), and ``sends``: (mesh axis
        name, messages per step, share of one boundary activation each) of the point-to-point
        traffic it adds; ``pieces``: backward passes per step (the gradients accumulate between
        them; what one pass holds at its peak is 1/pieces of the batch's). ``built``: what
        after_plan made, where known (the pipeline's stages, costed each from its own nodes).
        None: unchanged."""
        return None

    def memory(self, plan, rank: int, state_slots: int, mem: dict) -> dict:
        """Memory per rank (parallel/dp_module.memory_per_rank) as this technique changes it."""
        return mem

    def activations(self, plan, symbols, terms: dict) -> dict:
        """``activations`` (bytes autograd keeps per rank: cost/activation_memory.py) as the
        technique changes them, and terms it adds (checkpointing's ``recompute`` peak); numbers
        or formulas, as ``symbols`` gives them (plan.cost(), memory_per_rank, ap.predict)."""
        return terms

    def rank_activations(self, plan, symbols, terms: dict, rank: int | None) -> dict:
        """``terms`` (after every technique's ``activations``) for what ``rank`` holds when it runs
        part of the model (a pipeline stage: its own activations, its in-flight micro-batches);
        ``rank`` None: the rank that holds the most (plan.cost())."""
        return terms

    def kept_saves(self, plan, saves: list) -> list:
        """Of the tensors autograd would keep (cost/activation_memory.Saved), those kept through
        the step under this technique (checkpointing keeps its blocks' inputs instead): the
        search attributes them to the nodes that made them."""
        return saves

    def nodes_recompute(self, plan, symbols, nodes: set):
        """``recompute`` (what ``activations`` adds as the step's peak of recomputing) for a rank
        that runs only the graph nodes ``nodes`` (a pipeline stage, whose backward runs alone: what
        the rest of the model frees before it is not its own), at the plan's batch; None where the
        technique recomputes nothing."""
        return None

    def recomputed(self, plan) -> set:
        """Names of the nodes whose forward runs again in backward (checkpointed regions)."""
        return set()

    def memory_formulas(self, plan, symbols, terms: dict, rank: int = 0) -> dict:
        """plan.cost()'s memory formulas (cost/plan_cost.py) of ``rank`` as this technique changes them."""
        return terms

    def rank_params(self, plan, rank: int, names: set) -> set:
        """Of the parameter names ``names``, those ``rank``'s modules hold (a pipeline rank: its
        stages'): the parameters plan.cost(rank=rank) counts."""
        return names

    def rank_collectives(self, plan, rank: int, comms: list, passes: int) -> list:
        """Of ``comms`` (plan.collectives() without the gradient sync), those this technique adds
        beside the graph's nodes that ``rank`` runs in a step of ``passes`` forward and backward
        passes (a pipeline rank's micro-batches), each as often as it runs (zero=3: the buckets of
        the rank's stages, gathered every pass when resharded after forward). A pipelined plan's
        dry run asks it (parallel/pipeline/dry_run.py); [] where it adds none."""
        return []

    @classmethod
    def op_extras(cls, plan, sy, profile, fused: bool) -> dict:
        """Node name -> cost.execution.OpExtra: what this technique changes in that op's seconds on
        a rank (a rate, kernels and messages beside it), asked of every registered class by the
        cost model's op_seconds (the search, ap.predict) for a plan with it or one ``profile``
        prices as if it had it (``profile.float8``: no ap.Float8 yet); ``fused``: compiled regions."""
        return {}

    def memory_ranks(self, plan) -> tuple:
        """Ranks whose memory may differ from rank 0's (a pipeline: one per stage position): the
        ones plan.cost() and ap.predict weigh to find the rank that holds the most."""
        return ()
