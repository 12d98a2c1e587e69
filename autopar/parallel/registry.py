"""The parallelism techniques a plan can be asked for, by name.

Each technique is one folder of parallel/ (a frozen dataclass implementing technique.py's
``Technique``) decorated with ``@register_technique``: its ``name`` is its keyword in
``ap.plan`` / ``ap.parallelize``, its field of ``ap.PlanOptions`` and its key in plan files;
options, mesh reshaping, save/load, the API's keywords, ``Plan``'s technique methods and
explain iterate over this registry, so adding a technique is its file, its tests and a line
of docs. ``autopar.parallel`` imports every module of the folder, which fills it.

Example:
    >>> list(TECHNIQUES)  # in the order they apply
    ['data_parallel', 'fault_tolerant', 'expert_parallel', 'context_parallel', 'pipeline', 'float8', 'mixed_precision', 'activation_checkpoint']
    >>> TECHNIQUES["data_parallel"].of("dp")
    DataParallel(axis='dp', ...)
"""

from __future__ import annotations

TECHNIQUES: dict[str, type] = {}  # name -> Technique subclass, in the order techniques apply


def register_technique(cls: type) -> type:
    """Class decorator: add a Technique under ``cls.name`` (a second one of a name is an error)."""
    if not cls.name or cls.name in TECHNIQUES:
        raise ValueError(f"technique {cls.__name__}: its name {cls.name!r} is empty or registered twice")
    TECHNIQUES[cls.name] = cls
    for name, c in sorted(TECHNIQUES.items(), key=lambda item: item[1].order):
        TECHNIQUES.pop(name)
        TECHNIQUES[name] = c
    return cls


def plan_method(name: str):
    """The function a technique offers as ``plan.<name>(...)`` (called with the plan first), or None."""
    for cls in TECHNIQUES.values():
        if name in cls.plan_methods:
            return getattr(cls, name)
    return None


def plan_method_names() -> list[str]:
    return [n for cls in TECHNIQUES.values() for n in cls.plan_methods]
