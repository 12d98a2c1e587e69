"""The interface of a parallelism technique: what one contributes to a plan.

Layouts (tensor parallelism, vocabulary and sequence parallel) come from annotations and
rules. A *technique* is everything else a plan can be asked for: data parallelism (gradient
buckets, ZeRO 1-3, local SGD, the precision policy), the pipeline, and whatever is added
next. Each is one frozen options value (``ap.DataParallel``, ``ap.Pipeline``) registered by
name (registry.py) that implements these hooks; the planning pipeline (planner.py), the rank
modules (codegen/rank_module.py), the cost model (cost/), checkpoints, clipping, explain and
save/load call them and know nothing else about the technique. Adding one is one file here
plus its tests.

Every hook has a default that does nothing, so a technique implements only what it needs.

Example (the shape of a new technique):
    >>> @register_technique
    ... @dataclass(frozen=True)
    ... class MyTechnique(Technique):
    ...     axis: str
    ...     name = "my_technique"          # ap.plan(..., my_technique=MyTechnique("tp"))
    ...     def validate(self, mesh, options, annotations): mesh.axis_index(self.axis)
    ...     def attach(self, plan, module, rank): module.my_hook = ...
"""

from __future__ import annotations

import contextlib
import dataclasses

from autopar.errors import PlanError


class Technique:
    """Base of parallelism techniques; subclasses are frozen dataclasses."""

    #: its keyword in ap.plan / ap.parallelize, its field of ap.PlanOptions, its key in plan files
    name: str = ""
    #: where it applies among the techniques (lower first): the hooks chain in this order
    order: int = 50
    #: functions the technique offers as ``plan.<name>(...)`` (static methods taking the plan first)
    plan_methods: tuple = ()

    # ---- options: the keyword's value, and what it needs of the other options
    @classmethod
    def of(cls, value):
        """The technique for ``ap.plan``'s keyword value: None, an instance, or a shorthand a
        subclass accepts (``data_parallel="dp"``)."""
        if value is None or isinstance(value, cls):
            return value
        raise PlanError(f"{cls.name}={value!r}: give an ap.{cls.__name__}(...) or None.")

    @classmethod
    def take_annotations(cls, annotations: dict) -> tuple[dict, dict]:
        """(the annotations left, ap.PlanOptions fields): annotations that belong to the technique
        rather than to the layouts (``ap.split_before()`` marks pipeline stages)."""
        return annotations, {}

    @classmethod
    def fold(cls, chosen: dict) -> dict:
        """The techniques asked for (name -> technique) as this one changes the others it configures
        (a precision policy gives its dtypes to the DataParallel beside it); runs on every PlanOptions."""
        return chosen

    @classmethod
    def check_options(cls, options) -> None:
        """Refuse PlanOptions that need this technique and lack it (split_before without a pipeline)."""

    @classmethod
    def implied(cls, model) -> "Technique | None":
        """The technique the model asks for by what it is built of, where ap.plan was not given
        it (a torchao-converted model's Float8Linears: ap.Float8 with their recipe); None."""
        return None

    def tracing(self, model):
        """A context manager under which the model is traced (a module torch.export cannot trace
        as it is, seen as what it computes: a Float8Linear as a Linear)."""
        return contextlib.nullcontext()

    def exact(self) -> "Technique":
        """These options as plan.check runs them: the variant whose gradients are the exact fp32
        sums the serial model has (reduced-precision syncs and optimizer sharding left out); None
        where nothing of it is left then."""
        return self

    def validate(self, mesh, options, annotations: dict) -> None:
        """Raise a PlanError when the technique cannot work on this mesh with these options."""

    def reshape_mesh(self, mesh):
        """(the mesh to plan on, the technique in its terms): a technique spelled over mesh axes
        the layouts cannot use as they are (HSDP over a replicate and a shard axis becomes one
        data-parallel axis sharded in groups) rewrites both before planning."""
        return mesh, self

    def data_axis(self) -> str | None:
        """The mesh axis that splits the batch (dim 0 of every input), if this technique does."""
        return None

    def token_axes(self) -> tuple:
        """Mesh axes over which the technique splits the tokens a rank computes on (the batch,
        the sequence): parameters stay replicated there and their gradients arrive in parts
        summed over the axis, so ZeRO may shard their state over them too
        (``DataParallel(shard_axes=...)`` folds such an axis into its shard group)."""
        return ()

    def seed_inputs(self, seeds, mesh, inputs: dict) -> None:
        """Place user inputs the technique splits (``inputs``: name -> example value) into
        ``seeds.inputs`` / ``seeds.reasons``, leaving inputs the annotations placed on its axis."""

    def prepare_graph(self, traced) -> None:
        """Rewrite the traced graph before propagation into a value-preserving form the rules place
        better (context parallel: eager attention chains as one SDPA node)."""

    def attention_method(self, axis: str) -> str | None:
        """How attention split on mesh axis ``axis`` by its sequence meets every key ("ring" or
        "allgather"; the lowering of attention on a split sequence asks), or None when not this
        technique's axis."""
        return None

    def piece_order(self, axis: str) -> str | None:
        """The order of the pieces of every dim split on mesh axis ``axis``: None (contiguous) or
        one of placement.PIECE_ORDERS ("zigzag": rank r holds chunks r and 2n-1-r). Such splits are
        then ``Shard(dim, order=...)`` layouts (sharding/piece_order.py says which values): the
        emitted program's redistributions and plan.local_inputs follow them."""
        return None

    def after_plan(self, plan):
        """Structure built once the layouts are known (the pipeline cuts the graph into stages);
        what it returns is kept as ``plan.built[self.name]``."""

    def join(self, plan, timeout: float | None) -> tuple | None:
        """ap.parallelize where this technique runs the mesh as several torch.distributed jobs
        (fault tolerance: one per replica group): make this job's process groups and backend and
        return (this process' rank in the plan, mesh axes its replicated tensors are not
        broadcast over). None: one job over the whole mesh (the default)."""
        return None

    def attach(self, plan, module, rank: int) -> None:
        """Runtime hooks on ``rank``'s module (gradient sync, optimizer helpers)."""

    def checkpoint_mesh(self, plan):
        """The torch DeviceMesh checkpoints describe this job's pieces on, where the job is not
        the whole mesh (fault tolerance: one replica group); None: the plan's mesh."""
        return None

    def collectives(self, plan, symbols) -> list:
        """The collectives the technique adds per training step (cost.Comm)."""
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

    # ---- storage and program: a technique that stores parameters otherwise than it computes
    # with them (fully sharded data parallel) or rewrites the emitted program (casts)
    def stored(self, plan, rank: int, fqn: str, local):
        """What ``rank`` stores of parameter ``fqn``, given its piece in the computed layout."""
        return local

    def stored_start(self, plan, rank: int, fqn: str) -> int | None:
        """Where ``stored``'s piece of ``fqn`` starts in ``rank``'s flattened computed piece when
        it is a contiguous 1-D range of it (checkpoints describe it by that range); None when
        the rank stores the computed piece as it is."""
        return None

    def stored_axes(self, plan, fqn: str) -> tuple:
        """Mesh axes over which ``stored`` gives ranks different pieces of ``fqn``."""
        return ()

    def stored_share(self, plan, fqn: str) -> int:
        """Into how many stored pieces ``stored`` cuts ``fqn``'s computed piece (zero=3: its shard
        group's size), 1 when stored as computed: the gradient sync on other axes moves the stored
        piece, so the cost model divides its bytes by this."""
        return 1

    def counts_stored(self, plan, rank: int, fqn: str) -> bool:
        """Whether ``rank``'s stored piece of ``fqn`` is counted in a whole-model sum (gradient
        norm) over ``stored_axes``: False on all but one of the ranks storing the same piece."""
        return True

    def restored(self, plan, per_rank: list) -> list:
        """Every rank's dict of computed-layout pieces from its stored pieces (``stored``'s inverse)."""
        return per_rank

    def rewrite_program(self, plan, graph) -> None:
        """Edit the emitted program (every rank's) before its code is generated."""

    def gather_wire(self, plan) -> dict:
        """Parameters zero=3 gathers in a form of this technique's rather than in the compute
        dtype (float8: the weights cast to fp8 before the all-gather), canonical name -> a hashable
        wire: its ``dtype`` crosses; ``bind(plan, runtime)`` gives the run-time half, whose
        ``reset()``, ``pack(k, chunk)`` and ``unpack(k, views)`` parallel/fsdp_runtime.py calls.
        Such parameters get buckets of their own."""
        return {}

    def grad_sync_axes(self, plan, axes: dict) -> dict:
        """The gradient buckets' axes per parameter (a technique reducing some itself drops them)."""
        return axes

    def describe(self, plan) -> str:
        """What the technique built, as text print(plan) adds after the table ('' for nothing)."""
        return ""

    def explain_param(self, plan, fqn: str) -> list[str]:
        """Lines plan.explain(fqn) adds for this technique (how the parameter is stored, synced)."""
        return []

    def explain_module(self, plan, path: str) -> list[str]:
        """Lines plan.explain(path) adds for this technique about a module (checkpointed or not)."""
        return []

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

    def memory_ranks(self, plan) -> tuple:
        """Ranks whose memory may differ from rank 0's (a pipeline: one per stage position): the
        ones plan.cost() and ap.predict weigh to find the rank that holds the most."""
        return ()

    def grad_pieces(self, plan, module, rank: int, pieces: list) -> list:
        """(name, gradient, counted by this rank) of every gradient ``rank`` holds, as the
        technique keeps them: whole-model sums (clipping) add the counted ones once."""
        return pieces

    def process_groups(self, plan) -> list:
        """Rank groups beyond the mesh axes' that the technique's collectives use (ap.parallelize
        makes them on every rank, in this order)."""
        return []

    def fields(self) -> dict:
        """JSON-able fields for a plan file; ``from_fields`` is the inverse."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_fields(cls, fields: dict):
        return cls(**fields)
