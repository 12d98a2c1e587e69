"""Activation memory as autograd keeps it: the tensors backward saves, not every intermediate.

Each op of the plan's graph is run once on the meta device at its traced sizes under
``torch.autograd.graph.saved_tensors_hooks``; what its backward saves is read off there: which of
its inputs, which of its outputs, and any other tensor (a norm's mean and rstd, a max's indices).
A saved tensor counts once (two consumers saving the same activation hold one storage), at its
*producer's* local size on a rank (a view counts as its base, whose storage it keeps). The model
outputs (the logits a loss reads) count too: the caller holds them; not when the model returns
its own loss (the caller keeps the loss and drops the rest: ``held_outputs``).

Where the runtime differs from the op autograd would run, the table below says what is kept:
autopar lowers dropout to ``x * mask`` with a mask of x's dtype (runtime/rng.py), a dropout of
p == 0 returns its input (no mask, no new tensor: it counts as a view), and CPU/GPU
attention kernels (flash, efficient, the CPU flash kernel) keep q, k, v, the output and the
log-sum-exp rows, never the s x s matrix the meta device's math path would. A kept input the
program gathers on the way in (sequence parallelism's norm output, read whole by the next
matmul) counts gathered, once per layout (``edge_gathers``). An op whose
lowering runs something else says what that keeps (``Lowering.kept``: context-parallel
attention keeps all-gathered K/V, a storage of cp x the rank's piece: ``Saved.gathered``) and
what it holds while it runs (``Lowering.workspace``, ``workspace_bytes``).

Example:
    >>> saves = saved_activations(plan)          # [Saved(consumer, producer, index), ...]
    >>> activation_bytes(plan, sy, saves)        # a formula in the plan's dims
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.placement import Replicate, Shard
from autopar.sharding.lowerings.base import lowering_for
from autopar.sharding.lowerings.random_draws import random_lowering
from autopar.sharding.propagate import layout_of, tensor_outputs
from autopar.trace.module_paths import module_paths
from autopar.sharding.rules import VIEW, op_traits

aten = torch.ops.aten
ATTENTION_OPS = {aten.scaled_dot_product_attention.default}
DROPOUT_OPS = {aten.dropout.default, aten.dropout_.default, aten.feature_dropout.default}


_PROBES: dict = {}  # (op, argument sizes and dtypes) -> what its backward keeps: asked once per process


@dataclass(frozen=True)
class Saved:
    """``consumer``'s backward keeps output ``index`` of ``producer`` (a node of the plan's graph);
    ``producer`` None: a tensor of its own (``nbytes_of`` of the consumer's output sizes)."""

    consumer: str
    producer: str | None
    index: int = 0
    fraction: float = 0.0  # own tensors: bytes as a fraction of ``ref``'s bytes
    ref: tuple = ("out", 0)  # own tensors: the consumer's largest tensor ("in", i) or ("out", j)
    gathered: tuple = ()  # mesh axes the producer's value was gathered on (a storage of its own)
    edge: bool = False  # gathered by the consumer's input edge: one storage per (producer, layout)


def share_saved_activations(plan, saves: list[Saved]) -> None:
    """Give ``plan`` the saved tensors of another plan on the same graph and layouts (the search's
    variants under other technique options), so that they are not probed again. A node whose
    lowering states what it keeps is asked again: what it keeps may depend on the options
    (context-parallel attention: all-gather keeps the gathered K/V, the ring its own pieces,
    Ulysses the head-split q, K, V; a ring plan given all-gather's saves was priced at
    all-gather's memory)."""
    by_consumer: dict = {}
    for s in saves:
        by_consumer.setdefault(s.consumer, []).append(s)
    out = []
    for node in plan.graph.nodes:
        kept = _lowered_kept(plan, node) if _keeps(plan, node) else None
        out += _as_saves(node, kept) if kept is not None else by_consumer.get(node.name, [])
    plan.__dict__["_saved_activations"] = out


def saved_activations(plan) -> list[Saved]:
    """Every tensor the plan's backward keeps, once per (consumer, producer, index)."""
    cache = plan.__dict__.setdefault("_saved_activations", None)
    if cache is not None:
        return cache
    out, probes = [], _PROBES
    for node in plan.graph.nodes:
        if not _keeps(plan, node):
            continue
        kept = _lowered_kept(plan, node)
        out += _as_saves(node, _kept(node, probes) if kept is None else kept)
    plan.__dict__["_saved_activations"] = out
    return out


def _keeps(plan, node: fx.Node) -> bool:
    """Whether ``node``'s backward may keep tensors: an op (not a view, not getitem) that needs a gradient."""
    if node.op != "call_function" or not plan.ctx.needs_grad.get(node) or op_traits(node.target).work is VIEW:
        return False
    return node.target is not operator.getitem


def _as_saves(node: fx.Node, kept: list[tuple]) -> list[Saved]:
    """``node``'s kept entries (``_kept``'s or a lowering's tuples) as Saved records."""
    out = []
    for kind, i, frac, *ref in kept:
        if kind == "gathered":  # input i gathered on mesh axis ``frac``: its own storage
            base, idx = base_of(_tensor_args(node)[i])
            out.append(Saved(node.name, base.name, idx, gathered=(frac,)))
        elif kind == "in":
            inp = _tensor_args(node)[i]
            base, idx = base_of(inp)
            if base.op in ("placeholder", "get_attr"):
                continue  # parameters and inputs (or views of them): held by their owners
            axes = edge_gathers(node, inp)
            out.append(
                Saved(node.name, inp.name, 0, gathered=axes, edge=True) if axes else Saved(node.name, base.name, idx)
            )
        elif kind == "out":
            out.append(Saved(node.name, node.name, i))
        else:  # the i-th tensor of its own (a lowering may keep several of one size)
            out.append(Saved(node.name, None, i, frac, tuple(ref[0]) if ref else ("out", 0)))
    return out


def edge_gathers(node: fx.Node, inp: fx.Node) -> tuple:
    """The mesh axes on which ``node`` reads ``inp`` gathered (``inp`` split there, ``node``'s
    input target whole): the planned program all-gathers it on the way in (codegen/emit.edge,
    once per layout, shared by every reader of that layout), and what ``node``'s backward keeps
    of it is the gathered tensor, a storage of its own, not ``inp``'s piece. Measured: under
    Megatron's sequence parallelism the head reads the final norm's output gathered over tp (a
    dry run of LLaMA-405B widths: 1.0 GiB a micro-batch, where the piece is 0.125)."""
    if "autopar" not in node.meta or "autopar" not in inp.meta:
        return ()
    lay = layout_of(node)
    target = next((t for x, t in zip(lay.inputs, lay.input_targets) if x is inp), None)
    spec = layout_of(inp).spec
    if target is None or spec is None:
        return ()
    return tuple(a for a, (p, t) in enumerate(zip(spec, target)) if isinstance(p, Shard) and isinstance(t, Replicate))


def held_outputs(plan) -> list[tuple[str, int]]:
    """The model's outputs that are activations the caller holds: the logits its loss reads.
    A model that returns its own loss (a 0-dim float output) is not counted for the others: the
    caller keeps the loss and drops the rest before backward (HF's Trainer, torchtitan's ``del
    pred``, the benches), and what backward needs of them is in the saved tensors already.
    Measured: on an H100 the HF LLaMA's 500 MiB of bf16 logits were the whole of the model's
    over-count (bench/gpu_activation_memory.py, docs/activation_checkpointing.md)."""
    out_node = next(n for n in plan.graph.nodes if n.op == "output")
    leaves = [v for v in torch.utils._pytree.tree_leaves(out_node.args[0]) if isinstance(v, fx.Node)]
    if any(_is_loss(v) for v in leaves):
        return []
    held = []
    for v in leaves:
        if v.op == "call_function":
            base, idx = base_of(v)
            held.append((base.name, idx))
    return held


def dropped_outputs_bytes(plan, sy):
    """What the model's other outputs hold at the end of the forward where it returns its own
    loss (held_outputs: the caller drops them, so they are not activations) and they leave
    gathered (a context-parallel or vocabulary-split model's logits, gathered to the serial
    layout): a storage of its own, twice, the received pieces and their concatenation alive at
    once (runtime/dist_backend.all_gather). Measured (bench/bench_context_parallel.py, gloo):
    the cp runs' peak sat at that concatenation, at the end of the forward."""
    out_node = next(n for n in plan.graph.nodes if n.op == "output")
    leaves = [v for v in torch.utils._pytree.tree_leaves(out_node.args[0]) if isinstance(v, fx.Node)]
    if not any(_is_loss(v) for v in leaves):
        return 0
    total = 0
    for v in leaves:
        if v.op != "call_function" or _is_loss(v):
            continue
        base, idx = base_of(v)
        local, leaving = tensor_bytes(plan, sy, base.name, idx), tensor_bytes(plan, sy, base.name, idx, leaving=True)
        if sy.value(leaving - local) != 0:
            total = total + 2 * leaving
    return total


def _is_loss(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point()


def tensor_bytes(plan, sy, name: str, index: int = 0, leaving: bool = False, gathered: tuple = ()):
    """Local bytes of output ``index`` of node ``name`` on a rank (as a formula of ``sy``);
    ``leaving``: as it leaves the program (a model output gathered but on the batch axis);
    ``gathered``: mesh axes on which it is whole (gathered there)."""
    node = _node(plan, name)
    vals = tensor_outputs(node)
    if not vals or index >= len(vals) or vals[index] is None:
        return 0
    specs = layout_of(node).outputs if "autopar" in node.meta else []
    spec = specs[index] if index < len(specs) else None
    if leaving and spec is not None:
        spec = plan.output_target(spec)
    if gathered and spec is not None:
        spec = tuple(Replicate() if a in gathered else p for a, p in enumerate(spec))
    return sy.numel(vals[index].shape, spec) * vals[index].dtype.itemsize


def bytes_by_node(plan, sy, saves: list[Saved] | None = None, with_outputs: bool = True) -> dict:
    """Node name -> bytes of the kept tensors it made (``saves``, default: all of the plan's),
    each storage once, plus the model's outputs: what the search adds per node.

    Kept on the plan for the last few (saves, sy) objects: costing one plan asks the same list
    two or three times (the search's terms, then the activation terms, then checkpointing's),
    each time the same objects (saved_activations' list, checkpointed_saves'): compared by
    identity, held so that no other list takes their id."""
    saves = saved_activations(plan) if saves is None else saves
    memo = plan.__dict__.setdefault("_bytes_by_node", [])
    for held, symbols, outputs, got in memo:
        if held is saves and symbols is sy and outputs == with_outputs:
            return dict(got)
    got = _bytes_by_node(plan, sy, saves, with_outputs)
    if len(saves) > 1:  # a single save (a largest-tensor scan) is asked once: not kept
        memo.append((saves, sy, with_outputs, got))
        del memo[:-MEMO_SIZE]
    return dict(got)


MEMO_SIZE = 8  # bytes_by_node's kept answers per plan


def _bytes_by_node(plan, sy, saves: list[Saved], with_outputs: bool) -> dict:
    seen: dict = {}
    for s in saves:
        if s.edge:  # gathered on the way in: one storage for every reader of that layout
            key = ("edge", s.producer, s.gathered)
            seen[key] = (s.producer, tensor_bytes(plan, sy, s.producer, s.index, gathered=s.gathered))
        elif s.gathered:  # the producer's value gathered by a lowering: its own storage
            key = (s.consumer, s.producer, s.gathered)
            seen[key] = (s.producer, tensor_bytes(plan, sy, s.producer, s.index, gathered=s.gathered))
        elif s.index == -1:  # a collective's output of the producer's value: its own storage
            seen[(s.consumer, s.producer)] = (s.producer, tensor_bytes(plan, sy, s.producer, 0))
        elif s.producer is not None:
            seen.setdefault((s.producer, s.index), (s.producer, tensor_bytes(plan, sy, s.producer, s.index)))
        else:
            seen[(s.consumer, "own", s.fraction, s.index)] = (s.consumer, s.fraction * _ref_bytes(plan, sy, s))
    if with_outputs:
        for name, idx in held_outputs(plan):  # at the layout they leave in (gathered logits: a new tensor)
            local = tensor_bytes(plan, sy, name, idx)
            leaving = tensor_bytes(plan, sy, name, idx, leaving=True)
            key = (name, idx) if sy.value(leaving - local) == 0 else (name, idx, "leaving")
            seen.setdefault(key, (name, leaving))
    out: dict = {}
    for name, b in seen.values():
        out[name] = out.get(name, 0) + b
    return out


def activation_bytes(plan, sy, saves: list[Saved] | None = None, with_outputs: bool = True):
    """Bytes the kept tensors ``saves`` (default: all of the plan's) hold on one rank, each
    storage once, plus the model's outputs."""
    return sum(bytes_by_node(plan, sy, saves, with_outputs).values(), 0)


def workspace_bytes(plan, sy):
    """The most one lowered op holds beyond its kept tensors while it runs (Lowering.workspace:
    context-parallel attention's fp32 accumulators and key blocks), as a number or formula of
    ``sy``; 0 where no lowering says. One op runs at a time, so the largest counts."""
    sizes = []
    for node in plan.graph.nodes:
        lay = node.meta.get("autopar")
        found = lowering_for(lay.strategies) if lay is not None and lay.strategies else None
        if found is not None:
            got = found[0].workspace(plan, node, found[1], sy)
            if not (isinstance(got, (int, float)) and got == 0):
                sizes.append(got)
    return max(sizes, key=sy.value, default=0)


def loss_backward_bytes(plan, sy):
    """What backward's first steps hold beside the kept tensors: at the loss, the gradient of its
    largest kept tensor and the gradient of that tensor's input, alive at once (a cross entropy's
    fp32 log-softmax: its gradient, then the logits' gradient, before the first is freed): two
    tensors of the largest tensor the ops after the repeated blocks keep (the head and the loss;
    the whole model's largest without repeated blocks). Measured on an H100 (bench/RESULTS.md,
    GPU section): the HF LLaMA's peak is its held bytes + 2000 MiB (2 x its 1000 MiB log-softmax)
    under none, full and selective checkpointing alike; the GPT's none and selective peaks, its
    held bytes + 2 x its 64 MiB log-softmax."""
    return loss_backward_source(plan, sy)[0]


def loss_backward_source(plan, sy) -> tuple:
    """(``loss_backward_bytes``, the node whose saved tensor sets it: None when nothing is kept).
    The search charges the bytes to that node's component (the head's logits: whether the
    vocabulary is split decides them). Kept on the plan for the last ``sy`` (the search's cost
    of a plan asks it twice: its activation terms, then whose component the bytes are)."""
    held = plan.__dict__.get("_loss_backward")
    if held is not None and held[0] is sy:
        return held[1]
    got = _loss_backward_source(plan, sy)
    plan.__dict__["_loss_backward"] = (sy, got)
    return got


def _loss_backward_source(plan, sy) -> tuple:
    saves = saved_activations(plan)
    nodes = list(plan.graph.nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    found = plan.traced.repeated
    if found is not None:
        inside = [i for i, n in enumerate(nodes) if any(p.startswith(found.prefix + ".") for p in module_paths(n))]
        if inside:
            saves = [s for s in saves if index[s.consumer] > max(inside)]
    sizes = [(activation_bytes(plan, sy, [s], with_outputs=False), s.consumer) for s in saves]
    if not sizes:
        return 0, None
    largest, node = max(sizes, key=lambda v: sy.value(v[0]))
    return 2 * largest, node


def _ref_bytes(plan, sy, s: Saved):
    """Local bytes of the tensor an own saved tensor is sized after (a loss's log-softmax after
    its logits input, not after the scalar it returns)."""
    kind, i = s.ref
    if kind == "out":
        return tensor_bytes(plan, sy, s.consumer, i)
    src = _tensor_args(_node(plan, s.consumer))[i]
    return tensor_bytes(plan, sy, src.name, 0)


# ------------------------------------------------------------------------------ probing
def _node(plan, name: str) -> fx.Node:
    nodes = plan.__dict__.get("_nodes_by_name")
    if nodes is None:
        nodes = plan.__dict__["_nodes_by_name"] = {n.name: n for n in plan.graph.nodes}
    return nodes[name]


def base_of(node: fx.Node) -> tuple[fx.Node, int]:
    """The node whose storage ``node``'s value lives in (views walked back), and its output index.
    A view whose input the program reduces or gathers on the way in (``_moved``) views that
    collective's output: a storage of its own, the view's, at the view's layout. Measured: under
    Megatron tp + sp the first checkpointed block keeps the vocab-parallel embedding's Partial
    output reduce-scattered into sequence pieces by an alias (a dry run of LLaMA-405B widths on
    tp 8: 0.125 GiB a micro-batch, where the whole summand, which was counted, is 1.0)."""
    while True:
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            src = node.args[0]
            if op_traits(src.target).work is VIEW:  # unbind, split: views of their input
                node = _tensor_args(src)[0]
                continue
            return src, node.args[1]
        if node.op == "call_function" and (op_traits(node.target).work is VIEW or identity_dropout(node)):
            if _tensor_args(node) and not _moved(node, _tensor_args(node)[0]):
                node = _tensor_args(node)[0]
                continue
        return node, 0


def _moved(node: fx.Node, inp: fx.Node) -> bool:
    """Whether ``node`` reads ``inp`` through a collective (a Partial value reduced, a piece
    gathered), so that what it reads is a new storage."""
    if "autopar" not in node.meta or "autopar" not in inp.meta:
        return False
    lay = layout_of(node)
    target = next((t for x, t in zip(lay.inputs, lay.input_targets) if x is inp), None)
    spec = layout_of(inp).spec
    if target is None or spec is None:
        return False
    return any(
        (p.is_partial() and not t.is_partial()) or (isinstance(p, Shard) and isinstance(t, Replicate))
        for p, t in zip(spec, target)
    )


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def identity_dropout(node: fx.Node) -> bool:
    """A dropout that returns its input (p == 0, or traced with train=False): ATen's dropout
    then makes no mask and no new tensor (on the CPU and on CUDA alike), and autopar's lowering
    calls it as it is (sharding/lowerings/train_modes.py)."""
    if node.target not in DROPOUT_OPS:
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return p == 0 or train is False


def draws_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (dropout, a random op): a checkpointed region or a
    recomputed pipeline stage keeps a generator-state copy to replay them."""
    if node.target in DROPOUT_OPS:  # a dropout of p = 0 returns its input: no draw, no state read
        return not identity_dropout(node)
    return random_lowering(node.target) is not None


def _lowered_kept(plan, node: fx.Node) -> list[tuple] | None:
    """What ``node``'s lowering keeps in place of the op (sharding/lowerings/base.Lowering.kept),
    or None where it has no lowering or keeps what the op would."""
    lay = node.meta.get("autopar")
    found = lowering_for(lay.strategies) if lay is not None and lay.strategies else None
    return found[0].kept(plan, node, found[1]) if found is not None else None


def _kept(node: fx.Node, probes: dict) -> list[tuple]:
    """What ``node``'s backward keeps: ("in", i) its i-th tensor input, ("out", j) its j-th
    output, ("own", 0, f, ref) a tensor of f times the bytes of its largest tensor ``ref``."""
    if identity_dropout(node):
        return []
    if node.target in DROPOUT_OPS:
        return [("own", 0, 1.0, ("out", 0))]  # autopar's x * mask keeps the mask, in x's dtype
    if node.target in ATTENTION_OPS:  # q, k, v, out; logsumexp is (B, H, L) fp32: about out / D
        d = _hint(node.meta["val"].shape[-1])
        kept = [("in", 0, 0.0), ("in", 1, 0.0), ("in", 2, 0.0), ("out", 0, 0.0), ("own", 0, 1.0 / d, ("out", 0))]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        mval = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        if isinstance(mval, torch.Tensor) and mval.dtype == torch.bool:
            # a boolean mask is converted to an additive one in q's dtype, which the kernel keeps
            # (the CPU flash kernel; CUDA's efficient kernel likewise): measured, the serial HF
            # LLaMA at 2048 tokens kept 16 MB per layer more than q, k, v, out (bench_context_parallel cp=1)
            i = _tensor_args(node).index(mask)
            kept.append(("own", 0, float(node.meta["val"].dtype.itemsize), ("in", i)))
        return kept
    key = _signature(node)
    if key not in probes:
        probes[key] = _probe(node)
    return probes[key]


def _signature(node: fx.Node):
    def sig(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("T", tuple(_hint(s) for s in v.shape), v.dtype, v.requires_grad)
            return ("N", _hint(v) if isinstance(v, torch.SymInt) else repr(v))
        return repr(a)

    args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), lambda a: a)
    flat = torch.utils._pytree.tree_leaves((args, kwargs), is_leaf=lambda a: isinstance(a, fx.Node))
    return (node.target, tuple(sig(a) for a in flat))


def _hint(s) -> int:
    return int(s.node.hint) if isinstance(s, torch.SymInt) else int(s)


def _probe(node: fx.Node) -> list[tuple]:
    """Run ``node``'s op on meta tensors of its traced sizes and see what autograd keeps."""
    inputs = _tensor_args(node)
    made = {}
    for a in inputs:
        v = a.meta["val"]
        t = torch.empty([_hint(s) for s in v.shape], dtype=v.dtype, device="meta")
        made[a] = t.requires_grad_(v.dtype.is_floating_point)

    def conv(a):
        if isinstance(a, fx.Node):
            if a in made:
                return made[a]
            v = a.meta.get("val")
            return _hint(v) if isinstance(v, torch.SymInt) else v
        return a

    args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), conv)
    kept = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t.detach(), lambda t: t):
            out = node.target(*args, **kwargs)
    except Exception:  # an op that does not run on meta: count its output, as before this model
        return [("out", 0, 0.0)]
    outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    tins = [made[a] for a in inputs]
    sized = [(t.numel() * t.element_size(), ("in", k)) for k, t in enumerate(tins)]
    sized += [(t.numel() * t.element_size(), ("out", k)) for k, t in enumerate(outs)]
    ref_bytes, ref = max(sized) if sized else (0, ("out", 0))
    result = []
    for t in kept:
        i = next((k for k, x in enumerate(tins) if t is x or _same(t, x)), None)
        j = next((k for k, o in enumerate(outs) if t is o or _same(t, o)), None)
        if i is not None:
            result.append(("in", i, 0.0))
        elif j is not None:
            result.append(("out", j, 0.0))
        elif t.numel() and ref_bytes:
            result.append(("own", 0, t.numel() * t.element_size() / ref_bytes, ref))
    return list(dict.fromkeys(result))


def _same(t: torch.Tensor, x: torch.Tensor) -> bool:
    """A saved tensor that is a view of (or the base of) ``x``: it holds x's storage."""
    return (t._base is not None and t._base is x) or (x._base is not None and x._base is t)
