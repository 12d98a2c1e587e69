"""What a technique offers the automatic search (autopar/search/): its choices, the roles it gives
mesh axes, how a choice reads, and what a choice adds to the plan the search returns.

The search knows no technique by name: it asks the registered techniques (parallel/registry.py)
through these hooks, every one optional, and hands each choice back to its technique to build
the plan's options. A structure of the search is ``{mesh axis: role}``: the roles ``tp`` and
``tp+sp`` are the layouts' (Megatron tensor parallel, the search's components); every other role
is a technique's (``search_roles``). Cost and memory terms of a choice come from the technique's
existing hooks: ``step_shares`` (a pipeline rank's share of the step), its storage's
``step_comms`` / ``held_bytes`` / ``memory_divisors`` (data parallel), ``kept_saves`` /
``recomputed`` (checkpointing), ``collectives`` and the lowerings' cost entries (context parallel),
and ``priced_wire_params`` below (float8's gather).

Example (a technique that lends the search a role and three choices per axis):
    >>> class MyTechnique(Technique):
    ...     search_roles = ("my",)
    ...     @classmethod
    ...     def search_space(cls, mesh, facts, auto, structure=None):
    ...         axis = structure.axis("my")
    ...         return [] if axis is None else [cls(mesh.axis_names[axis], k) for k in (1, 2, 4)]
    ...     def search_label(self, mesh, structure):
    ...         return f", my x{self.k}"
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SearchFacts:
    """What the search knows of the job before choosing, as the techniques' search hooks read it.

    - ``batch``: rows of the first batched input (None where unknown); ``blocks``: the blocks of a
      repeated stack (0 without one); ``sequence_lengths``: dim 1 of every input of 2 dims or more
      (None where one is symbolic without a hint); ``experts``: the model has mixture-of-experts
      modules the search decides; ``user``: the techniques the user gave, by name (kept as given);
      ``split_before``: the user's stage boundaries; ``precision``: a precision policy's dtypes
      (``param_dtype``, ...) for a technique the search builds where the user gave none.

    Example: SearchFacts(batch=8, blocks=32, sequence_lengths=(8192,), user={"pipeline": pipe})
    """

    batch: int | None = None
    blocks: int = 0
    sequence_lengths: tuple | None = ()
    experts: bool = False
    user: dict = field(default_factory=dict, hash=False, compare=False)
    split_before: tuple = ()
    precision: dict = field(default_factory=dict, hash=False, compare=False)


class SearchHooks:
    """The search hook family; ``Technique`` inherits it, so every hook has a default that offers nothing."""

    #: the roles this technique gives mesh axes in the search's structures ({axis: role})
    search_roles: tuple = ()
    #: its choices are options of the same layouts (the search plans a probe once and costs each
    #: choice as Plan.with_options of it: checkpointing), not roles of axes
    search_variant: bool = False

    @classmethod
    def search_offered(cls, auto) -> bool:
        """Whether the search may give axes this technique's roles at all under ``auto``."""
        return True

    @classmethod
    def search_space(cls, mesh, facts: SearchFacts, auto, structure=None) -> list:
        """The technique's choices on ``mesh`` (instances of it, or None for "not applied") under
        ``auto`` (ap.Auto: ``auto.choices_for(cls.name, shorthand)``), for ``structure`` (the
        search's {axis: role}; ``structure.axis(role)`` reads it) where the choice depends on it.
        [] where it offers nothing there (the search then needs none of it)."""
        return []

    def search_axes(self, mesh) -> dict:
        """{mesh axis index: role} this choice gives axes where its instance says which
        (context parallel's axes); {} where the structure already holds them."""
        return {}

    def search_label(self, mesh, structure) -> str:
        """How the choice reads in an option's label, after the axis roles (", ZeRO-3")."""
        return ""

    def splits_backward(self) -> bool:
        """Whether the choice runs each micro-batch's backward in two calls (a zero-bubble
        pipeline: B, the input gradients, then W, the weights'); asked by ``pairs_with``."""
        return False

    def pairs_with(self, other) -> bool:
        """Whether the search may combine this choice with ``other`` (another technique's choice
        in the same option): False where the cost model cannot price the pair (weigh.py skips it;
        a user may still plan it by hand)."""
        return True

    def gathers_weights(self) -> bool:
        """Whether the choice keeps weights sharded and gathers them at use (zero=3): a technique
        with weights in a form of its own gathers them in that form (float8's fp8 all-gather)."""
        return False

    @classmethod
    def search_adds(cls, model, chosen: dict, auto):
        """The technique the search's plan needs beside ``chosen`` ({name: technique}) because of
        how ``auto`` priced it (ap.Auto(float8=True): the Linears in float8); None."""
        return None

    @classmethod
    def priced_wire_params(cls, plan, profile) -> set:
        """Parameter names a zero=3 plan priced under ``profile`` gathers in this technique's own
        form, where the plan has not converted them yet (the search prices float8 before its plan
        has ap.Float8): the cost model counts their gathers in that form (1 byte per element)."""
        return set()
