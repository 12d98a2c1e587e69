"""ap.Optimizer: any torch.optim class, equal to serial on any plan (zero 0-3, pipelines).

A rank module's parameters are pieces: split by tensor parallelism, 1-D ranges under zero=3,
a pipeline rank's stages only. An *elementwise* optimizer (SGD, Adam, AdamW, Adagrad, RMSprop,
NAdam, RAdam, Adamax, Adadelta, ASGD, Rprop: each element's update reads that element of the
parameter, its gradient and its state) gives the serial update on any piece: ap.Optimizer
steps the pieces as they are, with no communication (ZeRO-1/2: through the optimizer the
storage's shards make, ap.ZeroOptimizer).
The others read whole tensors: Adafactor factors each matrix's second moment into row and
column means, Muon orthogonalises each whole matrix (Newton-Schulz), LBFGS takes dot products
over every parameter. Stepping pieces gives other numbers (2.2e-2 and 9.0e-2 from serial after
3 steps on tp=2, no error). For those ap.Optimizer gathers what they read: each step every
rank assembles the whole parameters and gradients it steps (one all-gather per mesh axis of
all the pieces, laid end to end), runs the optimizer on whole-tensor copies exactly as the
serial model would (every rank the same computation, so no update is sent back), and keeps its
own piece of each result. Its state is whole on every rank (Adafactor's factors are small;
Muon's momentum is a whole copy of each matrix): exactness first, memory as serial's.

``params``: which of the module's parameters it steps (None: every trainable one), as serial
names or fnmatch patterns, or ``callable(name, serial_shape) -> bool`` (Muon takes matrices:
``params=lambda name, shape: len(shape) == 2``), or as torch.optim takes them: the module's
parameters (``[p for p in module.parameters() if p.dim() == 2]``) or param-group dicts of them
(``[{"params": [...], "lr": 0.02}]``). ``param_groups``: as ap.ZeroOptimizer's, name patterns
with per-group options.

And so that no one trains silently wrong: a plain torch.optim optimizer that is not
elementwise (Adafactor, Muon, LBFGS, SparseAdam) stepping rank pieces raises a PlanError naming
ap.Optimizer at its first step (a global torch.optim step pre-hook).

Example:
    >>> muon = ap.Optimizer(module, torch.optim.Muon, params=lambda n, s: len(s) == 2, lr=0.02)
    >>> adamw = ap.Optimizer(module, torch.optim.AdamW, params=lambda n, s: len(s) != 2, lr=3e-4)
    >>> loss.backward(); muon.step(); adamw.step(); muon.zero_grad(); adamw.zero_grad()
"""

from __future__ import annotations

import fnmatch
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from autopar.errors import PlanError
from autopar.parallel.param_groups import group_params, zero_grads
from autopar.parallel.param_names import held_params
from autopar.placement import Replicate, local_shape, shard_tensor
from autopar.runtime.backend import current_backend

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "ASGD", "Rprop")
WHOLE_TENSOR = ("Adafactor", "Muon", "LBFGS", "SparseAdam")  # torch.optim classes that read whole tensors
PIECES = WeakIdKeyDictionary()  # rank parameters that are not whole (by identity: tensors compare by value)


class Optimizer(torch.optim.Optimizer):
    """See the module docstring. ``elementwise`` overrides the class-name test (for your own
    optimizer classes: True steps pieces, False gathers whole tensors)."""

    def __init__(self, module, optimizer_class, params=None, param_groups=None, elementwise=None, **defaults):
        plan, rank = _plan_and_rank(module)
        params, param_groups = _by_name(module, plan, params, param_groups)
        everywhere = _selected(module, plan, params)  # every rank's selection, in one order
        named = [(n, p) for n, p in everywhere if p is not None]  # what this rank holds
        names = [n for n, _ in everywhere]
        if elementwise is None:
            elementwise = getattr(optimizer_class, "__name__", "") in ELEMENTWISE
        sync = getattr(module, "autopar_grad_sync", None)
        shards = sync.shards if sync is not None else None  # a storage stepping slices of the buckets (ZeRO-1/2)
        self.module, self.whole = module, None
        if elementwise and shards is not None and params is not None:
            elementwise = False  # ZeRO's shards step every trainable parameter: a selection is stepped whole
        if elementwise and shards is not None:
            self.inner = shards.optimizer_for(module, optimizer_class, param_groups, **defaults)
        elif elementwise:
            self.inner = optimizer_class(group_params(named, param_groups or [], names), **defaults)
        else:
            if getattr(optimizer_class, "__name__", "") in ("LBFGS", "SparseAdam"):
                raise PlanError(
                    f"ap.Optimizer: {optimizer_class.__name__} is not supported (LBFGS re-evaluates a closure "
                    "over the whole model, SparseAdam needs sparse gradients); use another optimizer."
                )
            self.whole = WholeTensorStep(plan, rank, everywhere, shards)
            shadows = list(self.whole.shadows.items())
            self.inner = optimizer_class(group_params(shadows, param_groups or [], names), **defaults)
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state  # one truth

    @torch.no_grad()
    def step(self, closure=None):
        if self.whole is None:
            return self.inner.step(closure) if closure is not None else self.inner.step()
        if closure is not None:
            raise PlanError("ap.Optimizer: a closure is not supported when gathering whole tensors.")
        if not self.whole.gather():
            return None
        out = self.inner.step()
        self.whole.write_back()
        return out

    def stepped_tensors(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` this rank's step reads (what ap.GradScaler unscales and checks):
        gathering whole tensors, the rank's pieces it gathers from (its shadows' gradients are
        filled only inside step), and under ZeRO-2 the reduced slices of those."""
        if self.whole is None:
            own = getattr(self.inner, "stepped_tensors", None)
            return own() if own is not None else [p for g in self.param_groups for p in g["params"]]
        shards = self.whole.shards
        if shards is None or not shards.reduce_scatters:
            return list(self.whole.params.values())
        bucketed = shards.sliced_names()
        slices = shards.slice_tensors(self.whole.params)
        return slices + [p for n, p in self.whole.params.items() if n not in bucketed]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients of what this optimizer steps (two of them on one module, Muon for the
        matrices and AdamW for the rest, clear each its own)."""
        self.inner.zero_grad(set_to_none)  # pieces it steps (the shards' optimizer: the module's), or the shadows
        if self.whole is None:
            return
        tensors = list(self.whole.params.values())
        if self.whole.shards is not None:  # the reduced ZeRO slices of its own parameters (not the other's)
            tensors += self.whole.shards.slice_tensors(self.whole.params)
        zero_grads(tensors, set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state


class WholeTensorStep:
    """The whole parameters and gradients an optimizer that reads whole tensors steps, gathered
    from every rank's pieces, and each rank's piece of the result written back."""

    def __init__(self, plan, rank: int, everywhere: list, shards=None):
        """``everywhere``: (serial name, this rank's parameter or None where it holds none) of
        what every rank steps, in one order (each rank's gather lays its pieces out so);
        ``shards``: the gradient sync's GradShards where the storage keeps slices (ZeRO-1/2)."""
        self.plan, self.rank, self.shards = plan, rank, shards
        self.names = [n for n, _ in everywhere]
        self.params = {n: p for n, p in everywhere if p is not None}
        shapes = _serial(plan)
        self.shadows = {n: torch.nn.Parameter(torch.zeros(shapes[n].shape, dtype=shapes[n].dtype)) for n in self.params}
        self.stored = {n: [_stored_shape(plan, r, n) for r in plan.mesh.ranks()] for n in self.names}
        self.numels = {n: [_prod(s) for s in self.stored[n]] for n in self.names}
        if shards is not None:
            shards.stepped_by = self  # the gradient sync's check: an optimizer is attached

    def gather(self) -> bool:
        """Whole parameters and gradients into the shadows (False: no gradient anywhere)."""
        if self.shards is not None:  # ZeRO-2's reduced slices, all-gathered into whole .grad
            self.shards.gather_grads()
        held = [self.params.get(n) for n in self.names]
        has = torch.tensor([float(p is not None and p.grad is not None) for p in held])
        has = _all_ranks_max(self.plan, self.rank, has)
        parts = []
        for p in held:
            if p is not None:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                parts += [p.detach().reshape(-1), grad.reshape(-1)]
        per_rank = _gather_world(self.plan, self.rank, torch.cat(parts) if parts else torch.zeros(0))
        for i, n in enumerate(self.names):
            if n not in self.params:
                continue
            value, grad = self._whole(n, per_rank, i)
            self.shadows[n].copy_(value)
            self.shadows[n].grad = grad if has[i] > 0 else None
        return bool((has > 0).any())

    def _whole(self, name: str, per_rank: list, index: int):
        """(whole value, whole gradient) of ``name`` from every rank's flat of pieces."""
        pieces, grads = [], []
        for r, flat in enumerate(per_rank):
            at = sum(2 * self.numels[m][r] for m in self.names[:index])
            k = self.numels[name][r]
            shape = self.stored[name][r]
            pieces.append(flat[at : at + k].view(shape))
            grads.append(flat[at + k : at + 2 * k].view(shape))
        return _merge(self.plan, name, pieces), _merge(self.plan, name, grads)

    def write_back(self) -> None:
        """This rank's piece of each updated whole parameter, as the rank module stores it."""
        spec = self.plan.param_specs.get
        for n in self.params:
            piece = shard_tensor(self.shadows[n].detach(), spec(n, _replicated(self.plan)), self.plan.mesh, self.rank)
            for technique in self.plan.options.techniques:
                piece = technique.stored(self.plan, self.rank, n, piece)
            self.params[n].copy_(piece.reshape(self.params[n].shape))


# ------------------------------------------------------------------ gathering over the mesh
def _gather_world(plan, rank: int, flat: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``flat`` (lengths may differ), by rank: an all-gather per mesh axis, last
    axis first, so that the blocks arrive in row-major rank order with no world group needed."""
    backend, mesh = current_backend(), plan.mesh
    sizes = torch.tensor([float(flat.numel())])
    for axis in reversed(range(mesh.ndim)):
        sizes = backend.all_gather(sizes, 0, mesh.group(axis, rank), rank)
    lengths = [int(s) for s in sizes]
    data = torch.cat([flat, flat.new_zeros(max(lengths) - flat.numel())])
    for axis in reversed(range(mesh.ndim)):
        data = backend.all_gather(data, 0, mesh.group(axis, rank), rank)
    return [chunk[:n] for chunk, n in zip(data.view(mesh.size, -1), lengths)]


def _all_ranks_max(plan, rank: int, x: torch.Tensor) -> torch.Tensor:
    per_rank = _gather_world(plan, rank, x)
    return torch.stack(per_rank).amax(0) if per_rank and x.numel() else x


def _merge(plan, name: str, pieces: list) -> torch.Tensor:
    """The serial tensor from every rank's stored piece (a rank that holds none, a pipeline rank
    of another stage, stands in with the piece of one that does at its other coordinates)."""
    held = [_holds(plan, r, name) for r in plan.mesh.ranks()]
    mesh = plan.mesh
    for r in mesh.ranks():
        if not held[r]:
            donor = next(q for q in mesh.ranks() if held[q] and _same_but_stage(plan, q, r))
            pieces[r] = pieces[donor]
    return plan.merge_state_dicts([{name: p} for p in pieces])[name]


def _same_but_stage(plan, a: int, b: int) -> bool:
    lay, ca, cb = plan.stage_layout, plan.mesh.coords(a), plan.mesh.coords(b)
    return all(x == y for i, (x, y) in enumerate(zip(ca, cb)) if lay is None or i != lay.axis)


def _holds(plan, rank: int, name: str) -> bool:
    return name in held_params(plan, rank)


# ------------------------------------------------------------------ what each rank stores
def _serial(plan) -> dict:
    return dict(plan.model.named_parameters(remove_duplicate=False))


def _replicated(plan) -> tuple:
    return (Replicate(),) * plan.mesh.ndim


def _stored_shape(plan, rank: int, name: str) -> tuple:
    if not _holds(plan, rank, name):
        return (0,)
    p = _serial(plan)[name]
    shape = local_shape(tuple(p.shape), plan.param_specs.get(name, _replicated(plan)), plan.mesh)
    local = torch.empty(shape, dtype=p.dtype, device="meta")
    for technique in plan.options.techniques:
        local = technique.stored(plan, rank, name, local)
    return tuple(local.shape)


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ------------------------------------------------------------------ choosing parameters
def _plan_and_rank(module):
    plan = getattr(module, "autopar_plan", None) or getattr(module, "plan", None)
    rank = getattr(module, "autopar_rank", None)
    rank = getattr(module, "rank", None) if rank is None else rank
    if plan is None or rank is None:
        raise PlanError(
            f"ap.Optimizer needs a rank module (ap.parallelize, plan.module(rank)) or a pipeline runner; "
            f"got {type(module).__name__}."
        )
    return plan, rank


def _by_name(module, plan, params, param_groups) -> tuple:
    """``params`` (and ``param_groups``) in names, where given as torch.optim takes them: tensors
    of the module (or of the serial model), or dicts whose ``"params"`` are such tensors."""
    if params is None or callable(params) or isinstance(params, str):
        return ([params] if isinstance(params, str) else params), param_groups
    params = list(params)
    if not any(isinstance(p, (torch.Tensor, dict)) for p in params):
        return params, param_groups  # names and patterns
    known = {id(t): n for n, t in (*plan.model.named_parameters(), *_all_names(module).items())}

    def names(tensors) -> list[str]:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        out = [t if isinstance(t, str) else known.get(id(t)) for t in tensors]
        if None in out:
            t = tensors[out.index(None)]
            raise PlanError(
                f"ap.Optimizer(params=...): a tensor of shape {tuple(t.shape)} is not a parameter of the module "
                "(or of the serial model): pass the module's own parameters, their names, or a callable(name, shape)."
            )
        return out

    if not any(isinstance(p, dict) for p in params):
        return names(params), param_groups
    if param_groups:
        raise PlanError("ap.Optimizer: param-group dicts in params= and param_groups= at once; give the groups once.")
    groups = [dict(g, params=names(g["params"])) if isinstance(g, dict) else {"params": names(g)} for g in params]
    return [n for g in groups for n in g["params"]], groups


def _selected(module, plan, params) -> list[tuple[str, torch.nn.Parameter | None]]:
    """(serial name, this rank's parameter or None) of the trainable parameters ``params`` selects
    among the model's (one per tensor, the same list on every rank: a pipeline rank holds some)."""
    mine = _all_names(module)
    out = []
    for name, p in plan.model.named_parameters():
        if not p.requires_grad or (name in mine and not mine[name].requires_grad):
            continue
        shape = tuple(p.shape)
        if (
            params is None
            or (callable(params) and params(name, shape))
            or (not callable(params) and any(fnmatch.fnmatchcase(name, pat) for pat in params))
        ):
            out.append((name, mine.get(name)))
    if not any(p is not None for _, p in out):
        raise PlanError(f"ap.Optimizer(params={params!r}) selects no trainable parameter this rank holds.")
    return out


def _all_names(module) -> dict:
    """Every name of every parameter the module (or pipeline runner) holds: a weight tied across
    stages is ``lm_head.weight`` on one stage's ranks and ``wte.weight`` on the other's."""
    runner_params = getattr(module, "params", None)
    if isinstance(runner_params, dict):
        return {n: p for n, p in runner_params.items() if isinstance(p, torch.nn.Parameter)}
    return dict(module.named_parameters(remove_duplicate=False))


# ------------------------------------------------------------------ the guard on plain optimizers
def mark_pieces(plan, module: torch.nn.Module, rank: int) -> None:
    """Remember ``module``'s parameters that are pieces of their serial tensor (a hook of the
    rank-module builder, codegen/rank_module.py), so that a whole-tensor optimizer stepping them
    is refused at its first step."""
    shapes = _serial(plan)
    for name, p in module.named_parameters(remove_duplicate=False):
        if name in shapes and tuple(p.shape) != tuple(shapes[name].shape):
            PIECES[p] = True


def _refuse_whole_tensor_optimizer_on_pieces(optimizer, args, kwargs) -> None:
    name = type(optimizer).__name__
    if name not in WHOLE_TENSOR:
        return
    pieces = [p for g in optimizer.param_groups for p in g["params"] if p in PIECES]
    if pieces:
        raise PlanError(
            f"torch.optim.{name} reads whole tensors (row/column factors, whole-matrix products), but it "
            f"steps {len(pieces)} rank pieces of split parameters: the update would differ from serial "
            f"with no error. Use ap.Optimizer(module, torch.optim.{name}, ...), which gathers what it reads."
        )


register_optimizer_step_pre_hook(_refuse_whole_tensor_optimizer_on_pieces)
