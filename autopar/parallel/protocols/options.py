"""OptionHooks, the options hooks of a technique.

What a technique is as an option of ``ap.plan``: the keyword's value, the annotations that
are its own, what it needs of the other options, the variant plan.check runs.

Called by ``ap.PlanOptions`` (options.py), ``ap.plan`` (api.py), the planner and ``plan.check``.

Example:
    >>> from autopar.parallel.protocols.options import OptionHooks
    >>> from autopar.parallel.technique import Technique
    >>> issubclass(Technique, OptionHooks)
    True
"""

from __future__ import annotations

from autopar.errors import PlanError


class OptionHooks:
    """The options hooks of a technique (all optional: each default changes nothing)."""

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
    def replica_groups(cls, chosen: dict, axis: str) -> dict:
        """The techniques asked for (name -> technique) as this one changes for replica groups on
        mesh axis ``axis`` that each run as a job of their own (fault tolerance's ``fold`` asks
        every registered one): data parallel splits the batch on ``axis`` where none was asked
        for, and takes each group's own loss mean."""
        return chosen

    @classmethod
    def check_options(cls, options) -> None:
        """Refuse PlanOptions that need this technique and lack it (split_before without a pipeline)."""

    @classmethod
    def implied(cls, model) -> "OptionHooks | None":
        """The technique the model asks for by what it is built of, where ap.plan was not given
        it (a torchao-converted model's Float8Linears: ap.Float8 with their recipe); None."""
        return None

    def compute_dtype(self):
        """The dtype the plan computes in under this technique (a precision policy's
        ``param_dtype``), None where it does not choose one (``PlanOptions.compute_dtype``)."""
        return None

    def precision_policy(self):
        """The precision policy this technique carries, as a technique (an ap.MixedPrecision), None
        where it carries none: the planner gives the last technique's to the search's probes."""
        return None

    def exact(self) -> "OptionHooks | None":
        """These options as plan.check runs them: the variant whose gradients are the exact fp32
        sums the serial model has (reduced-precision syncs and optimizer sharding left out); None
        where nothing of it is left then."""
        return self
