"""Each technique is one folder (docs/architecture.md, "A technique is one folder"): outside its
folder only the public API names it, the search imports no technique, and ``Technique`` is made of
the small protocols of parallel/protocols/.

The crossings that are left are listed in ``CROSSINGS`` with why; the test holds the list exact, so
a new crossing fails here and a paid one must be struck from the list.
"""

from __future__ import annotations

import ast
import functools
import pathlib

import autopar.parallel as parallel
from autopar.parallel.protocols import (
    CostHooks,
    DisplayHooks,
    LayoutHooks,
    OptionHooks,
    RuntimeHooks,
    SearchHooks,
    StorageHooks,
)
from autopar.parallel.technique import Technique

ROOT = pathlib.Path(parallel.__file__).parent.parent  # autopar/
PUBLIC_API = "__init__.py"  # autopar/__init__.py: ap.<Technique> for users

# folder -> {file outside it: why it still names the technique}. Each is a debt: pay it with a hook.
# None is left (2026-12-07): a technique is named outside its folder only by the public API.
CROSSINGS: dict[str, dict[str, str]] = {}


# file outside parallel/ -> why it still reads plan.data_parallel / plan.dp_axis (the data-parallel
# technique's own); every other file asks the plan's technique-neutral questions (plan.batch_axis,
# plan.state_storage, plan.weight_shards) or the techniques' hooks. Held exact, as CROSSINGS.
DP_READS: dict[str, str] = {
    "plan.py": "defines them (Plan.data_parallel, Plan.dp_axis) beside the neutral questions",
}


def _technique_folders() -> dict[str, tuple[set, str]]:
    """folder -> (technique class names, the folder's module prefix) for every registered technique."""
    folders: dict[str, tuple[set, str]] = {}
    for cls in parallel.TECHNIQUES.values():
        parts = cls.__module__.split(".")  # autopar.parallel.<folder>[.<module>]
        names, prefix = folders.setdefault(parts[2], (set(), ".".join(parts[:3])))
        names.add(cls.__name__)
    return folders


@functools.cache
def _file_names() -> dict[str, tuple[frozenset, frozenset]]:
    """autopar/-relative path -> (modules it imports from, identifiers it names), each file parsed once."""
    out = {}
    for path in ROOT.rglob("*.py"):
        modules, names = set(), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules.add(node.module)
                modules.update(f"{node.module}.{a.name}" for a in node.names)  # from autopar.parallel import x
            elif isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
        out[path.relative_to(ROOT).as_posix()] = (frozenset(modules), frozenset(names))
    return out


def _names_of(rel: str, classes: set, prefix: str) -> set[str]:
    """What in one file names the technique: an import of its folder's modules or a technique class."""
    modules, names = _file_names()[rel]
    return {m for m in modules if m == prefix or m.startswith(prefix + ".")} | (names & classes)


def _outside_users(folder: str, classes: set, prefix: str) -> dict[str, set]:
    users = {}
    for rel in _file_names():
        if rel.startswith(f"parallel/{folder}/") or rel == f"parallel/{folder}.py":
            continue
        found = _names_of(rel, classes, prefix)
        if found:
            users[rel] = found
    return users


def test_each_technique_is_named_outside_its_folder_only_by_the_public_api_and_listed_crossings():
    for folder, (classes, prefix) in _technique_folders().items():
        users = set(_outside_users(folder, classes, prefix)) - {PUBLIC_API}
        listed = set(CROSSINGS.get(folder, {}))
        assert users <= listed, f"{folder}: new files name it: {sorted(users - listed)} (ask it through a hook)"
        assert listed <= users, f"{folder}: paid crossings still listed: {sorted(listed - users)} (strike them)"


def _reads_dp(path: pathlib.Path) -> bool:
    """Whether a file reads an attribute ``.data_parallel`` or ``.dp_axis`` (of a plan or its options)."""
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.Attribute) and n.attr in ("data_parallel", "dp_axis") for n in ast.walk(tree))


def test_outside_parallel_no_file_reads_plan_data_parallel_or_dp_axis():
    readers = {rel for rel in _file_names() if not rel.startswith("parallel/") and _reads_dp(ROOT / rel)}
    listed = set(DP_READS)
    assert readers <= listed, f"new readers: {sorted(readers - listed)} (ask plan.batch_axis, plan.state_storage, ...)"
    assert listed <= readers, f"paid reads still listed: {sorted(listed - readers)} (strike them)"


def test_every_technique_lives_in_a_folder_of_its_own():
    single_files = [cls.__module__ for cls in parallel.TECHNIQUES.values() if cls.__module__.count(".") < 3]
    assert not single_files, single_files


def test_search_imports_no_technique():
    folders = _technique_folders()
    for rel in [r for r in _file_names() if r.startswith("search/")]:
        for folder, (classes, prefix) in folders.items():
            assert not _names_of(rel, classes, prefix), f"{rel} names {folder}"


def test_technique_is_made_of_the_small_protocols():
    protocols = (OptionHooks, LayoutHooks, StorageHooks, CostHooks, RuntimeHooks, DisplayHooks, SearchHooks)
    assert all(issubclass(Technique, p) for p in protocols)
    hooks = [
        set(vars(p)) - set(vars(object)) - {"__dict__", "__weakref__", "__module__", "__doc__", "__qualname__"}
        for p in protocols
    ]
    for i, a in enumerate(hooks):  # each hook in one protocol only
        for b in hooks[i + 1 :]:
            assert not (a & b), a & b
    assert not {k for k in vars(Technique) if callable(vars(Technique)[k]) and not k.startswith("__")}
