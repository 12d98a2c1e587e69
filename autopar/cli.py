"""The ``autopar`` command (also ``python -m autopar``).

    autopar plan  PACKAGE.MODULE:FACTORY --mesh dp=2,tp=2 [--preset megatron[:AXIS]] [--sequence-parallel]
                  [--annotate PATTERN=colwise:tp ...] [--dp AXIS|none] [--explain NAME ...]
                  [--cost] [--sizes H=32,V=64] [--save PLAN.json] [--html PLAN.html]
    autopar check PACKAGE.MODULE:FACTORY --mesh ... (same options): simulate every rank and
                  compare outputs and gradients with the serial model
    autopar dry-run PACKAGE.MODULE:FACTORY --mesh ... (same options) [--rank R] [--device cuda] [--steps 2]:
                  run rank programs at full size on fake tensors in a fake world; measured peak
                  memory, collectives and FLOPs beside the plan's (autopar/dryrun/)
    autopar convert DCP_DIR HF_DIR --model PACKAGE.MODULE:FACTORY [--key model]: a DCP checkpoint
                  saved from any plan to a HuggingFace directory (config.json + safetensors)

FACTORY is called with no arguments and returns ``(model, example_args)`` or
``(model, example_args, example_kwargs)``. Annotations: ``colwise:AXIS``, ``rowwise:AXIS``,
``replicated``, ``place:S(0),R`` (one placement per mesh axis).

Example:
    $ autopar plan autopar.models.examples:gpt --mesh dp=2,tp=2 \\
        --annotate 'blocks.*.attn.qkv=colwise:tp' --annotate 'blocks.*.attn.proj=rowwise:tp'
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from autopar import presets
from autopar.api import plan as make
from autopar.checkpoint.convert import dcp_to_hf
from autopar.errors import PlanError, ShardingError
from autopar.explore.display import plan_table
from autopar.explore.progress import progress
from autopar.mesh import Mesh
from autopar.placement import parse_placement
from autopar.sharding import annotations as annotate


def parse_mesh(text: str):
    """'dp=2,tp=2' -> Mesh((2, 2), ('dp', 'tp'))."""
    try:
        pairs = [item.split("=") for item in text.split(",") if item]
        return Mesh(tuple(int(n) for _, n in pairs), tuple(a.strip() for a, _ in pairs))
    except ValueError:
        raise SystemExit(f"autopar: --mesh {text!r}: write axis=size pairs, e.g. --mesh dp=2,tp=2") from None


def parse_annotation(text: str):
    """'blocks.*.mlp.fc=colwise:tp' -> ('blocks.*.mlp.fc', ap.colwise('tp'))."""
    pattern, sep, spec = text.rpartition("=")
    kind, _, arg = spec.partition(":")
    if not sep or not pattern:
        raise SystemExit(
            f"autopar: --annotate {text!r}: write PATTERN=colwise:AXIS (or rowwise:AXIS, replicated, place:S(0),R)"
        )
    if kind in ("colwise", "rowwise") and arg:
        return pattern, getattr(annotate, kind)(arg)
    if kind in ("replicated", "replicate"):  # the old spelling still accepted here
        return pattern, annotate.replicated()
    if kind == "place" and arg:
        try:
            return pattern, annotate.place(*(parse_placement(p.strip()) for p in arg.split(",")))
        except ShardingError as e:
            raise SystemExit(f"autopar: --annotate {text!r}: {e}") from None
    raise SystemExit(
        f"autopar: --annotate {text!r}: unknown annotation {spec!r}; use colwise:AXIS, "
        "rowwise:AXIS, replicated or place:S(0),R"
    )


def load_factory(target: str, model_only: bool = False):
    """'pkg.mod:fn' -> (model, args, kwargs) from calling fn() (``model_only``: the model; fn may
    then return just the model)."""
    module_name, _, attr = target.partition(":")
    if not attr:
        raise SystemExit(f"autopar: {target!r}: write PACKAGE.MODULE:FACTORY, e.g. autopar.models.examples:gpt")
    if os.getcwd() not in sys.path and "" not in sys.path:
        # ``python -m autopar`` has the current directory on sys.path, the ``autopar`` script (run
        # from its bin/ folder) has not: both import a factory from where the user stands
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"autopar: cannot load {target!r}: {e}") from None
    made = factory()
    if model_only:
        return made[0] if isinstance(made, tuple) else made
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise SystemExit(
            f"autopar: {target} returned {type(made).__name__}; a factory returns "
            "(model, example_args) or (model, example_args, example_kwargs)."
        )
    model, args = made[0], made[1]
    return model, args if isinstance(args, tuple) else (args,), (made[2] if len(made) == 3 else {})


def preset_annotations(spec: str, model, mesh, args, kwargs, sequence_parallel: bool = False) -> dict:
    """Annotations from ``autopar.presets``: ``megatron`` or ``megatron:AXIS`` (default axis tp).

    A preset is a function ``preset(model, axis, *, args, kwargs[, sequence_parallel])``
    returning {pattern: annotation} (``presets.megatron``)."""
    name, _, axis = spec.partition(":")
    axis = axis or ("tp" if "tp" in mesh.axis_names else mesh.axis_names[-1])
    preset = getattr(presets, name, None)
    if preset is None or not callable(preset):
        raise SystemExit(
            f"autopar: no preset {name!r} in autopar.presets; annotate with --annotate PATTERN=colwise:AXIS instead."
        )
    extra = {"sequence_parallel": True} if sequence_parallel else {}
    with progress(f"finding the {name} annotations"):
        return dict(preset(model, axis, args=args, kwargs=kwargs, **extra))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autopar", description="Plan a PyTorch model over a process mesh.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, what in (
        ("plan", "print the plan table and summary"),
        ("check", "simulate every rank and compare with the serial model"),
        ("dry-run", "run rank programs at full size on fake tensors: measured memory, collectives, FLOPs"),
    ):
        s = sub.add_parser(name, help=what)
        if name == "dry-run":
            s.add_argument("--rank", type=int, default=None, help="the rank to run (default: every distinct one)")
            s.add_argument("--device", default="cuda", help="the device the fake tensors are on (default cuda)")
            s.add_argument("--steps", type=int, default=2, help="training steps to run (default 2)")
        s.add_argument("factory", help="PACKAGE.MODULE:FACTORY returning (model, example_args)")
        s.add_argument("--mesh", required=True, help="axis sizes, e.g. dp=2,tp=2")
        s.add_argument("--preset", help="annotations from autopar.presets: NAME or NAME:AXIS (e.g. megatron)")
        s.add_argument("--sequence-parallel", action="store_true", help="ask the preset for sequence parallelism")
        s.add_argument("--annotate", action="append", default=[], metavar="PATTERN=KIND[:ARG]")
        s.add_argument(
            "--dp", default="auto", help="data-parallel axis ('none' for none; default: the axis named dp, if any)"
        )
        s.add_argument("--explain", action="append", default=[], metavar="NAME")
        s.add_argument("--cost", action="store_true", help="print costs as formulas")
        s.add_argument("--sizes", default="", help="names for static sizes in formulas, e.g. H=32,V=64")
        s.add_argument("--save", help="write the plan as JSON")
        s.add_argument("--html", help="write the plan's HTML view")
        s.add_argument("--summary-only", action="store_true", help="print the summary, not the table")
        s.add_argument("--collectives-only", action="store_true", help="table rows only for ops with collectives")
    c = sub.add_parser("convert", help="a DCP checkpoint (any plan or mesh) to a HuggingFace directory")
    c.add_argument("dcp_dir")
    c.add_argument("hf_dir")
    c.add_argument("--model", required=True, help="PACKAGE.MODULE:FACTORY returning the serial model")
    c.add_argument("--key", default=None, help="prefix the model's dict was saved under (default: found)")
    return p


def make_plan(opts):
    mesh = parse_mesh(opts.mesh)
    model, args, kwargs = load_factory(opts.factory)
    annotations = (
        preset_annotations(opts.preset, model, mesh, args, kwargs, opts.sequence_parallel) if opts.preset else {}
    )
    annotations.update(dict(parse_annotation(a) for a in opts.annotate))
    dp = ("dp" if "dp" in mesh.axis_names else None) if opts.dp == "auto" else (None if opts.dp == "none" else opts.dp)
    with progress(f"tracing and planning {type(model).__name__} on {mesh}"):
        plan = make(model, mesh, args=args, kwargs=kwargs, annotations=annotations, data_parallel=dp)
    return plan, args, kwargs


def run(opts, out=None) -> int:
    out = out or sys.stdout
    plan, args, kwargs = make_plan(opts)
    if opts.command == "dry-run":  # the plan's own table is ``autopar plan``'s
        with progress(f"dry-running {plan.mesh.size}-rank programs on fake {opts.device} tensors"):
            report = plan.dry_run(rank=opts.rank, device=opts.device, steps=opts.steps)
        print(report, file=out)
        return 0
    with progress("costing the plan"):
        text = plan.summary() if opts.summary_only else plan_table(plan, only_collectives=opts.collectives_only)
    print(text, file=out)
    for name in opts.explain:
        print("\n" + plan.explain(name), file=out)
    if opts.cost:
        sizes = dict((k, int(v)) for k, v in (kv.split("=") for kv in opts.sizes.split(",") if kv))
        print("\n" + str(plan.cost(sizes=sizes)), file=out)
    if opts.save:
        plan.save(opts.save)
        print(f"\nplan saved to {opts.save}", file=out)
    if opts.html:
        with open(opts.html, "w") as f:
            f.write(plan._repr_html_())
    if opts.command == "check":
        with progress(f"simulating {plan.mesh.size} ranks against the serial model"):
            report = plan.check(*args, **kwargs)
        print(
            f"\ncheck passed: {report['outputs']} outputs and {report['grads']} gradients match "
            f"the serial model (max relative difference {report['max_rel']:.2e})",
            file=out,
        )
    return 0


def convert_command(opts) -> int:
    """``autopar convert DCP_DIR HF_DIR --model PACKAGE.MODULE:FACTORY [--key model]``."""
    model = load_factory(opts.model, model_only=True)
    names = dcp_to_hf(opts.dcp_dir, opts.hf_dir, model, opts.key)
    print(f"wrote {len(names)} tensors of {type(model).__name__} to {opts.hf_dir}")
    return 0


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        if opts.command == "convert":
            return convert_command(opts)
        return run(opts)
    except PlanError as e:  # PlanMismatch is an AssertionError: a failed check, also reported here
        print(f"autopar: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except AssertionError as e:
        print(f"autopar: check failed: {e}", file=sys.stderr)
        return 1
