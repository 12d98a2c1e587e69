"""Float8 Linear layers as torchao's float8 training runs them (tensorwise dynamic scaling).

Which matmuls: every ``nn.Linear`` but the LM head, the one torchtitan leaves out
(``convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "output")``,
torchtitan/float8.py at 9dec370): here the Linear whose output features are an embedding's
vocabulary outside the repeated blocks. Their matmuls run at the profile's bf16 rate times its datasheet fp8 / bf16 ratio
(``Profile.fp8_ratio``: 2 on H100 and H200).

What the casts move (torchao eab345c, float8/float8_linear.py and float8_ops.py; bytes per
element of the tensor cast, read from a bf16 tensor of 2 bytes, an fp8 one of 1):

- each cast is an amax pass (a read, 2) and a scaled cast (a read and an fp8 write, 3): 5;
- forward casts the input and the weight (``cast_input_to_float8``, ``cast_weight_to_float8_t``);
  compiled, the same input cast for several Linears (q, k, v; gate, up) is one kernel (AOTAutograd
  de-duplicates identical ops), eager it is cast once per Linear. Where FSDP (zero=3) gathers the
  weight, torchtitan's 405B config gathers it in fp8 (``enable_fsdp_float8_all_gather`` and
  ``precompute_float8_dynamic_scale_for_fsdp``: the shard is cast before the all-gather, its scale
  computed after the optimizer step): the cast is of the rank's shard, 1/dp of the weight;
- backward casts grad_output (``NoopFwToFloat8BwDynamic``: 5), and ``torch._scaled_mm`` wants its
  first operand row-major and its second column-major, so ``float8_mm`` copies the fp8 weight for
  grad_input and the fp8 grad_output and input for grad_weight (a read and a write: 2 each).

Saved for backward: the fp8 input and weight (``manual_float8_matmul_with_args_in_float8``), one
byte per element where bf16 Linear autograd keeps the bf16 input; not in the memory model (see
docs/auto.md).

What the cost model adds per op (cost/execution.py's op_seconds, through ``Float8.op_extras``:
the fp8 rate, ``cast_bytes`` and ``scale_seconds``), where the search and ap.predict price a plan
in float8 (``profile.float8``) or the plan has ap.Float8.

Example:
    >>> sorted(float8_linears(plan))               # ['linear', 'linear_1', ...] (not lm_head's)
    >>> cast_bytes(plan, Numbers(plan.mesh), compiled=True)["linear"]   # (forward, backward) bytes
"""

from __future__ import annotations

import torch

from autopar.runtime.ring import ring_bytes, ring_steps
from autopar.sharding.propagate import layout_of
from autopar.sharding.rules import op_traits
from autopar.trace.model_members import named_modules
from autopar.trace.module_paths import module_path

CAST = 5  # bytes per element: amax (read 2) + scaled cast (read 2, write 1)
RELAYOUT = 2  # bytes per element: an fp8 tensor copied to the other memory order (read 1, write 1)


def float8_linears(plan) -> dict:
    """node name -> the Linear's weight parameter name, for each matmul of an ``nn.Linear`` that
    float8 training converts (all but the LM head)."""
    modules = dict(named_modules(plan.model))
    vocab = {m.num_embeddings for m in modules.values() if isinstance(m, torch.nn.Embedding)}
    out = {}
    for node in plan.graph.nodes:
        if node.op != "call_function" or op_traits(node.target).work.kind != "matmul":
            continue
        path = module_path(node)
        mod = modules.get(path)
        head = mod is not None and not _in_block(path) and getattr(mod, "out_features", None) in vocab
        if isinstance(mod, torch.nn.Linear) and not head:
            out[node.name] = f"{path}.weight" if path else "weight"
    return out


def lm_heads(model) -> tuple:
    """Module paths of the Linears float8 training leaves in high precision: the LM head (a Linear
    outside the repeated blocks whose outputs are an embedding's vocabulary), as torchtitan does.
    ``ap.Auto(float8=True)``'s plan runs ``ap.Float8(skip=lm_heads(model))``."""
    modules = dict(named_modules(model))
    vocab = {m.num_embeddings for m in modules.values() if isinstance(m, torch.nn.Embedding)}
    return tuple(
        p
        for p, m in modules.items()
        if isinstance(m, torch.nn.Linear) and not _in_block(p) and getattr(m, "out_features", None) in vocab
    )


def _in_block(path: str) -> bool:
    """Whether a module path runs inside a repeated block (a numbered module on the way)."""
    return any(part.isdigit() for part in path.split("."))


def _local(node, spec, sy) -> float:
    val = node.meta.get("val")
    return float(sy.numel(val.shape, spec)) if isinstance(val, torch.Tensor) else 0.0


def cast_bytes(plan, sy, compiled: bool, weight_shards: float = 1.0) -> dict:
    """node name -> (forward, backward) bytes of the casts and copies float8 adds to that
    Linear's matmul on one rank (the module docstring); ``weight_shards``: how many ranks' shards
    a gathered weight is cast from (zero=3's dp size: each casts its own before the fp8 gather)."""
    out, cast_inputs = {}, set()
    nodes = {n.name: n for n in plan.graph.nodes}
    for name in float8_linears(plan):
        node = nodes[name]
        lay = layout_of(node)
        x, w = node.args[0], node.args[1]
        targets = dict(zip(lay.inputs, lay.input_targets))
        x_e, w_e = _local(x, targets.get(x), sy), _local(w, targets.get(w), sy)
        y_e = _local(node, lay.spec, sy)
        fwd = CAST * w_e / weight_shards
        if not (compiled and x in cast_inputs):
            fwd += CAST * x_e
        cast_inputs.add(x)
        bwd = CAST * y_e + RELAYOUT * (w_e + y_e + x_e) if plan.ctx.needs_grad.get(node) else 0.0
        out[name] = (fwd, bwd)
    return out


def fsdp_shards(plan) -> float:
    """How many ranks zero=3 shards a parameter over (1 without zero=3): a Float8 weight gathered
    by FSDP is cast on each rank's shard before the gather."""
    shards = plan.weight_shards
    return 1.0 if shards is None else float(shards[1])


AMAX_FP32 = 4  # bytes of one weight's amax in the fp8 gather's all-reduce (float32)


def _split_axes(spec) -> tuple:
    return tuple(a for a, p in enumerate(spec or ()) if p.is_shard())


def scale_comms(plan, fp8_gathered: bool | None = None) -> dict:
    """node name -> [(mesh axes, phase, bytes per rank)] of the amax all-reduces (max) float8
    training adds to that Linear on these layouts, as the float8 plan runs them (tensorwise: the
    recipe the search prices; parallel/float8/rule.py's lowering): each of the six casts reduces its
    one amax (in the tensor's dtype) over every axis splitting the tensor it reads (input, weight,
    output gradient), the backward's casts only where a gradient flows. Where zero=3 gathers the
    weights in fp8 (``fp8_gathered``; None: the plan's own ap.Float8(fp8_all_gather=True), or the
    search's float8 pricing under zero=3), the weight's two casts are the gather's instead: one
    all-reduce of every such weight's float32 amax per forward, over the shard group and the axes
    splitting them, listed at the first Linear (gather.py's precompute).

    The casts' reductions are those of a plan the search prices in float8 (ap.Auto(float8=True):
    no ap.Float8 yet); a plan with ap.Float8 lists its own in plan.collectives() (the lowering's),
    which the search and ap.predict read, and gets here only the fp8 gather's all-reduce, which
    plan.collectives() lists over several axes at once ("float8 weight scales"), beyond the
    per-axis activation terms the search reads.

    Example:
        >>> scale_comms(plan)["linear"]     # [((1,), 'forward', 4.0), ((0,), 'backward', 8.0), ...]
    """
    mesh, out = plan.mesh, {}
    casts = getattr(plan.options, "float8", None) is None  # a plan with ap.Float8 lists its casts' own
    nodes = {n.name: n for n in plan.graph.nodes}
    if fp8_gathered is None:
        f8 = getattr(plan.options, "float8", None)
        fp8_gathered = bool(getattr(f8, "fp8_all_gather", True)) and _zero3_axis(plan) is not None
    wire_axes, n_weights, first = set(), 0, None
    for name in float8_linears(plan):
        node = nodes[name]
        lowered = getattr(node.target, "namespace", None) == "autopar"
        lay = layout_of(node)
        x, w = (lay.input_targets + [None, None])[:2]
        split = {0: _split_axes(x), 1: _split_axes(w), 2: _split_axes(lay.spec)}
        if fp8_gathered and (casts or lowered):
            n_weights += 1
            wire_axes |= set(split[1])
            first = first or name
        if lowered or not casts:
            continue
        grad = plan.ctx.needs_grad.get(node)
        dtypes = {
            0: node.args[0].meta["val"].dtype,
            1: node.args[1].meta["val"].dtype,
            2: node.meta["val"].dtype,
        }
        comms = []
        for role, tensor in enumerate((0, 1, 2, 1, 2, 0)):
            if (role >= 2 and not grad) or (fp8_gathered and tensor == 1):
                continue
            for a in split[tensor]:
                phase = "forward" if role < 2 else "backward"
                comms.append(((a,), phase, float(ring_bytes("all_reduce", dtypes[tensor].itemsize, mesh.shape[a]))))
        out[name] = comms
    if fp8_gathered and n_weights:
        axes = tuple(sorted(wire_axes | {_zero3_axis(plan)}))
        n = 1
        for a in axes:
            n *= mesh.shape[a]
        if n > 1:
            out.setdefault(first, []).append(
                (axes, "forward", float(ring_bytes("all_reduce", AMAX_FP32 * n_weights, n)))
            )
    return out


def _zero3_axis(plan):
    """The data-parallel axis zero=3 shards over, or None without zero=3."""
    shards = plan.weight_shards
    return None if shards is None else shards[0]


def scale_seconds(plan, profile, fp8_gathered: bool | None = None) -> dict:
    """node name -> (forward s, backward s) of ``scale_comms``: each all-reduce its link's latency
    per ring round plus its bytes at the link's bandwidth (a group over several axes on the
    slowest, outermost one's link). Latency-bound: a few bytes each, 2(n-1) rounds."""
    out = {}
    for name, comms in scale_comms(plan, fp8_gathered).items():
        fwd = bwd = 0.0
        for axes, phase, nbytes in comms:
            n = 1
            for a in axes:
                n *= plan.mesh.shape[a]
            alpha, beta = profile.link(plan.mesh, min(axes))
            t = alpha * ring_steps("all_reduce", n) + nbytes / beta
            if phase == "forward":
                fwd += t
            else:
                bwd += t
        out[name] = (fwd, bwd)
    return out
