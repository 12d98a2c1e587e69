"""ap.Auto: what the automatic planner may assume and must respect, as one frozen value.

- ``memory_budget``: bytes per rank (parameters, gradients, optimizer state, activations as
  plan.cost() counts them); None: no limit.
- ``device``: a profile name ("h100", "h100-500w", "h200", "a100", "cpu-gloo") or an ap.calibrate() result;
  ``alpha`` / ``beta`` / ``flops_per_s`` / ``memory_bandwidth`` override its numbers (every link). None: the device
  the job's example inputs are on (CPU: "cpu-gloo"; CUDA: "a100", "h200" or "h100" by name; meta: "h100").
- ``zero``: the ZeRO levels the search may pick for a data-parallel axis.
- ``sequence_parallel`` / ``vocab_parallel``: whether those options may be chosen.
- ``optimizer_states``: state tensors per parameter element, each in its parameter's dtype (2 for Adam).
- ``activation_checkpoint``: the checkpointing of every repeated block the search may pick
  (None: none, "selective", "full": ap.ActivationCheckpoint's modes, or ap.ActivationCheckpoint
  values; its recompute counted). By default (None: the technique's own space) none, selective,
  selective keeping every second matmul (torchtitan's op policy: between the two in memory and
  time) and full.
- ``pipeline``: whether an axis may hold pipeline stages (one micro-batch per row of a
  data-parallel rank's batch), under the schedules of ``pipeline_schedules`` ("1f1b",
  "interleaved", the zero-bubble "zb-h1", "zbv" and "dualpipev"; each where it applies: two
  chunks per rank for the V-shaped and interleaved ones, m >= 2pp for DualPipeV).
- ``expert_parallel``: whether a mixture-of-experts model's experts may be split over the dp
  axis (ap.expert_parallel: E/n experts per rank, tokens dispatched by all-to-all).
- ``expert_tensor_parallel``: whether expert-parallel experts may also be split over the tp axis
  (ap.expert_parallel(dp, tp=tp): each expert's up projection column-, down row-parallel).
- ``context_parallel``: the attention methods a context-parallel axis may use (ap.ContextParallel:
  every sequence split on the axis, K/V all-gathered, passed around a ring, or swapped for a head
  split by all-to-alls (Ulysses, where the heads divide); zig-zag ordered where the sequences
  divide into 2 chunks per rank); () leaves sequences whole.
- ``compiled``: the rank modules will run under torch.compile: connected memory-bound ops are
  costed as fused regions (cost/fusion.py) instead of one eager kernel each. ``"blocks"``: each
  repeated block compiled on its own (torchtitan's ``apply_compile``), the ops outside them eager.
- ``float8``: every nn.Linear but the LM head runs its matmuls in float8 (torchao's tensorwise
  dynamic scaling, as torchtitan converts them): at the profile's bf16 rate times its fp8 / bf16
  datasheet ratio, plus the casting kernels' bytes, and zero=3 gathers those weights in fp8
  (parallel/float8/cost.py). A PlanError on a profile without fp8 tensor cores (a100, cpu-gloo).
- ``option``: plan this option of the search instead of the fastest one that fits: a label as
  ``plan.explain("auto")`` lists its runners-up (``"dp=a, tp=b, ZeRO-1"``). The search weighs the
  same options and keeps the same record; only the choice differs (over the budget too: that is
  what explaining a refused option needs). ``plan.search_view().explain(i)`` plans with it.
- ``choices``: the choices per technique, by its name (``{"pipeline": ("1f1b",), "data_parallel": (0, 3),
  "activation_checkpoint": (None, "full"), "context_parallel": ("ring",), "float8": True}``); each
  technique reads its own (parallel/protocols/search.py) and, where absent, its shorthand above
  (``zero``, ``pipeline`` / ``pipeline_schedules``, ``activation_checkpoint``, ``context_parallel``,
  ``float8``). A name no technique has is an error.
- ``verify``: the chosen plan's peak rank dry-run at full size on fake tensors (plan.dry_run); its
  measured peak goes into the record (``dry_run_peak``), with a warning where it is over the budget.

Example:
    >>> plan = ap.plan(model, mesh, kwargs=batch, auto=ap.Auto(memory_budget=2**30, device="cpu-gloo"))
    >>> print(plan.explain("auto"))
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.errors import PlanError
from autopar.parallel.registry import TECHNIQUES
from autopar.search.profiles import Profile, profile_of


@dataclass(frozen=True)
class Auto:
    memory_budget: float | None = None
    alpha: float | None = None
    beta: float | None = None
    flops_per_s: float | None = None
    device: object = None
    memory_bandwidth: float | None = None
    zero: tuple = (0, 1, 2, 3)
    sequence_parallel: bool = True
    vocab_parallel: bool = True
    optimizer_states: int = 2
    pipeline: bool = True
    pipeline_schedules: tuple = ("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
    activation_checkpoint: tuple | None = None  # None: the technique's own (none, selective, 1 matmul in 2, full)
    expert_parallel: bool = True
    expert_tensor_parallel: bool = True
    context_parallel: tuple = ("allgather", "ring", "ulysses")
    compiled: bool | str = False  # False, True (the rank module) or "blocks"
    float8: bool = False
    verify: bool = False  # dry-run the chosen plan (autopar/dryrun/verify.py): warn where it peaks over the budget
    option: str | None = None  # a runner-up's label to plan instead of the fastest option (search_view)
    choices: tuple | dict | None = None  # {technique name: its choices}: over the shorthands above

    def __post_init__(self):
        if self.choices is None:
            return
        given = dict(self.choices)
        unknown = sorted(set(given) - set(TECHNIQUES))
        if unknown:
            raise PlanError(
                f"ap.Auto(choices=...) names {unknown}, which no technique is; the techniques are "
                f"{', '.join(TECHNIQUES)}."
            )
        # kept as sorted pairs, lists as tuples: an Auto stays a hashable value
        frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in given.items()))
        object.__setattr__(self, "choices", frozen)

    def choices_for(self, name: str, shorthand=None):
        """Technique ``name``'s choices: ``choices[name]`` where given, else ``shorthand`` (the
        field that says it, which the technique's search hook passes).

        Example: ap.Auto(choices={"pipeline": ("1f1b",)}).choices_for("pipeline", ()) -> ("1f1b",)"""
        for key, value in self.choices or ():
            if key == name:
                return value
        return shorthand

    @classmethod
    def of(cls, value) -> "Auto":
        if isinstance(value, Auto):
            return value
        if value is True:
            return cls()
        raise PlanError(f"ap.plan(auto={value!r}): pass auto=True or auto=ap.Auto(...).")

    def profile(self, where=None) -> Profile:
        """The cost model's device: ``device``, or (None) the one the job runs on (``where``,
        the example inputs' device: a CPU job is planned for ``cpu-gloo``, not an H100)."""
        profile = profile_of(self.device, where).with_values(
            self.alpha, self.beta, self.flops_per_s, self.memory_bandwidth
        )
        if self.compiled not in (False, True, "blocks"):
            raise PlanError(f"ap.Auto(compiled={self.compiled!r}): use False, True or 'blocks'.")
        float8 = bool(self.choices_for("float8", self.float8))
        if float8 and not profile.fp8_ratio:
            raise PlanError(
                f"ap.Auto(float8=True): the {profile.name!r} profile has no fp8 tensor cores (float8 "
                "matmuls need an H100/H200-class GPU); drop float8= or pick such a device."
            )
        return replace(profile, compiled=self.compiled, float8=float8)
