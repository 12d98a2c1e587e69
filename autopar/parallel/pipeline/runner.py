"""PipelineRunner: one rank's stages, driven through a schedule once per training step.

``runner.step(batch, labels)`` splits this rank's slice of the batch into micro-batches,
runs the schedule's forwards and backwards (receiving activations and gradients from the
neighbouring stages, sending its own), and returns the step's loss (the mean over the
micro-batches, the same on every rank). Gradients are then in ``runner.parameters()``,
summed over micro-batches (each micro-batch's loss weighted by its share of the rows: 1/m
when they are equal, 2/6 and 1/6 for 6 rows in 4; so they equal the serial gradients of the
whole batch), synced over data parallel (and tp where a norm needs it),
and summed over the stages that share a tied weight. Call your optimizer step after it.

Activation checkpointing (``checkpoint=True``) runs each forward without keeping its
autograd graph and recomputes it just before the backward. ``runner.evaluate`` runs the
forwards only, under no_grad. Every action's start and end go to ``runner.timeline``;
``runner.stats`` has the peak number of micro-batches held and the peak activation bytes.

``measure`` (default: on in the simulator, off in a real job): also record each action's CPU
time (``Event.cpu``, a system call per clock read) and the activation bytes autograd saves
(a saved-tensor hook, Python per saved tensor: ``stats["peak_activation_bytes"]``). A real
job's runner pays neither unless asked: a hand-written pipeline pays nothing per micro-batch
but its math and its messages (bench/bench_pipeline_overhead.py).

Example:
    >>> runners = [plan.pipeline_runner(r) for r in plan.mesh.ranks()]
    >>> losses = run_ranks(plan.mesh.size, lambda r: runners[r].step((idx, tg)))
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autopar.placement import Shard, counts_piece
from autopar.runtime.backend import current_backend
from autopar.errors import InputError
from autopar.parallel.dp_module import bucket_limits, sync_axes_all_names
from autopar.parallel.grad_sync import GradSync
from autopar.runtime.rng import replayed_rng, rng_state
from autopar.runtime.simulator import SimBackend
from autopar.codegen.rank_state import set_attr
from autopar.parallel.pipeline import messages, schedules
from autopar.parallel.pipeline.messages import PREFETCH_AHEAD
from autopar.errors import PipelineError
from autopar.parallel.pipeline.p2p import channel
from autopar.parallel.pipeline.split_backward import backward_input, backward_weight
from autopar.parallel.pipeline.stage_module import build_stage_module

MAX_SHAPES = 64  # input shapes whose boundary shapes a runner's channel remembers (then it starts afresh)


@dataclass
class Event:
    """One action as it ran: perf_counter start and end of its compute (waits excluded), and
    the CPU time its thread spent (robust when ranks share cores, as simulated ranks do; the
    calling thread's only: what intra-op OpenMP workers compute for it is not counted)."""

    kind: str
    microbatch: int
    stage: int
    start: float
    end: float
    cpu: float | None = None  # None: not measured (the runner's ``measure`` is off)


@dataclass
class _Saved:
    args: list
    received: list  # (value name, producing stage, tensor) of float inputs
    sends: list = field(default_factory=list)
    loss: torch.Tensor | None = None
    nbytes: int = 0
    rng: tuple | None = None  # CPU and stage dropout RNG states at the forward, replayed when recomputing


class PipelineRunner:
    """One rank's pipeline stages and their schedule.

    ``state`` (name -> full tensor): the pieces cut from it instead of the model's values (a dry
    run's fake tensors, dry_run.py).

    Attributes: ``modules`` (stage index -> GraphModule, only its parameters), ``params``
    (serial name -> this rank's Parameter, tied names included), ``timeline`` (Events of the
    last step), ``stats`` (``max_in_flight``, ``peak_activation_bytes``), ``outputs`` (last
    stage, ``evaluate(keep_outputs=True)``).

    Example:
        >>> runner = plan.pipeline_runner(rank)
        >>> loss = runner.step((idx, targets)); opt.step(); opt.zero_grad()
    """

    def __init__(
        self, plan, rank: int, loss=None, metric=None, p2p_group=None, measure: bool | None = None, state=None
    ):
        self.plan, self.rank = plan, plan.mesh.check_rank(rank)
        self.layout = lay = plan.stage_layout
        if lay is None:
            raise PipelineError("This plan has no pipeline: pass pipeline=ap.Pipeline(...) to ap.plan.")
        self.options = lay.options
        self.loss_fn = loss or lay.options.loss
        self.metric_fn = metric or lay.options.metric
        self.coords = plan.mesh.coords(rank)
        self.pp_rank = self.coords[lay.axis]
        self.stage_ids = [s for s in range(lay.n_stages) if lay.rank_of_stage(s) == self.pp_rank]
        self.params: dict = {}
        self.modules = {s: build_stage_module(plan, rank, s, self.params, state) for s in self.stage_ids}
        self.holder = self._holder()
        self.grad_sync = self._grad_sync()
        self.tied_groups = self._tied_groups()
        self.p2p_group = p2p_group
        self.dtypes = {n.name: _dtype(n) for n in plan.graph.nodes if n.name in lay.value_ids}
        self.timeline: list[Event] = []
        self.stats: dict = {}
        self._scaler = None  # step's GradScaler, while it runs
        self.measure = measure  # None: on under the simulator (see the module docstring)
        self._schedules: dict = {}  # train -> this rank's actions and the sends each lets go of
        self._receive_lists: dict = {}  # (kind, stage, micro-batch, shapes id) -> its receives (_receives)
        self._send_lists: dict = {}  # the same keys -> its sends (_sends)
        self._ch = self._ch_backend = None  # the p2p channel, kept across steps (it knows the shapes)
        self._shape_ids: dict = {}  # a micro-batch's input shapes -> a small int (in its streams)
        self._loss_group = loss_group(plan, self.rank)  # pp x dp: the step's loss in one all-reduce
        self._holds_last = lay.n_stages - 1 in self.stage_ids
        self._n_results = 1 if self.metric_fn is None else 2

    # ------------------------------------------------------------------ parameters
    def _holder(self) -> nn.Module:
        """A module holding this rank's parameters under their serial names (tied: the first)."""
        holder, seen = nn.Module(), set()
        for fqn, value in self.params.items():
            if isinstance(value, nn.Parameter) and id(value) not in seen:
                seen.add(id(value))
                set_attr(holder, fqn, value)
        return holder

    def named_parameters(self):
        return self.holder.named_parameters()

    # ---------------------------------------------- the rank protocol (codegen/rank_module.py)
    @property
    def autopar_plan(self):
        return self.plan

    @property
    def autopar_rank(self) -> int:
        return self.rank

    @property
    def autopar_grad_sync(self):
        return self.grad_sync

    def autopar_tensors(self, all_buffers: bool = False) -> dict:
        """Serial name -> this rank's tensor: its stages' parameters (tied names too) and
        persistent buffers (``all_buffers``: every tensor its stages read)."""
        persistent = self.plan.persistent_buffers
        return {
            n: v
            for n, v in self.params.items()
            if isinstance(v, nn.Parameter) or (isinstance(v, torch.Tensor) and (all_buffers or n in persistent))
        }

    def autopar_grad_pieces(self) -> list:
        """(name, gradient, counted by this rank): each stage's gradients live on its ranks only
        (the pp axis adds the stages); a weight tied across stages counts on its first holder."""
        first_holder = {id(p): group[0] == self.rank for p, group in self.tied_groups}
        default = (None,) * len(self.coords)
        out = []
        for name, p in self.named_parameters():
            if p.grad is not None:
                spec = self.plan.param_specs.get(name, default)
                counted = first_holder.get(id(p), True) and counts_piece(spec, self.coords, (self.layout.axis,))
                out.append((name, p.grad, counted))
        return out

    def parameters(self):
        return self.holder.parameters()

    def _grad_sync(self):
        axes = sync_axes_all_names(self.plan)  # tied names included; techniques drop what they reduce
        if not any(axes.get(n) for n, _ in self.holder.named_parameters()):
            return None
        return GradSync(self.holder, axes, self.plan.mesh, self.rank, *bucket_limits(self.plan)[:2])

    def _tied_groups(self) -> list[tuple[nn.Parameter, tuple[int, ...]]]:
        """Weights this rank shares with other pipeline ranks, with the ranks to sum over."""
        out = []
        for names in self.plan.traced.tied.values():
            if not any(n in self.params for n in names):
                continue
            holders = sorted(
                {
                    self.layout.rank_of_stage(st.index)
                    for st in self.layout.stages
                    for ph in st.attrs
                    if self.plan.attr_name(ph) in names
                }
            )
            if len(holders) > 1:
                out.append(
                    (self.params[next(n for n in names if n in self.params)], tuple(self.rank_at(c) for c in holders))
                )
        return out

    def rank_at(self, pp_coord: int) -> int:
        c = list(self.coords)
        c[self.layout.axis] = pp_coord
        return self.plan.mesh.rank_of(c)

    # ------------------------------------------------------------------------ inputs
    def _micro_inputs(self, batch) -> list[dict]:
        batch = batch if isinstance(batch, tuple) else (batch,)
        args, kwargs = self.plan.local_inputs(self.rank, *batch)
        flat = pytree.tree_leaves((args, kwargs))
        m = self.options.microbatches
        per = [dict() for _ in range(m)]
        rows = None
        for name, v in zip(self.plan.traced.user_inputs, flat):
            pieces = _chunk(v, m, name) if isinstance(v, torch.Tensor) else [v] * m
            if isinstance(v, torch.Tensor) and rows is None:
                rows = [p.shape[0] for p in pieces]
            if isinstance(v, torch.Tensor):
                _check_static_rows(self.plan, name, pieces, m)
            for i in range(m):
                per[i][name] = pieces[i]
        self._weights = _weights(rows, m, self.plan.ragged, self.plan.dp_axis)
        self._mb_shapes = [self._shape_id(p) for p in per]
        return per

    def _shape_id(self, inputs: dict):
        """A small int naming the shapes (and non-tensor values) of one micro-batch's inputs: the
        boundary values' shapes follow from them, so the channel's streams are keyed by it and
        a stream's shape, once received, is known in every later step with these shapes. Every
        pipeline rank sees the same inputs, so every rank numbers them alike. None where an
        input is not hashable (its streams then live for one step: ``_run`` starts a channel)."""
        key = []
        for v in inputs.values():
            key.append((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v)
        key = tuple(key)
        try:
            found = self._shape_ids.get(key)
        except TypeError:  # an unhashable input
            return None
        if found is None:
            found = self._shape_ids[key] = len(self._shape_ids)
        return found

    def _micro_labels(self, labels) -> list:
        m = self.options.microbatches
        if labels is None:
            return [None] * m
        dp = self.plan.dp_axis

        def split(t):
            if not isinstance(t, torch.Tensor):
                return [t] * m
            if dp is not None:  # cut as plan.local_inputs cuts the batch (torch.tensor_split)
                t = _chunk(t, self.plan.mesh.shape[dp], "labels", per="data-parallel rank")[self.coords[dp]]
            return _chunk(t, m, "labels")

        pieces = pytree.tree_map(split, labels)
        return [pytree.tree_map(lambda p: p[i], pieces, is_leaf=lambda x: isinstance(x, list)) for i in range(m)]

    # --------------------------------------------------------------------- stepping
    # ------------------------------------------------------------------ train / eval
    @property
    def training(self) -> bool:
        return all(m.training for m in self.modules.values())

    def train(self, mode: bool = True) -> "PipelineRunner":
        """Switch every stage module of this rank (dropout, batch norm) as ``nn.Module.train``."""
        for m in self.modules.values():
            m.train(mode)
        return self

    def eval(self) -> "PipelineRunner":
        return self.train(False)

    @property
    def stage_modules(self) -> list:
        return list(self.modules.values())

    def step(self, batch, labels=None, sync_loss: bool = True, scaler=None):
        """One training step over the whole batch; returns the loss (and the metric, if any).

        ``scaler``: an ap.GradScaler: each micro-batch's backward starts from its loss times the
        scale (``scaler.scale(loss).backward()`` of a rank module); the loss returned is unscaled.

        ``sync_loss=False`` skips the step's one collective for the loss (a hand-written
        pipeline's loss lives on its last stage): the loss returned is then this rank's own,
        the mean over its data-parallel slice, where it holds the last stage, and None on the
        other ranks. For a loop that reads the loss every k steps only; every rank of the job
        must pass the same value (the loss's collective is theirs together)."""
        self._scaler = scaler
        try:
            return self._run(batch, labels, train=True, sync_loss=sync_loss)
        finally:
            self._scaler = None

    def evaluate(self, batch, labels=None, keep_outputs: bool = False, sync_loss: bool = True):
        """Forward only (no activations kept); returns the loss (and metric) like ``step``.
        With ``keep_outputs`` the last stage's per-micro-batch outputs go to ``runner.outputs``."""
        with torch.no_grad():
            return self._run(batch, labels, train=False, keep_outputs=keep_outputs, sync_loss=sync_loss)

    def _channel(self, backend):
        """The p2p channel, kept across steps so that the streams' shapes are known (no header,
        receives posted ahead); a fresh one under another backend, when an input cannot name its
        shapes, or after MAX_SHAPES input shapes (every rank decides alike: same inputs)."""
        if (
            self._ch is None
            or self._ch_backend is not backend
            or None in self._mb_shapes
            or len(self._shape_ids) > MAX_SHAPES
        ):
            if len(self._shape_ids) > MAX_SHAPES:
                self._shape_ids.clear()
                self._receive_lists.clear()
                self._send_lists.clear()
                self._mb_shapes = [self._shape_id(p) for p in self._inputs]
            self._ch, self._ch_backend = channel(backend, self.rank, self.p2p_group), backend
        return self._ch

    def _run(self, batch, labels, train: bool, keep_outputs: bool = False, sync_loss: bool = True):
        o, lay = self.options, self.layout
        self._inputs, self._labels = self._micro_inputs(batch), self._micro_labels(labels)
        if train not in self._schedules:  # the same every step
            built = schedules.build(o.kind, lay.pp, o.microbatches, o.chunks, forward_only=not train)
            self._schedules[train] = built[self.pp_rank], self._release_keys(built)
        acts, releases = self._schedules[train]
        backend = current_backend()
        self._channel(backend)
        self._measuring = isinstance(backend, SimBackend) if self.measure is None else self.measure
        # the parameters' storages, which the saved-bytes count leaves out: once a step
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in self.parameters()} if self._measuring else None
        self._saved: dict = {}
        self._losses, self._metrics, self.outputs = [], [], []
        self._keep, self._training = keep_outputs, train
        self.timeline = []
        self.stats = {"max_in_flight": 0, "peak_activation_bytes": 0 if self._measuring else None}
        self._held_bytes = 0
        self._backwards: dict[int, int] = {}
        self._split = o.kind in schedules.SPLIT_BACKWARD  # B sends input gradients, W (later) the weights'
        self._pending: dict = {}  # (micro-batch, stage) -> (split_backward.WeightGrad, bytes held) until its W
        self._loss_work = None
        if sync_loss and not self._holds_last and self._folded(backend):  # its part is zeros: at once
            zeros = torch.zeros(self._n_results, device=self._device())
            self._loss_work = backend.all_reduce_async(zeros, self._loss_group, self.rank)
        self._last_forwards = 0
        self._sync_loss = sync_loss
        try:
            for i, a in enumerate(acts):
                self._prefetch(acts[i : i + 1 + PREFETCH_AHEAD])
                if a.kind == "F":
                    self._forward(a, train)
                elif a.kind == "B":
                    self._backward(a)
                else:
                    self._weight_grads(a)
                for dst, tag in releases.get(i, ()):  # sends this action proved arrived: let go of them
                    self._ch.release(dst, tag)
            self._ch.flush()
        except BaseException:
            self._ch = None  # receives may be posted: the next step starts a channel
            raise
        if train:
            self._sync_grads()
        return self._reduce_results(backend) if sync_loss else self._local_results()

    def _release_keys(self, built) -> dict:
        """Action index -> (dst rank, tag) of the sends known arrived once it has run (messages.py)."""
        lay = self.layout
        return {
            i: [(self.rank_at(lay.rank_of_stage(m.dst)), self._tag(m.microbatch, m.value, m.consumer, m.direction))
                for m in found]
            for i, found in messages.releases(lay, built, self.pp_rank).items()
        }  # fmt: skip

    def _receives(self, a) -> list[tuple]:
        """The messages action ``a`` receives: (src rank, tag, dtype, stream) each (worked out
        once per action: the layout and the mesh do not change between steps)."""
        key = (a.kind, a.stage, a.microbatch, self._mb_shapes[a.microbatch])  # streams differ with the shapes
        found = self._receive_lists.get(key)
        if found is None:
            found = self._receive_lists[key] = self._work_out_receives(a)
        return found

    def _sends(self, a) -> list[tuple]:
        """The messages action ``a`` sends, in the order of its values (forward: ``st.send``, one
        list of (dst rank, tag, stream) per value; backward: ``st.recv``'s floating values, one
        (dst rank, tag, stream) each), worked out once like ``_receives``."""
        key = (a.kind, a.stage, a.microbatch, self._mb_shapes[a.microbatch])
        found = self._send_lists.get(key)
        if found is None:
            found = self._send_lists[key] = self._work_out_sends(a)
        return found

    def _work_out_sends(self, a) -> list:
        if a.kind == "W":  # a zero-bubble schedule's weight gradients: no messages
            return []
        st, lay, mb = self.layout.stages[a.stage], self.layout, a.microbatch
        if a.kind == "F":
            return [
                [
                    (self.rank_at(lay.rank_of_stage(d)), self._tag(mb, name, d, 0), self._stream(mb, name, d, 0))
                    for d in dsts
                ]
                for name, dsts in st.send
            ]
        return [
            (self.rank_at(lay.rank_of_stage(src)), self._tag(mb, name, a.stage, 1), self._stream(mb, name, a.stage, 1))
            for name, src in st.recv
        ]

    def _work_out_receives(self, a) -> list[tuple]:
        if a.kind == "W":  # a zero-bubble schedule's weight gradients: no messages
            return []
        st, lay, mb = self.layout.stages[a.stage], self.layout, a.microbatch
        if a.kind == "F":
            return [
                (
                    self.rank_at(lay.rank_of_stage(src)),
                    self._tag(mb, name, a.stage, 0),
                    self.dtypes[name],
                    self._stream(mb, name, a.stage, 0),
                )
                for name, src in st.recv
            ]
        return [
            (
                self.rank_at(lay.rank_of_stage(d)),
                self._tag(mb, name, d, 1),
                self.dtypes[name],
                self._stream(mb, name, d, 1),
            )
            for name, dsts in st.send
            if lay.kinds[name] == "grad"
            for d in dsts
        ]

    def _prefetch(self, actions) -> None:
        """Post the receives of the coming actions now, so their messages arrive while this rank
        computes (a receive posted only when needed costs a round trip with the busy sender)."""
        for a in actions:
            for src, tag, dtype, stream in self._receives(a):
                self._ch.prefetch(src, tag, dtype, stream)

    def _recv_inputs(self, a, train: bool):
        st, lay = self.layout.stages[a.stage], self.layout
        args, received = [], []
        for (name, src), (src_rank, tag, dtype, stream) in zip(st.recv, self._receives(a)):
            t = self._ch.recv(src_rank, tag, dtype, stream)
            if lay.kinds[name] == "int":
                args.append(int(t.reshape(-1)[0]))
                continue
            if lay.kinds[name] == "grad" and train:
                t.requires_grad_(True)
                received.append((name, src, t))
            args.append(t)
        args += [self._inputs[a.microbatch][n] for n in st.inputs]
        return args, received

    def _forward(self, a, train: bool) -> None:
        st = self.layout.stages[a.stage]
        args, received = self._recv_inputs(a, train)
        keep_graph = train and not self.options.checkpoint
        measuring = self._measuring
        counter = _SavedBytes(self._param_ptrs) if keep_graph and measuring else contextlib.nullcontext()
        rng = (torch.get_rng_state(), rng_state(self.modules[a.stage])) if train and not keep_graph else None
        t0, c0 = time.perf_counter(), time.thread_time() if measuring else None
        with counter, torch.set_grad_enabled(keep_graph):
            outs = self.modules[a.stage](*args)
            sends, loss = self._split_outputs(st, outs, a.microbatch)
        if st.has_output:
            self._last_forwards += 1
            if self._last_forwards == self.options.microbatches and self._sync_loss and self._folded(current_backend()):
                # every loss of the step is known: its all-reduce goes while the backwards run
                self._loss_work = current_backend().all_reduce_async(self._local_values(), self._loss_group, self.rank)
        t1 = time.perf_counter()
        self.timeline.append(Event("F", a.microbatch, a.stage, t0, t1, time.thread_time() - c0 if measuring else None))
        for (name, _), v, to in zip(st.send, sends, self._sends(a)):
            x = self._wire(name, v)
            for dst, tag, stream in to:
                self._ch.send(x, dst, tag, stream)
        if train:
            nbytes = (counter.bytes if keep_graph else sum(_nbytes(x) for x in args)) if measuring else 0
            self._saved[(a.microbatch, a.stage)] = _Saved(args, received, list(sends), loss, nbytes, rng)
            self._held_bytes += nbytes
            held = len(self._saved) + len(self._pending)
            self.stats["max_in_flight"] = max(self.stats["max_in_flight"], held)
            if measuring:
                self.stats["peak_activation_bytes"] = max(self.stats["peak_activation_bytes"], self._held_bytes)

    def _wire(self, name: str, v) -> torch.Tensor:
        """A boundary value as it travels: in its traced dtype (under a precision policy a stage
        computes in ``param_dtype`` and the receiving stage casts its floating inputs back to it:
        both casts are exact), an integer as a one-element tensor."""
        if not isinstance(v, torch.Tensor):
            return torch.tensor([int(v)], dtype=torch.int64)
        want = self.dtypes[name]
        return v.to(want) if v.dtype != want and v.is_floating_point() and want.is_floating_point else v

    def _split_outputs(self, st, outs, mb: int):
        sends = outs[: len(st.send)]
        if not st.has_output:
            return sends, None
        flat = list(outs[len(st.send) :])
        outputs = pytree.tree_unflatten(flat, self.plan.traced.out_spec)
        labels = self._labels[mb]
        loss = self.loss_fn(outputs, labels) if self.loss_fn else _own_loss(flat)
        if loss is not None:
            self._losses.append(loss.detach())
        elif self._training:
            raise PipelineError(
                "The model returns no scalar loss: pass Pipeline(loss=fn) or "
                "plan.pipeline_runner(rank, loss=fn) with fn(outputs, labels) -> scalar."
            )
        if self.metric_fn is not None:
            with torch.no_grad():
                self._metrics.append(torch.as_tensor(self.metric_fn(outputs, labels), dtype=torch.float32))
        if self._keep:
            self.outputs.append(pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, outputs))
        return sends, loss

    def _backward(self, a) -> None:
        st = self.layout.stages[a.stage]
        sv = self._saved.pop((a.microbatch, a.stage))
        clock = time.thread_time if self._measuring else _no_clock
        t0, c0 = time.perf_counter(), clock()
        if self.options.checkpoint:
            self._recompute(a, st, sv)
        t_wait, c_wait = time.perf_counter(), clock()
        tensors, grads = self._output_grads(a, st, sv)
        t_go, c_go = time.perf_counter(), clock()
        if st.has_output:
            tensors.append(sv.loss)
            seed = torch.full_like(sv.loss, self._weights[a.microbatch])
            grads.append(seed if self._scaler is None else self._scaler.scale(seed).to(seed.dtype))
        if self._split:  # input gradients only; the weights' in this micro-batch's W
            inputs = [t for _name, _src, t in sv.received]
            wg, got = backward_input(tensors, grads, inputs) if tensors else (None, [None] * len(inputs))
            for t, g in zip(inputs, got):
                t.grad = g
            self._pending[(a.microbatch, a.stage)] = (wg, sv.nbytes)
        else:
            with self.grad_sync.no_sync() if self.grad_sync else contextlib.nullcontext(), self._stage_no_sync(a):
                if tensors:
                    torch.autograd.backward(tensors, grads)
        t1 = time.perf_counter()
        # The event's time is compute only (as the forward's): recomputation plus backward, not the
        # gradient wait nor the sends.
        cpu = clock() - c0 - (c_go - c_wait) if self._measuring else None
        self.timeline.append(Event("B", a.microbatch, a.stage, t0 + (t_go - t_wait), t1, cpu))
        to = {name: msg for (name, _), msg in zip(st.recv, self._sends(a))}
        for name, _src, t in sv.received:
            g = t.grad if t.grad is not None else torch.zeros_like(t)
            self._ch.send(g, *to[name])
        if not self._split:
            self._held_bytes -= sv.nbytes

    def _weight_grads(self, a) -> None:
        """A zero-bubble schedule's W: the weights' gradients of one micro-batch's stage backward,
        whose input gradients its B computed and sent (split_backward.py); frees its graph."""
        wg, nbytes = self._pending.pop((a.microbatch, a.stage))
        t0, c0 = time.perf_counter(), time.thread_time() if self._measuring else None
        with self.grad_sync.no_sync() if self.grad_sync else contextlib.nullcontext(), self._stage_no_sync(a):
            if wg is not None:
                backward_weight(wg)
        t1 = time.perf_counter()
        self.timeline.append(
            Event("W", a.microbatch, a.stage, t0, t1, time.thread_time() - c0 if self._measuring else None)
        )
        self._held_bytes -= nbytes

    def _stage_no_sync(self, a):
        """A stage module's own gradient reduction (a technique's, attached as ``no_sync``: zero=3
        reduce-scatters in backward) runs once per step, in the stage's last backward; the
        earlier micro-batches accumulate."""
        self._backwards[a.stage] = done = self._backwards.get(a.stage, 0) + 1
        no_sync = getattr(self.modules[a.stage], "no_sync", None)
        return no_sync() if no_sync is not None and done < self.options.microbatches else contextlib.nullcontext()

    def _recompute(self, a, st, sv) -> None:
        """Checkpointing: run the stage's forward again, now keeping its graph."""
        counter = _SavedBytes(self._param_ptrs) if self._measuring else contextlib.nullcontext()
        module = self.modules[a.stage]
        with counter, torch.enable_grad(), torch.random.fork_rng(devices=[]), replayed_rng(module, sv.rng[1]):
            torch.set_rng_state(sv.rng[0])  # the same dropout masks as the forward
            outs = module(*sv.args)
            sv.sends, sv.loss = self._split_outputs_quiet(st, outs, a.microbatch)
        if self._measuring:
            peak = self._held_bytes + counter.bytes
            self.stats["peak_activation_bytes"] = max(self.stats["peak_activation_bytes"], peak)

    def _output_grads(self, a, st, sv):
        """The gradients of this stage's sent values, summed over the stages that read them."""
        kinds, receives = self.layout.kinds, iter(self._receives(a))  # in st.send's order
        tensors, grads = [], []
        for (name, dsts), v in zip(st.send, sv.sends):
            if kinds[name] != "grad":
                continue
            g = None
            for _ in dsts:
                gd = self._ch.recv(*next(receives))
                g = gd if g is None else g + gd
            if v.requires_grad:
                tensors.append(v)
                grads.append(g)
        return tensors, grads

    def _split_outputs_quiet(self, st, outs, mb):
        keep, losses, metrics = self._keep, self._losses, self._metrics
        self._keep, self._losses, self._metrics = False, [], []
        try:
            return self._split_outputs(st, outs, mb)
        finally:
            self._keep, self._losses, self._metrics = keep, losses, metrics

    def _stream(self, mb: int, name: str, consumer: int, direction: int) -> tuple:
        """The p2p stream of one boundary value: its messages share one shape, in this step and
        every later one whose micro-batch inputs have the same shapes (2, 2, 1, 1 rows: two
        streams; another sequence length: another stream)."""
        return (name, consumer, direction, self._mb_shapes[mb])

    def _tag(self, mb: int, name: str, consumer: int, direction: int) -> int:
        lay = self.layout
        return ((mb * len(lay.value_ids) + lay.value_ids[name]) * lay.n_stages + consumer) * 2 + direction

    # ----------------------------------------------------------------- after the step
    def _sync_grads(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync._finish()  # every bucket once, after the last micro-batch
        backend = current_backend()
        for p, group in self.tied_groups:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            total = backend.all_reduce(g, group, self.rank, "sum")
            if p.grad is None:
                p.grad = total
            else:
                p.grad.copy_(total)

    def _local_values(self) -> torch.Tensor:
        """This rank's loss (and metric): the micro-batches' weighted sum, zeros off the last stage."""
        dev = self._device()  # the losses' (a CPU weight vector times CUDA losses fails: found by a dry run)
        w = torch.tensor(self._weights, device=dev)
        vals = [(torch.stack(self._losses).float() * w).sum() if self._losses else torch.zeros((), device=dev)]
        if self.metric_fn is not None:
            metrics = [x.to(dev) for x in self._metrics]
            vals.append((torch.stack(metrics).float() * w).sum() if metrics else torch.zeros((), device=dev))
        return torch.stack([x.float() for x in vals])

    def _device(self) -> torch.device:
        """Where this rank computes: its stages' (their parameters', else the CPU)."""
        return next((m.autopar_device for m in self.modules.values()), torch.device("cpu"))

    def _local_results(self):
        """``sync_loss=False``: this rank's loss (and metric) where it holds the last stage, else None."""
        if not self._holds_last:
            return (None, None) if self.metric_fn is not None else None
        v = self._local_values()
        return (v[0], v[1]) if self.metric_fn is not None else v[0]

    def _folded(self, backend) -> bool:
        """Whether the loss goes in one all-reduce over the pp x dp ranks: the backend has that
        group (parallel/process_groups.py makes it: Pipeline.process_groups; the simulator has
        every group), or there is no dp axis (the pp group's)."""
        return self.plan.dp_axis is None or self._loss_group in getattr(backend, "groups", (self._loss_group,))

    def _reduce_results(self, backend):
        """The mean loss (and metric) over micro-batches and data-parallel ranks, on every rank:
        one all-reduce over the pp x dp ranks (the sum over stages, where only the last holds a
        loss, and over the dp ranks, divided by their number), launched early so that it runs
        while the step computes: by the ranks without the last stage at the step's start (their
        part is zeros), by the last stage's after its last forward. Where the backend lacks the
        pp x dp group: pp, then dp, at the end."""
        mesh, dp = self.plan.mesh, self.plan.dp_axis
        if self._loss_work is not None:
            v = self._loss_work.wait()
            if dp is not None:
                v = v / mesh.axis_size(dp)
        else:
            v = self._local_values()
            v = backend.all_reduce(v, mesh.group(self.layout.axis, self.rank), self.rank, "sum")
            if dp is not None:
                v = backend.all_reduce(v, mesh.group(dp, self.rank), self.rank, "avg")
        return (v[0], v[1]) if self.metric_fn is not None else v[0]


def loss_group(plan, rank: int) -> tuple[int, ...]:
    """The ranks the step's loss is reduced over: ``rank``'s pipeline ranks times its
    data-parallel ranks (its coordinates on the other axes, tp's say, fixed); the pp group where
    there is no dp axis."""
    mesh, lay = plan.mesh, plan.stage_layout
    if plan.dp_axis is None:
        return mesh.group(lay.axis, rank)
    pp, dp = lay.axis, mesh.axis_index(plan.dp_axis)
    return tuple(sorted({r for q in mesh.group(dp, rank) for r in mesh.group(pp, q)}))


def _own_loss(flat):
    """The model's own loss: its first scalar floating output."""
    for t in flat:
        if isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype.is_floating_point:
            return t
    return None


def _check_static_rows(plan, name: str, pieces: list, m: int) -> None:
    """A PipelineError where the stages were traced with a static dim 0 other than a micro-batch's
    rows (a static trace reused for a pipeline: plan.with_options adding one, or a model whose
    export could not keep the batch dynamic), rather than a reshape failing inside a stage."""
    names = plan.traced.user_inputs
    ph = next((n for n in plan.graph.nodes if n.op == "placeholder" and n.name == name), None)
    val = ph.meta.get("val") if ph is not None else None
    if not isinstance(val, torch.Tensor) or not val.dim() or not isinstance(val.shape[0], int):
        return
    local = val.shape[0]  # this rank's rows as traced: the static batch over the axes that split it
    for axis, p in enumerate(plan.input_specs[names.index(name)] or ()):
        if isinstance(p, Shard) and p.dim == 0:
            if local % plan.mesh.shape[axis]:
                return  # cut unevenly: the rows differ by rank, left to the stage
            local //= plan.mesh.shape[axis]
    if any(p.shape[0] != local for p in pieces):
        raise PipelineError(
            f"Input {name!r}: the pipeline's stages were traced with a static batch ({val.shape[0]} rows, "
            f"{local} on this rank) and its {m} micro-batches have {', '.join(str(p.shape[0]) for p in pieces)}. "
            "Give the pipeline to ap.plan itself (pipeline=ap.Pipeline(...)): it exports the batch dim as "
            "dynamic even with dynamic=False; plan.with_options(...) adding one reuses the static trace."
        )


def _chunk(t: torch.Tensor, m: int, name: str, per: str = "micro-batch") -> list:
    """``t`` cut into ``m`` pieces along dim 0 as torch.tensor_split cuts (the first pieces one
    row longer where ``m`` does not divide it: 6 rows in 4 micro-batches are 2, 2, 1, 1)."""
    if t.dim() == 0 or t.shape[0] < m:
        raise InputError(
            f"Input {name!r} of shape {tuple(t.shape)} cannot give each of {m} {per}es a row along dim 0: "
            f"use a batch (per data-parallel rank) of at least {m} rows, or fewer micro-batches."
        )
    return list(torch.tensor_split(t, m, dim=0))


def _weights(rows, m: int, ragged, dp_axis) -> list[float]:
    """Each micro-batch's share of the rank's rows: the weight of its loss in the step's loss and
    gradients, so that micro-batches of 2, 2, 1, 1 rows give the mean over all 6 rows (1/m each
    when they are equal). Under a batch cut unevenly over data-parallel ranks (a ragged plan),
    uneven micro-batches are refused: the weights would need the other ranks' row counts."""
    if rows is None or len(set(rows)) == 1:
        return [1.0 / m] * m
    if dp_axis is not None and dp_axis in ragged:
        raise InputError(
            f"Micro-batches of {rows} rows on a batch that is also cut unevenly over the data-parallel ranks: "
            f"give each data-parallel rank a batch divisible by the {m} micro-batches, or plan with a batch that "
            "divides by the data-parallel axis."
        )
    total = sum(rows)
    return [r / total for r in rows]


def _dtype(node):
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else torch.int64


def _nbytes(x) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def _no_clock() -> float:
    return 0.0


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes autograd saves for backward (parameters and their views excluded:
    ``param_ptrs``, their storages' addresses).

    Its pack stores ``t.detach()``, not ``t``: an op that saves its own output (relu, softmax)
    would otherwise hold that output, whose grad_fn holds the saved value: a cycle through C++
    that Python's gc cannot see. A plain backward frees saved values and breaks it; a split
    backward (B and W, retain_graph=True) never does, and every micro-batch's stage stayed alive
    for good (ZB-H1 pp2 m4: the last stage +91 KB per W, 0.50 MB held where 0.31 were due).
    torch's saved_tensors_hooks docs warn of this cycle."""

    def __init__(self, param_ptrs: set):
        self.bytes = 0
        self._seen: set = set()

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in param_ptrs and ptr not in self._seen:
                self._seen.add(ptr)
                self.bytes += t.untyped_storage().nbytes()
            return t.detach()  # not t: see the docstring

        super().__init__(pack, lambda t: t)
