"""The search's cost model: one plan's step time and memory per rank, split by component.

This is plan.cost()'s model evaluated with numbers instead of sympy (the search evaluates
many probe plans; sympy would take seconds on an 8B model), plus the two things a step time
needs that a byte count does not: links and overlap.

- compute: per op, forward and backward seconds on a rank (cost/op_time.py: the longer of its
  FLOPs at the profile's rate and its kernels' bytes at its memory bandwidth); a checkpointed
  region's ops run their forward once more. The optimizer step: its bytes at the bandwidth.
- activation collectives (forward and backward, from cost.collectives, the list the runtime
  runs): ``alpha * ring rounds + bytes / beta`` of the axis' link; not overlapped.
- gradient sync: per parameter, its local bytes on each axis it is summed over; on the dp
  axis the ZeRO level's storage policy says what runs (``Storage.step_comms``: all-reduce,
  reduce-scatter, zero=3's gathers), as one bucket. The sync hides behind ``overlap`` x the
  backward compute, the rest exposed (the runtime launches each bucket in backward as its last
  gradient is ready); zero=3's gathers are prefetched (started a block ahead), so with them the
  whole step's compute hides the communication. The techniques' own collectives in
  ``plan.collectives()`` (zero=3's per-bucket gathers) are not counted again from that list.
  Approximation: buckets' latency counted as ``bytes / bucket_bytes`` rounds (fractional), and
  the last bucket's tail (it cannot overlap anything) is not charged.
- ZeRO over folded axes (``DataParallel(shard_axes=("dp", "cp"))``, or ``("cp",)`` alone):
  one group over them (``Terms.zero_groups``), its collectives over the product of their sizes
  on the slowest link it spans (its outermost axis', as two-axis data parallel's merged axis),
  the state a rank keeps divided by that product; cp's own all-reduce of those gradients
  (``fold_sync``) is dropped, the group's reduction summing the cp parts as it sums dp's.
- ZeRO-1/2's parameter all-gather after the optimizer step: exposed.
- memory: parameters, gradients, optimizer state (``optimizer_states`` copies in the parameters' dtype; ZeRO
  divides them by dp), zero=3's gathered units in flight and a unit's reduce buffers
  (``Storage.held_bytes`` of the largest unit: a repeated block, or the parameters outside
  blocks), a precision policy's compute copies of the parameters (``copies``: plan_cost.copy_bytes,
  where the storage does not gather them), activations (the tensors autograd keeps, by the node
  that made them), what one batch's step adds at its moments (``PEAKS``: a block's recompute, a
  lowering's workspace, the loss's backward) - as cost/plan_cost.py memory_formulas counts them,
  by part (``memory_parts``), and at each moment of the step (``memory_rows``: plan_cost.PHASE_ROWS;
  the largest is the rank's memory, as memory_per_rank(rank).peak: tests/simulated/
  test_auto_planning.py holds the two against each other). As a pipeline rank (``scaled``): 1/m of
  ``PEAKS``, and the gradients the storage keeps whole while they accumulate over the m
  micro-batches (``Storage.accumulated_bytes``), beside the micro-batches' activations.

Example:
    >>> t = plan_terms(plan, {}, PROFILES["cpu-gloo"])["base"]
    >>> t.time(plan.mesh, PROFILES["cpu-gloo"], dp_axis=0, dp=ap.DataParallel("dp", zero=1))
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields


from autopar.cost.activation_memory import bytes_by_node, loss_backward_source, saved_activations
from autopar.cost.collectives import collectives
from autopar.cost.formulas import Numbers
from autopar.cost.execution import op_seconds
from autopar.cost.op_time import optimizer_step_bytes
from autopar.cost.plan_cost import activation_terms, copy_bytes, memory_rows
from autopar.parallel.registry import TECHNIQUES
from autopar.runtime.ring import DEFAULT_BUCKET_MB, ring_bytes, ring_steps
from autopar.trace.model_members import named_parameters

BUCKET_BYTES = DEFAULT_BUCKET_MB * 2**20  # a bucket's bytes (the gradient sync's latency rounds)
FP8_BYTES = 1  # an fp8 element on zero=3's wire
PEAKS = ("recompute", "workspace", "loss_backward")  # Terms' transient parts: one micro-batch's on a pipeline stage


@dataclass
class Terms:
    """Additive pieces of one part of a plan (numbers per rank and step)."""

    compute: float = 0.0  # s, forward + backward
    backward: float = 0.0  # s of backward compute (what the gradient sync can hide behind)
    comm: float = 0.0  # s of activation collectives
    sync_other: float = 0.0  # s of gradient sync on axes other than dp
    dp_grad: float = 0.0  # local gradient bytes summed over the dp axis
    params: float = 0.0
    params_other: float = 0.0  # parameters trained but not synced over dp (experts split on it): zero=3 leaves them
    grads_other: float = 0.0  # gradient bytes not synced on dp (ZeRO does not shard them)
    opt_other: float = 0.0
    opt_dp: float = 0.0  # optimizer state bytes of the dp-synced parameters (ZeRO shards them)
    acts: float = 0.0  # the tensors autograd keeps through the step (and per-block extras)
    # what one batch's step adds at its moments (plan_cost.PHASE_ROWS): a checkpointed block's
    # recompute (backward), a lowering's workspace (forward and backward), the loss's backward and
    # the gathered outputs it drops (backward, before any gradient)
    recompute: float = 0.0
    workspace: float = 0.0
    loss_backward: float = 0.0
    dp_grad_elems: float = 0.0  # elements of the dp-synced gradients (their bytes in another dtype)
    dp_fp8: float = 0.0  # bytes of the dp-synced weights zero=3 gathers in fp8 (1 byte each on the wire)
    pieces: float = 1.0  # backward passes per step (a pipeline's micro-batches; a max): > 1 accumulates
    largest_unit: float = 0.0  # parameter bytes of the largest unit zero=3 gathers at once (a max, not a sum)
    boundary: float = 0.0  # bytes of the largest activation (a pipeline stage boundary's, at most; a max)
    units: float = 0.0  # zero=3's gather units (blocks, and the parameters outside blocks)
    # where a technique splits tokens on another axis (context parallel's cp): the state ZeRO may
    # fold that axis into its shard group for (DataParallel(shard_axes=...)): the parameters kept
    # replicated on dp, the trained ones' gradients (every dp-synced one; without a dp axis every
    # trained one) and their optimizer state; fold_sync: the s of sync_other that is those
    # gradients' all-reduce on the cp axis, which a folded group's reduction replaces
    fold_params: float = 0.0
    fold_grad: float = 0.0
    fold_grad_elems: float = 0.0
    fold_opt: float = 0.0
    fold_sync: float = 0.0
    copies: float = 0.0  # a precision policy's param_dtype copies of the parameters (zero=3's gathers make none)
    comm_bytes: dict = field(default_factory=dict)  # axis name -> bytes (for explain)

    def add(self, other: "Terms", w: float = 1.0) -> "Terms":
        for f in fields(self):
            if f.name == "comm_bytes":
                for k, v in other.comm_bytes.items():
                    self.comm_bytes[k] = self.comm_bytes.get(k, 0.0) + w * v
            elif f.name in ("largest_unit", "boundary", "pieces"):
                setattr(self, f.name, max(getattr(self, f.name), getattr(other, f.name)))
            else:
                setattr(self, f.name, getattr(self, f.name) + w * getattr(other, f.name))
        return self

    def scaled(self, shares, mesh, profile, sends: bool = True) -> "Terms":
        """These terms as one rank of a technique with ``step_shares`` has them (a pipeline stage:
        its share of the compute, state and activations, plus, with ``sends``, its point-to-point
        sends of the boundary activation, exposed); None leaves them as they are."""
        if shares is None:
            return self
        out = Terms(**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "comm_bytes"})
        for name in ("compute", "backward", "comm"):
            setattr(out, name, getattr(self, name) * shares["time"])
        state = (
            "sync_other",
            "dp_grad",
            "dp_grad_elems",
            "dp_fp8",
            "params",
            "params_other",
            "grads_other",
            "opt_other",
            "opt_dp",
            "fold_params",
            "fold_grad",
            "fold_grad_elems",
            "fold_opt",
            "fold_sync",
            "copies",
        )
        for name in (*state, "units"):
            setattr(out, name, getattr(self, name) * shares["state"])
        out.acts = self.acts * shares["acts"]
        out.pieces = shares.get("pieces", 1)
        for name in PEAKS:  # one micro-batch's recompute / workspace / loss backward, on its stage
            setattr(out, name, getattr(self, name) / out.pieces)
        out.comm_bytes = {k: v * shares["state"] for k, v in self.comm_bytes.items()}
        axis, messages, share = shares["sends"]
        if not sends:
            return out
        alpha, beta = profile.link(mesh, mesh.axis_index(axis))
        out.comm += messages * (alpha + share * self.boundary / beta)
        out.comm_bytes[axis] = out.comm_bytes.get(axis, 0.0) + messages * share * self.boundary
        return out

    def zero_groups(self, mesh, dp_axis, dp) -> list[tuple]:
        """The state ``dp``'s storage shards, by the group that shards it: [(n, fold, link axis,
        label, params, grads, grad elements, optimizer state)], ``n`` the dp axis' size (1 without
        one) and ``fold`` that of the axes ``shard_axes`` folds in (cp): one group over them all,
        priced on the link of its outermost axis (the slowest it spans: Profile.link), and the dp
        axis alone for what the folded group does not hold. [] without data parallel.

        Example: on (2, 2) dp x cp with DataParallel("dp", zero=3, shard_axes=("dp", "cp")),
        [(2, 2, 0, "dp*cp", ...), (2, 1, 0, "dp", 0.0, 0.0, 0.0, 0.0)]"""
        if dp is None:
            return []
        n = mesh.shape[dp_axis] if dp_axis is not None else 1
        out = []
        folds = dp.fold_axes(mesh)
        if folds:
            group = dp.shard_group_axes(mesh)
            fold = math.prod(mesh.shape[a] for a in folds)
            label = mesh.axis_label(group if len(group) > 1 else group[0])
            out.append(
                (n, fold, min(group), label, self.fold_params, self.fold_grad, self.fold_grad_elems, self.fold_opt)
            )
        if dp_axis is not None:
            f = 1.0 if folds else 0.0  # what the folded group holds is not the dp axis' alone
            out.append(
                (
                    n,
                    1,
                    dp_axis,
                    mesh.axis_names[dp_axis],
                    self.params - f * self.fold_params,
                    self.dp_grad - f * self.fold_grad,
                    self.dp_grad_elems - f * self.fold_grad_elems,
                    self.opt_dp - f * self.fold_opt,
                )
            )
        return out

    def _group_comms(self, mesh, profile, dp_axis, dp):
        """(label, seconds, bytes, prefetched, phase) of each collective of ``dp``'s groups' sync."""
        units = max(self.units, 1.0)
        for n, fold, link, label, _, grad, _, _ in self.zero_groups(mesh, dp_axis, dp):
            if not grad:
                continue
            alpha, beta = profile.link(mesh, link)
            buckets = grad / BUCKET_BYTES
            fp8 = self._fp8_share(grad, dp)
            for kind, phase, nbytes, prefetched, launches in dp.storage.step_comms(
                dp, n, grad, grad - fp8 + self._fp8_as_param(fp8, dp), units, fold
            ):
                t = alpha * ring_steps(kind, n * fold) * (buckets if launches is None else launches) + nbytes / beta
                yield label, t, nbytes, prefetched, phase

    def _fp8_share(self, grad, dp) -> float:
        """Of a group's ``grad`` bytes, those of the weights zero=3 gathers in fp8 (``dp_fp8``:
        torchao's FSDP fp8 all-gather, ap.Float8(fp8_all_gather=True)), in the masters' fp32 bytes."""
        return self.dp_fp8 * grad / self.dp_grad if dp.storage.gathers_params and self.dp_grad else 0.0

    @staticmethod
    def _fp8_as_param(fp8, dp) -> float:
        """The fp32 bytes that step_comms, casting them to ``param_dtype`` for the wire (fsdp._as),
        turns into the fp8 bytes of ``fp8`` (fp32 bytes: 1 byte on the wire per 4)."""
        return fp8 * FP8_BYTES / (dp.param_dtype.itemsize if dp.param_dtype is not None else 4)

    def fp8_gather_bytes(self, mesh, dp_axis, dp) -> float:
        """Bytes per rank and step of zero=3's all-gathers in fp8 (forward, and backward again when
        resharded): the part of ``sync_bytes`` that ap.Float8(fp8_all_gather=True) moves in fp8."""
        out = 0.0
        for n, fold, _, _, _, grad, _, _ in self.zero_groups(mesh, dp_axis, dp):
            fp8 = self._fp8_share(grad, dp)
            if fp8:
                comms = dp.storage.step_comms(dp, n, fp8, self._fp8_as_param(fp8, dp), 1.0, fold)
                out += sum(nbytes for kind, _, nbytes, _, _ in comms if kind == "all_gather")
        return out

    def dp_sync(self, mesh, profile, dp_axis, dp) -> tuple[float, float, float]:
        """(seconds of gradient sync on dp, of prefetched gathers, of ZeRO-1/2's all-gather after
        the step) under the ap.DataParallel ``dp`` (its storage policy says what runs), over the
        dp axis or the dp x cp group it folds (``zero_groups``)."""
        sync = ahead = after = 0.0
        for _, t, _, prefetched, phase in self._group_comms(mesh, profile, dp_axis, dp):
            if prefetched:
                ahead += t
            elif phase in ("grad sync", "forward", "backward"):
                sync += t
            else:
                after += t
        return sync, ahead, after

    def sync_bytes(self, mesh, profile, dp_axis, dp) -> dict:
        """Bytes per rank and step of ``dp``'s gradient sync (and ZeRO's gathers), by the group
        they run over: ``"dp"``, or ``"dp*cp"`` folded."""
        out: dict = {}
        for label, _, nbytes, _, _ in self._group_comms(mesh, profile, dp_axis, dp):
            out[label] = out.get(label, 0.0) + nbytes
        return out

    def other_sync(self, mesh, dp) -> float:
        """Seconds of gradient sync on the axes other than dp: a folded group's reduction
        replaces the cp axis' all-reduce of the gradients it holds."""
        return self.sync_other - (self.fold_sync if dp is not None and dp.fold_axes(mesh) else 0.0)

    def memory_parts(self, mesh, dp_axis, dp, plan=None) -> dict:
        """Bytes per rank by part, named as memory_per_rank names them: what ``dp``'s storage keeps
        of the dp-synced state (DataParallel.memory_divisors, over dp x cp where it folds cp in),
        what it holds gathered and reducing while stepping (of ``plan``'s own buckets where given),
        the activations and the step's transient parts."""
        out = {
            "activations": self.acts,
            "recompute": self.recompute,
            "workspace": self.workspace,
            "backward": self.loss_backward,
        }
        if dp is None or not dp.storage.gathers_params:  # zero=3's gathered blocks are its copies
            out["compute_copies"] = self.copies
        params = self.params + self.params_other
        grads = self.dp_grad + self.grads_other
        opt = self.opt_dp + self.opt_other
        if dp is not None:
            n = mesh.shape[dp_axis] if dp_axis is not None else 1
            out["gathered"], out["reduce_buffers"] = dp.storage.held_bytes(dp, n, self.largest_unit, plan)
            accumulated = 0.0
            for n, fold, _, _, p, g, e, o in self.zero_groups(mesh, dp_axis, dp):
                d_params, d_grads, d_opt = dp.memory_divisors(n, fold)
                params, grads, opt = params - p + p / d_params, grads - g + g / d_grads, opt - o + o / d_opt
                if self.pieces > 1 and g:  # gradients accumulated over the micro-batches, reduced at the last
                    accumulated += dp.storage.accumulated_bytes(dp, n * fold, g, e, plan)
            out["accumulated"] = accumulated
        return dict(out, params=params, grads=grads, optimizer=opt)

    def memory_rows(self, mesh, dp_axis, dp, plan=None) -> tuple:
        """Bytes per rank at each moment of a step (plan_cost.PHASE_ROWS, in order): the solver
        holds each to the budget; their largest is the rank's memory (``memory``)."""
        parts = self.memory_parts(mesh, dp_axis, dp, plan)
        return tuple(memory_rows(parts, self.pieces > 1, dp is not None and dp.keeps_gathered()).values())

    def memory(self, mesh, dp_axis, dp, plan=None) -> float:
        """Bytes per rank at the step's peak: the largest of ``memory_rows``, as
        memory_per_rank(rank).peak counts it."""
        return max(self.memory_rows(mesh, dp_axis, dp, plan))

    def hidden_behind(self, prefetching: bool) -> float:
        """Compute seconds the overlapped communication can hide behind: backward's, or (with
        prefetched gathers, which start during forward too) the whole step's."""
        return self.compute if prefetching else self.backward

    def time(self, mesh, profile, dp_axis, dp) -> float:
        """Step time: compute + activation collectives + exposed gradient sync (and prefetched
        gathers) + ZeRO-1/2's gather after the step."""
        sync, ahead, after = self.dp_sync(mesh, profile, dp_axis, dp)
        hide = profile.overlap * self.hidden_behind(ahead > 0)
        exposed = max(0.0, sync + ahead + self.other_sync(mesh, dp) - hide)
        return self.compute + self.comm + exposed + after + self.step_seconds(mesh, profile, dp_axis, dp)

    def step_seconds(self, mesh, profile, dp_axis, dp) -> float:
        """The optimizer step: the bytes it moves (op_time.optimizer_step_bytes) of the state a
        rank keeps (ZeRO's share of the dp-synced parameters' state and gradients, over dp x cp
        folded) at the profile's memory bandwidth; 0 without one."""
        if profile.memory_bandwidth is None:
            return 0.0
        grads, opt, moved = self.dp_grad + self.grads_other, self.opt_dp + self.opt_other, 0.0
        for n, fold, _, _, _, g, _, o in self.zero_groups(mesh, dp_axis, dp):
            moved += optimizer_step_bytes(o, g) / dp.memory_divisors(n, fold)[2]
            grads, opt = grads - g, opt - o
        return (moved + optimizer_step_bytes(opt, grads)) / profile.memory_bandwidth


def plan_terms(
    plan,
    comp_of: dict,
    profile,
    states: int = 2,
    node_weight=None,
    param_weight=None,
    param_comp: dict | None = None,
    shared: dict | None = None,
) -> dict[str, Terms]:
    """Terms per component key ("base" for the rest) of ``plan``; ``comp_of`` maps node names to
    component keys, ``param_comp`` parameter names; weights count a node / parameter that stands
    for several (the blocks of a repeated stack).

    ``shared``: a dict kept across plans with the same graph, layouts and data parallel that
    differ only in activation checkpointing (the search's variants of one probe): the activation
    collectives, the parameters' terms and each op's seconds are the same for them (checkpointing
    keeps every collective's output: its recompute sends nothing; it changes which ops run twice),
    so they are computed for the first and reused (a third of a 512-rank search's time went to
    computing them again)."""
    sy = Numbers(plan.mesh)
    shared = {} if shared is None else shared
    nw = node_weight or {}
    out: dict[str, Terms] = {}
    saves = saved_activations(plan)
    for technique in plan.options.techniques:  # checkpointing keeps its blocks' inputs instead
        saves = technique.kept_saves(plan, saves)
    kept = bytes_by_node(plan, sy, saves)  # what autograd keeps, by the node that made it
    recomputed = set().union(*(t.recomputed(plan) for t in plan.options.techniques))

    def terms(key):
        return out.setdefault(key, Terms())

    if "seconds" not in shared:
        shared["seconds"] = _op_seconds(plan, sy, profile)
    for name, fwd, bwd, grad in shared["seconds"]:
        t, w = terms(comp_of.get(name, "base")), nw.get(name, 1.0)
        again = fwd if grad and name in recomputed else 0.0  # a checkpointed region's forward, run again
        t.compute += w * (fwd + bwd + again)
        t.backward += w * (bwd + again)
    for name, b in kept.items():
        terms(comp_of.get(name, "base")).acts += nw.get(name, 1.0) * b
    # what the techniques add beyond the kept tensors: per block (checkpointing's generator-state
    # copies: a short probe's two blocks stand for 1 + (n - 1)), and once (a recompute's peak)
    extra = activation_terms(plan, sy, whole_model=True)
    blocks = (1 + max(nw.values())) / 2 if nw else 1.0
    per_block = float(extra.pop("activations")) - float(sum(kept.values()))
    extra.pop("offloaded", None)  # host memory (offloading checkpoints): not the device's budget
    backward = float(extra.pop("backward", 0.0))
    terms("base").acts += blocks * per_block
    base = terms("base")
    base.recompute += float(extra.pop("recompute", 0.0))  # a block's recompute
    base.workspace += float(extra.pop("workspace", 0.0))  # a lowering's workspace
    base.loss_backward += float(sum(extra.values()))  # outputs gathered at the forward's end, then dropped
    if backward:  # the loss's backward holds two of its largest kept tensor: that node's component's
        terms(comp_of.get(loss_backward_source(plan, sy)[1], "base")).loss_backward += backward
    terms("base").boundary = max(kept.values(), default=0.0)  # what a pipeline stage sends, at most
    if "comms" not in shared:
        shared["comms"] = _comm_terms(plan, sy, comp_of, nw, profile)
    for key, seconds, axis, nbytes in shared["comms"]:
        t = terms(key)
        t.comm += seconds
        t.comm_bytes[axis] = t.comm_bytes.get(axis, 0.0) + nbytes
    if "params" not in shared:
        params: dict[str, Terms] = {}
        _param_terms(
            plan, sy, lambda k: params.setdefault(k, Terms()), profile, states, param_weight or {}, param_comp or {}
        )
        shared["params"] = params
    for key, t in shared["params"].items():
        terms(key).add(t)
    return out


def _op_seconds(plan, sy, profile) -> list[tuple]:
    """(node name, forward s, backward s, needs a gradient) of each op of ``plan`` (op_time's
    roofline; compiled as the profile says, and what the registered techniques change in each
    op, their op_extras: Float8's rate, casts and scales: cost/execution.py)."""
    return op_seconds(plan, sy, profile, TECHNIQUES.values())


def _comm_terms(plan, sy, comp_of, nw, profile) -> list[tuple]:
    """(component key, seconds, axis name, bytes) of each activation collective of ``plan``."""
    mesh, out = plan.mesh, []
    in_graph = {n.name for n in plan.graph.nodes}
    for c in collectives(plan, sy, grad_sync=False):
        if c.phase not in ("forward", "backward") or c.node not in in_graph:
            continue  # the gradient sync (zero=3's gathers too) is counted per parameter (_param_terms)
        key = comp_of.get(c.node) or comp_of.get(c.src) or "base"
        w = nw.get(c.node, nw.get(c.src, 1.0))
        n, (alpha, beta) = _group_link(profile, mesh, c.axis)
        out.append((key, w * (alpha * ring_steps(c.kind, n) + c.bytes / beta), c.axis, w * c.bytes))
    return out


def _group_link(profile, mesh, name) -> tuple:
    """(ranks, (alpha, beta)) of a collective's group ``name``: a mesh axis, or a part of a merged
    axis (hybrid context parallel's Ulysses ranks, the inner part, on the link its ranks span;
    the outer part on the merged axis' link: it spans all of it)."""
    i, part = mesh.sub_axis(name)
    if part is None:
        return mesh.shape[i], profile.link(mesh, i)
    n = mesh.axis_size(part)
    if part.part == "outer":
        return n, profile.link(mesh, i)
    span = n * math.prod(mesh.shape[i + 1 :])
    return n, profile.intra if span <= profile.ranks_per_node else profile.inter


def fold_candidates(plan) -> tuple:
    """The mesh axes ZeRO could fold into its shard group: those on which a technique other than
    data parallel splits the tokens (context parallel's), where the parameters are replicated."""
    dp = plan.state_storage
    return tuple(
        plan.mesh.axis_index(a) for t in plan.options.techniques if t is not dp for a in t.token_axes() if a is not None
    )


BLOCK = re.compile(r"^(.*?\.\d+)\.")  # "model.layers.5.mlp.up.weight" -> "model.layers.5"


def _fp8_gathered(plan, profile) -> set:
    """Names of the parameters zero=3 gathers in fp8: the plan's own (a technique's gather wire:
    ap.Float8(fp8_all_gather=True)), else, where the search prices float8 on a plan not converted
    yet (``profile.float8``), those a technique priced so would gather (Technique.priced_wire_params:
    the weights of the Linears float8 training converts; its plan gathers them so: search/auto.py)."""
    dp = plan.state_storage
    if dp is not None:
        return dp.wire_params(plan, profile)
    return set().union(*(cls.priced_wire_params(plan, profile) for cls in TECHNIQUES.values()))


def _param_terms(plan, sy, terms, profile, states, pw, param_comp) -> None:
    mesh = plan.mesh
    sync = plan.grad_sync_axes
    folds = fold_candidates(plan)
    fp8 = _fp8_gathered(plan, profile)
    units: dict[str, float] = {}  # zero=3's gather units: each repeated block, and the rest as one
    unit_weight: dict[str, float] = {}  # how many blocks a unit stands for (a short probe's block 1: n - 1)
    for name, p in named_parameters(plan.model):
        t, w = terms(param_comp.get(name, "base")), pw.get(name, 1.0)
        numel = sy.numel(p.shape, plan.param_specs.get(name))
        local = numel * p.element_size()
        copied = None if name in plan.traced.kept_fp32 else plan.traced.dtype  # HF keeps some in fp32
        t.copies += w * copy_bytes(p, numel, copied)  # Terms.memory: unless dp gathers them
        axes = sync.get(name, ())
        if p.requires_grad and plan.batch_axis is not None and plan.batch_axis not in axes:
            t.params_other += w * local  # split on dp already (expert parallel): zero=3 gathers none of it
        else:
            t.params += w * local
            t.fold_params += w * local if folds else 0.0
            block = BLOCK.match(name)
            unit = block.group(1) if block else ""
            units[unit] = units.get(unit, 0.0) + local
            unit_weight[unit] = max(unit_weight.get(unit, 0.0), w)
        if not p.requires_grad:
            continue
        if plan.batch_axis in axes:
            t.dp_grad += w * local
            t.dp_grad_elems += w * local / p.element_size()
            t.dp_fp8 += w * local if name in fp8 else 0.0
            t.opt_dp += w * states * local  # the state in the parameter's dtype
        else:
            t.grads_other += w * local
            t.opt_other += w * states * local
        # held by a group that folds cp in: zero=3 buckets every parameter replicated on dp (its
        # gradient whole on cp too, entering the reduce-scatter divided by |cp|); ZeRO-1/2 fold
        # only the buckets summed over both (DataParallel.group_axes): a gradient whole on cp
        # (rare: a head on a pooled sequence) is counted folded here
        folded = bool(folds) and (plan.batch_axis is None or plan.batch_axis in axes)
        if folded:
            t.fold_grad += w * local
            t.fold_grad_elems += w * local / p.element_size()
            t.fold_opt += w * states * local
        for a in axes:
            if a == plan.batch_axis:
                continue
            n = mesh.shape[a]
            alpha, beta = profile.link(mesh, a)
            seconds = w * (
                alpha * ring_steps("all_reduce", n) * local / BUCKET_BYTES + ring_bytes("all_reduce", local, n) / beta
            )
            t.sync_other += seconds
            if folded and a in folds:
                t.fold_sync += seconds
    terms("base").largest_unit = max(units.values(), default=0.0)
    terms("base").units = sum(unit_weight.values())
