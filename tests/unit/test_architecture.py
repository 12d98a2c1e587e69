"""The package's shape: public names, one planning pipeline, options, techniques, lowerings and
redistribution step kinds as the extension points docs/architecture.md describes."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import warnings

import pytest
import torch

import autopar as ap
from autopar.sharding.lowerings.base import LOWERINGS, Lowering, register_lowering
from autopar.placement import Partial, Replicate, Shard
from autopar.runtime.ring import ring_bytes
from autopar.sharding.redistribute import STEP_KINDS, plan_steps
from tests.harness.models import MLP, MLP_TP


def test_public_names_sorted_and_resolvable():
    assert ap.__all__ == sorted(ap.__all__)
    for name in ap.__all__:
        assert getattr(ap, name) is not None


def test_deprecated_spellings_warn_and_still_work():
    with pytest.warns(DeprecationWarning, match="ap.replicated"):
        ann = getattr(ap, "replicate")()
    assert ann == ap.replicated()
    with pytest.warns(DeprecationWarning, match="ap.parallelize"), pytest.raises(ap.MeshError, match="parallelize"):
        getattr(ap, "compile")(MLP(), ap.Mesh((2,), ("tp",)), args=(torch.randn(4, 16),))


def test_plan_options_is_one_frozen_value():
    opts = ap.PlanOptions(data_parallel="dp")
    assert opts.data_parallel == ap.DataParallel("dp") and opts.techniques == (ap.DataParallel("dp"),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.strict = True
    with pytest.raises(ap.PipelineError, match="need a pipeline"):
        ap.PlanOptions(split_before=("layers.1",))


def test_plan_variants_share_trace_and_layouts():
    x = torch.randn(8, 16)
    plan = ap.plan(MLP(), ap.Mesh((2, 2), ("dp", "tp")), args=(x,), annotations=MLP_TP, data_parallel="dp")
    assert isinstance(plan.options, ap.PlanOptions)
    zero2 = plan.with_data_parallel(ap.DataParallel("dp", zero=2))
    assert zero2.traced is plan.traced and zero2.layouts is plan.layouts
    assert zero2.options.data_parallel.zero == 2 and plan.options.data_parallel.zero == 0
    with pytest.raises(ap.DataParallelError, match="plan again"):
        plan.with_data_parallel(ap.DataParallel("tp"))


def test_lowering_registry_refuses_duplicates_and_rules_use_registered_objects():
    with pytest.raises(ValueError, match="twice"):
        register_lowering(type(LOWERINGS["split_blocked"])())
    assert all(isinstance(lw, Lowering) and lw.name == name for name, lw in LOWERINGS.items())
    assert {
        "vocab_parallel_embedding",
        "cross_entropy_split_rows",
        "cross_entropy_vocab_parallel",
        "split_blocked",
    } <= set(LOWERINGS)


@pytest.mark.parametrize(
    "src,dst",
    [
        ((Shard(0),), (Replicate(),)),
        ((Partial(),), (Replicate(),)),
        ((Partial(),), (Shard(1),)),
        ((Shard(0),), (Shard(1),)),
        ((Replicate(),), (Shard(1),)),
        ((Replicate(),), (Partial(),)),
        ((Partial("sum"),), (Partial("avg"),)),
    ],
)
def test_every_step_kind_is_in_the_table_and_leaves_the_target(src, dst):
    cur = list(src)
    for st in plan_steps(src, dst):
        kind = STEP_KINDS[st.kind]
        cur[st.axis] = kind.next_placement(st)
        assert kind.forward_bytes(100.0, 4) == (ring_bytes(st.kind, 100.0, 4) if kind.communicates else 0.0)
    assert tuple(cur) == dst


def test_ring_bytes_formula():
    assert ring_bytes("all_reduce", 8.0, 4) == 12.0
    assert ring_bytes("all_gather", 8.0, 4) == 24.0
    assert ring_bytes("reduce_scatter", 8.0, 4) == 6.0 == ring_bytes("all_to_all", 8.0, 4)
    assert ring_bytes("all_reduce", 8.0, 1) == 0.0


def test_no_deprecated_names_inside_the_package():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        ap.plan(
            MLP(), ap.Mesh((2,), ("tp",)), args=(torch.randn(4, 16),), annotations={**MLP_TP, "norm": ap.replicated()}
        )


def test_building_a_rank_module_leaves_the_garbage_collector_as_found():
    import gc

    plan = ap.plan(MLP(), ap.Mesh((2,), ("tp",)), args=(torch.randn(4, 16),), annotations=MLP_TP)
    assert gc.isenabled()
    plan.build_module(0)
    assert gc.isenabled()
    gc.disable()
    try:
        plan.build_module(1)
        assert not gc.isenabled()
    finally:
        gc.enable()


# ------------------------------------------------------------------ imports run one way
# The package's parts, lowest first (docs/architecture.md draws the same list): a part imports
# only parts at or below its own level, so no two parts import each other.
PART_ORDER = (
    ("errors", "models"),
    ("mesh", "placement"),
    ("runtime",),
    ("trace",),
    ("sharding",),
    ("codegen",),
    ("cost",),
    ("parallel",),
    ("options",),
    ("presets",),
    ("dryrun",),
    ("search",),
    ("explore",),
    ("checkpoint",),
    ("plan",),
    ("planner",),
    ("api",),
    ("__init__",),
    ("cli",),
    ("__main__",),
)
LEVEL = {part: i for i, parts in enumerate(PART_ORDER) for part in parts}
# function-local imports of the package itself, each with why it cannot be at the top
LOCAL_IMPORTS_ALLOWED = {
    # the gloo worker sets OMP_NUM_THREADS and the rendezvous environment before torch is imported
    ("autopar/runtime/gloo_pool.py", "autopar.runtime.failures"),
}
PACKAGE = pathlib.Path(ap.__file__).parent


def _imports(path: pathlib.Path):
    """(imported autopar module, line, inside a function) of every import in one file."""
    tree = ast.parse(path.read_text())
    local = {
        id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "autopar":
            for alias in node.names:  # ``from autopar import presets`` imports the part presets
                name = f"{node.module}.{alias.name}" if node.module == "autopar" else node.module
                yield name, node.lineno, id(node) in local
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "autopar":
                    yield alias.name, node.lineno, id(node) in local


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_part_of_the_package_has_a_level():
    found = {p.stem if p.parent == PACKAGE else p.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("*.py")}
    assert found <= set(LEVEL), f"parts without a level in PART_ORDER: {sorted(found - set(LEVEL))}"


def test_imports_run_one_way_from_the_lowest_part_up():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        src = _part(".".join(rel.with_suffix("").parts).removesuffix(".__init__"))
        for module, line, _ in _imports(path):
            if LEVEL[_part(module)] > LEVEL[src]:
                wrong.append(f"{rel}:{line}: {src} imports {module} ({_part(module)} is above it)")
    assert not wrong, "imports that run up the order of parts:\n" + "\n".join(wrong)


def test_no_function_local_import_of_the_package():
    """A local import hides a cycle instead of removing it; only optional heavy dependencies
    (matplotlib, safetensors, torch.distributed.checkpoint, ...) are imported inside functions."""
    local = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE.parent))
        for module, line, inside in _imports(path):
            if inside and (rel, module) not in LOCAL_IMPORTS_ALLOWED:
                local.append(f"{rel}:{line}: {module}")
    assert not local, "function-local imports of autopar:\n" + "\n".join(local)


def test_techniques_are_registered_plug_ins():
    """Options, ap.plan's keywords, plan files and Plan's technique methods come from the registry."""
    from autopar.parallel import TECHNIQUES

    assert list(TECHNIQUES) == [
        "data_parallel",
        "fault_tolerant",
        "expert_parallel",
        "context_parallel",
        "pipeline",
        "float8",
        "mixed_precision",
        "activation_checkpoint",
    ]
    for name, cls in TECHNIQUES.items():
        assert cls.name == name and getattr(ap.PlanOptions(), name) is None
    plan = ap.plan(MLP(), ap.Mesh((2,), ("dp",)), args=(torch.randn(4, 16),), data_parallel="dp")
    assert {"pipeline_runner", "with_pipeline", "grad_buckets", "memory_per_rank"} <= set(dir(plan))
    with pytest.raises(TypeError, match="did you mean 'data_parallel'"):
        ap.PlanOptions(data_paralel="dp")
    with pytest.raises(AttributeError, match="no attribute 'pipeline_runer'"):
        plan.pipeline_runer(0)
