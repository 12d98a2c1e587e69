"""plan.save(path) and ap.load_plan(path, model): a plan as JSON, and back (the file's side:
writing it, and reading it into what the planner needs to make the plan again, planner.load_plan).

The file records the model's parameter names, shapes and dtypes, the mesh, the resolved
annotations (seeds), the example inputs' shapes and structure, and for every node its
layout and the strategy chosen on each axis. Loading re-traces the model (a plan is tied to
a graph), re-propagates from the recorded seeds and then *enforces the recorded choices*:
where today's cost model would pick another strategy, the saved one is rebuilt from the rule.
The result is checked node by node against the file, so a loaded plan has exactly the saved
layouts, or loading fails saying where it differs. A file saved for another model (other
parameters) or another mesh is refused with the difference named.

Example:
    >>> plan.save("gpt_dp2_tp2.json")
    >>> again = ap.load_plan("gpt_dp2_tp2.json", model)
    >>> assert not plan.diff(again)
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import torch
import torch.utils._pytree as pytree

from autopar.placement import parse_placement as _parse_placement
from autopar.errors import PlanError, ShardingError
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.parallel import TECHNIQUES
from autopar.sharding.annotations import Seeds
from autopar.sharding.propagate import Layout, layout_of, op_info, tensor_inputs
from autopar.sharding.rules import get_rule

FORMAT, VERSION = "autopar-plan", 1


class PlanFileError(PlanError):
    """A saved plan that does not fit the model, mesh or this version of autopar."""


# ------------------------------------------------------------------------------- placements
def placement_text(p) -> str:
    return repr(p)


def parse_placement(text: str):
    """A placement from its text (the one definition lives in placement.py)."""
    try:
        return _parse_placement(text)
    except ShardingError as e:
        raise PlanFileError(f"{e} (in a plan file)") from None


def _spec_out(spec):
    return [placement_text(p) for p in spec]


def _spec_in(items):
    return tuple(parse_placement(t) for t in items)


# -------------------------------------------------------------------------------------- save
def model_params(model) -> list:
    return [
        [n, list(p.shape), str(p.dtype).replace("torch.", "")]
        for n, p in model.named_parameters(remove_duplicate=False)
    ]


def _input_meta(node):
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        shape = [int(s.node.hint) if isinstance(s, torch.SymInt) else int(s) for s in val.shape]
        return {"shape": shape, "dtype": str(val.dtype).replace("torch.", "")}
    if isinstance(val, torch.SymInt):
        return {"value": int(val.node.hint)}
    return {"value": val}


def plan_record(plan) -> dict:
    seeds = plan.seeds
    phs = {n.name: n for n in plan.graph.nodes if n.op == "placeholder"}
    nodes = []
    for n in plan.graph.nodes:
        if "autopar" not in n.meta:
            continue
        lay = layout_of(n)
        nodes.append(
            {
                "name": n.name,
                "target": str(n.target),
                "outputs": [_spec_out(s) for s in lay.outputs],
                "strategies": [None if s is None else repr(s) for s in lay.strategies],
                "reason": lay.reason,
            }
        )
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": {"class": type(plan.model).__name__, "params": model_params(plan.model)},
        "mesh": {"shape": list(plan.mesh.shape), "axes": list(plan.mesh.axis_names)} | _parts(plan.mesh),
        "data_parallel": None if plan.batch_axis is None else plan.mesh.axis_names[plan.batch_axis],
        "autopar_version": _version(),
        "options": _options_out(plan.options),
        "dynamic": plan.traced.dynamic,
        "auto": plan.built.get("auto"),  # the search's record (ap.plan(auto=...)), JSON
        "inputs": {
            "names": list(plan.traced.user_inputs),
            "metas": [_input_meta(phs[name]) for name in plan.traced.user_inputs],
            "spec": pytree.treespec_dumps(plan.traced.in_spec),
        },
        "seeds": {
            "params": {k: _spec_out(v) for k, v in seeds.params.items()},
            "inputs": {k: _spec_out(v) for k, v in seeds.inputs.items()},
            "module_outputs": {
                k: {str(a): placement_text(p) for a, p in v.items()} for k, v in seeds.module_outputs.items()
            },
            "reasons": dict(seeds.reasons),
            "experts": dict(seeds.experts),
            "expert_tp": dict(seeds.expert_tp),
        },
        "nodes": nodes,
    }


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("autopar")
    except Exception:  # noqa: BLE001 - not installed (running from a checkout)
        return "unknown"


def _options_out(options) -> dict:
    """ap.PlanOptions as JSON: plain fields as they are, each registered technique under its name
    by its own fields() (None when the plan has none)."""
    out = {
        f.name: getattr(options, f.name)
        for f in dataclasses.fields(options)
        if f.name not in ("techniques", "split_before", "auto")
    }  # auto: done, see "auto"
    for name, cls in TECHNIQUES.items():
        technique = getattr(options, name)
        out[name] = None if technique is None else {f"__{cls.__name__}__": technique.fields()}
    return out


def _options_in(options: dict, path):
    """The ap.PlanOptions of a plan file (older files: unknown keys are ignored, with a warning)."""
    known = {f.name for f in dataclasses.fields(PlanOptions)} - {"techniques"}
    kept = {}
    for k, v in options.items():
        if k in TECHNIQUES:
            cls = TECHNIQUES[k]
            kept[k] = cls.from_fields(v[f"__{cls.__name__}__"]) if isinstance(v, dict) else None
        elif k in known:
            kept[k] = v
        elif k not in ("bucket_bytes", "bucket_max_params"):  # version-1 files: now DataParallel's
            warnings.warn(
                f"autopar: plan option {k!r} in {path} is not an option of this autopar; ignored.", stacklevel=3
            )
    return PlanOptions(**kept)


def save_plan(plan, path) -> None:
    for technique in plan.options.techniques:
        try:
            technique.fields()  # a technique that cannot be saved says why and what to do
        except PlanError as e:
            raise PlanFileError(str(e)) from None
    with open(path, "w") as f:
        json.dump(plan_record(plan), f, indent=1)


# -------------------------------------------------------------------------------------- load
def _parts(mesh) -> dict:
    """Two mesh axes merged into one (data parallel over both), by their names: what an annotation
    on one of them (experts over the inner axis) and explain's names of its groups read."""
    return {"parts": [list(p) for p in mesh.parts]} if mesh.parts else {}


def read_plan_file(path, model: torch.nn.Module, *, mesh: Mesh | None = None, args=None, kwargs=None) -> dict:
    """What planner.load_plan needs to make the plan saved at ``path`` again for ``model`` (which
    must have the same parameters): its mesh, options, seeds, example inputs, the ``enforce`` hook
    that restores the recorded strategies, and the search's record.

    ``mesh`` (optional) must equal the saved mesh; ``args``/``kwargs`` are example inputs to
    trace with (default: zeros/ones of the saved shapes and dtypes)."""
    with open(path) as f:
        rec = json.load(f)
    _check_header(rec, path)
    _check_model(rec, model, path)
    parts = tuple(tuple(p) for p in rec["mesh"].get("parts", ()))
    saved_mesh = Mesh(tuple(rec["mesh"]["shape"]), tuple(rec["mesh"]["axes"]), parts)
    if mesh is not None and (tuple(mesh.shape) != saved_mesh.shape or tuple(mesh.axis_names) != saved_mesh.axis_names):
        raise PlanFileError(
            f"{path} was saved for mesh {saved_mesh}, not {mesh}: plan again with "
            "ap.plan(...) on the new mesh (layouts depend on the mesh)."
        )
    if args is None and kwargs is None:
        args, kwargs = example_inputs(rec)
    options = _options_in(rec["options"], path)
    if "dynamic" in rec:
        options = options.replace(dynamic=rec["dynamic"])
    return {
        "mesh": saved_mesh,
        "options": options,
        "seeds": _seeds_in(rec["seeds"]),
        "args": args if isinstance(args, tuple) else (args,),
        "kwargs": kwargs,
        "enforce": lambda graph: _enforce(graph, rec["nodes"], saved_mesh, path),
        "auto": rec.get("auto"),
    }


def _check_header(rec, path) -> None:
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise PlanFileError(f"{path} is not an autopar plan file (no 'format': {FORMAT!r}).")
    if rec.get("version", 0) > VERSION:
        raise PlanFileError(
            f"{path} has plan format version {rec['version']}; this autopar reads up to {VERSION}. Upgrade autopar."
        )


def _check_model(rec, model, path) -> None:
    saved = rec["model"]
    if saved["class"] != type(model).__name__:
        raise PlanFileError(f"{path} was saved for a {saved['class']} model, not {type(model).__name__}.")
    have = {n: (s, d) for n, s, d in model_params(model)}
    want = {n: (s, d) for n, s, d in saved["params"]}
    for name in sorted(set(have) | set(want)):
        if have.get(name) != want.get(name):
            h, w = have.get(name), want.get(name)
            raise PlanFileError(
                f"{path} was saved for another {saved['class']}: parameter {name!r} is "
                f"{'missing' if h is None else f'shape {h[0]} {h[1]}'} in this model but "
                f"{'absent' if w is None else f'shape {w[0]} {w[1]}'} in the plan. Load it with the "
                "model configuration it was planned for, or plan this model anew."
            )


def example_inputs(rec) -> tuple[tuple, dict]:
    """Inputs of the saved shapes and dtypes (zeros for integers, ones for floats)."""
    leaves = []
    for meta in rec["inputs"]["metas"]:
        if "shape" in meta:
            dtype = getattr(torch, meta["dtype"])
            make = torch.ones if dtype.is_floating_point else torch.zeros
            leaves.append(make(meta["shape"], dtype=dtype))
        else:
            leaves.append(meta["value"])
    spec = pytree.treespec_loads(rec["inputs"]["spec"])
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    return tuple(args), dict(kwargs)


def _seeds_in(s: dict) -> Seeds:
    return Seeds(
        {k: _spec_in(v) for k, v in s["params"].items()},
        {k: _spec_in(v) for k, v in s["inputs"].items()},
        {k: {int(a): parse_placement(p) for a, p in v.items()} for k, v in s["module_outputs"].items()},
        dict(s["reasons"]),
        {k: int(a) for k, a in s.get("experts", {}).items()},
        {k: int(a) for k, a in s.get("expert_tp", {}).items()},
    )


def _enforce(graph, saved_nodes, mesh, path) -> None:
    """Give every node its recorded strategies; then require the recorded layouts exactly."""

    nodes = {n.name: n for n in graph.nodes if "autopar" in n.meta}
    if set(nodes) != {r["name"] for r in saved_nodes}:
        extra = sorted(set(nodes) ^ {r["name"] for r in saved_nodes})[:5]
        raise PlanFileError(
            f"{path}: the model traces to another graph than the saved plan's "
            f"(nodes {extra} differ): its code changed since the plan was saved. Plan it anew."
        )
    for r in saved_nodes:
        node = nodes[r["name"]]
        if str(node.target) != r["target"]:
            raise PlanFileError(
                f"{path}: node {node.name!r} is {node.target} now but was {r['target']} "
                "when the plan was saved; plan the model anew."
            )
        lay = layout_of(node)
        recorded = r["strategies"]
        if (
            node.op == "call_function"
            and any(recorded)
            and [None if x is None else repr(x) for x in lay.strategies] != recorded
        ):
            node.meta["autopar"] = _forced_layout(node, lay, recorded, get_rule(node.target), mesh, r["reason"])
        if [_spec_out(o) for o in layout_of(node).outputs] != r["outputs"]:
            raise PlanFileError(
                f"{path}: node {node.name!r} comes out {layout_of(node).outputs} but the plan "
                f"recorded {r['outputs']}; plan the model anew."
            )


def _forced_layout(node, lay, recorded, rule, mesh, reason) -> Layout:
    offered = {repr(s): s for s in rule(op_info(node))} if rule else {}
    chosen = []
    for axis, text in enumerate(recorded):
        if text not in offered:
            raise PlanFileError(
                f"node {node.name!r}: the saved strategy {text} on axis "
                f"{mesh.axis_names[axis]!r} is no longer offered by {getattr(rule, '__name__', rule)}."
            )
        chosen.append(offered[text])
    ins = tensor_inputs(node)
    outputs = [tuple(chosen[a].outputs[j] for a in range(mesh.ndim)) for j in range(len(lay.outputs))]
    targets = [tuple(chosen[a].inputs[i] for a in range(mesh.ndim)) for i in range(len(ins))]
    return Layout(outputs, ins, targets, tuple(chosen), f"restored from the plan file: {reason}", lay.alternatives)
