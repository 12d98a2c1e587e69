"""Automatic planning: ap.plan(model, mesh, ..., auto=True | ap.Auto(...)).

A MILP (solver.py) picks what each mesh axis does (data parallel with a ZeRO level, Megatron
tensor parallel with or without sequence parallel, replicated) and which components (Megatron
pairs, the vocabulary) are split, minimising the step time of evaluate.py's cost model under
a memory budget. Device profiles (profiles.py) or ap.calibrate() give its numbers. It names no
technique: the registered techniques offer their roles and choices (parallel/protocols/search.py),
``ap.Auto(choices={technique name: ...})`` narrows them.

Example:
    >>> plan = ap.plan(model, ap.Mesh((2, 2), ("a", "b")), kwargs=batch, auto=ap.Auto(memory_budget=2**30))
    >>> print(plan.explain("auto"))
    >>> ap.predict(plan)["time_s"]
"""

from autopar.search.calibrate import calibrate
from autopar.search.options import Auto
from autopar.search.predict import predict
from autopar.search.profiles import PROFILES, Profile

__all__ = ["Auto", "calibrate", "predict", "Profile", "PROFILES"]
