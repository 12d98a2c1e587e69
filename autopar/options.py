"""PlanOptions: every choice ap.plan takes besides the model, mesh, inputs and annotations.

One frozen value instead of keyword arguments passed along and a string-keyed dict: the
plan keeps it (``plan.options``), save/load writes it field by field, and the planning
pipeline (planner.py) reads only it. The parallelism techniques it holds are the plug-ins of
parallel/registry.py: each is given by its name as a keyword (``data_parallel=``,
``pipeline=``, ...) and read back as an attribute of that name (None when not asked for).

Example:
    >>> opts = PlanOptions(data_parallel=ap.DataParallel("dp", zero=2), strict=True)
    >>> opts.replace(data_parallel=ap.DataParallel("dp")).techniques
    (DataParallel('dp', bucket_mb=25),)
    >>> opts.pipeline is None
    True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.errors import close_matches
from autopar.parallel import TECHNIQUES
from autopar.runtime.rng import check_mode


@dataclass(frozen=True, init=False)
class PlanOptions:
    techniques: tuple = ()  # the techniques asked for, in the order they apply (registry order)
    split_before: tuple[str, ...] = ()  # module paths where a pipeline stage starts
    strict: bool = False  # an op without a rule on split inputs is an error, not a gather
    dynamic: bool = True  # batch and sequence dims exported as dynamic (False: static, but a pipeline's batch dim)
    repeat_blocks: bool = True  # trace identical blocks two deep and copy the rest
    debug: bool = False  # ap.parallelize checks that every rank planned alike
    auto: object = None  # True or ap.Auto: the search chooses layouts (search/); None once done
    rng: str = "placement"  # dropout masks: "placement" or "serial" (runtime/rng.py)
    seed: int = 0  # every rank's dropout generator starts here

    def __init__(
        self,
        *,
        techniques=(),
        split_before=(),
        strict=False,
        dynamic=True,
        repeat_blocks=True,
        debug=False,
        auto=None,
        rng="placement",
        seed=0,
        **by_name,
    ):
        chosen = {type(t).name: t for t in techniques}
        for name, value in by_name.items():
            cls = TECHNIQUES.get(name)
            if cls is None:
                raise TypeError(
                    f"PlanOptions got an unexpected keyword {name!r}; the techniques are "
                    f"{', '.join(TECHNIQUES)} (did you mean {close_matches(name, TECHNIQUES, 1)}?)"
                )
            chosen[name] = cls.of(value)
        for cls in TECHNIQUES.values():
            chosen = cls.fold(chosen)
        ordered = tuple(chosen[n] for n in TECHNIQUES if chosen.get(n) is not None)
        values = dict(techniques=ordered, split_before=tuple(split_before), strict=strict, dynamic=dynamic)
        values.update(repeat_blocks=repeat_blocks, debug=debug, auto=auto, rng=rng, seed=seed)
        for key, value in values.items():
            object.__setattr__(self, key, value)
        check_mode(self.rng)
        for cls in TECHNIQUES.values():
            cls.check_options(self)

    def __getattr__(self, name: str):
        """A technique by its registered name (``options.pipeline``), None when not asked for."""
        cls = TECHNIQUES.get(name)
        if cls is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return next((t for t in self.__dict__.get("techniques", ()) if type(t).name == name), None)

    @property
    def compute_dtype(self):
        """The dtype the plan computes in: the first technique's that names one (a precision
        policy's ``param_dtype``), None for the model's own."""
        return next((d for d in (t.compute_dtype() for t in self.techniques) if d is not None), None)

    def replace(self, **changes) -> "PlanOptions":
        """These options with some changed: plain fields and techniques by name (None removes one)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return PlanOptions(**{**values, **changes})
