"""The interface of a parallelism technique: what one contributes to a plan.

Layouts come from annotations and rules (the annotation family: tensor, sequence and vocab
parallel; sharding/). A *technique* is everything else a plan can be asked for: data
parallelism (gradient buckets, ZeRO 1-3, local SGD), the precision policy, the pipeline,
context and expert parallelism, activation checkpointing, Float8, fault tolerance, and whatever
is added next. Each is one frozen options value (``ap.DataParallel``, ``ap.Pipeline``)
registered by name (registry.py), in one folder of parallel/ that holds its lowerings, runtime
pieces and cost terms; the planning pipeline, the rank modules, the cost model, the search,
checkpoints, clipping, explain and save/load call its hooks and know nothing else about it.

``Technique`` is made of small protocols (protocols/), each a group of optional hooks whose
default changes nothing, so a technique overrides only what it needs:

=============  ==================================================================================
protocol       hooks
=============  ==================================================================================
options        of, take_annotations, fold, replica_groups, check_options, implied, compute_dtype,
               precision_policy, exact
layout         reshape_mesh, validate, tracing, prepare_graph, annotate, prepare_seeded_graph,
               data_axis, token_axes, seed_inputs, attention_method, loss_mean_on, piece_order,
               after_plan
storage        stored, stored_start, stored_axes, stored_share, counts_stored, restored,
               rewrite_program, gather_wire, grad_sync_axes, grad_order, grad_pieces, grad_shards, keeps_state,
               keeps_gathered, group_axes, gather_axes, weight_shards, wired_gathers, wired_params
cost           collectives, bucket_comms, batch_pieces, step_shares, memory, activations,
               rank_activations, kept_saves, recomputed, memory_formulas, rank_params, memory_ranks,
               rank_collectives, op_extras
runtime        join, attach, dry_run_rank, checkpoint_mesh, process_groups, synced_buffers
display        describe, explain_param, explain_module, timeline, fields, from_fields
search         search_roles, search_variant, search_offered, search_space, search_axes, search_label,
               gathers_weights, search_adds, priced_wire_params (what ap.Auto's search may choose)
=============  ==================================================================================

The map of a plan's life: which hook runs when, and who calls it (every technique's hook runs
in the techniques' ``order``, lowest first)::

    ap.plan(model, mesh, name=technique, ...)              api.py, options.py
      of(value) -> take_annotations(annotations) -> fold(chosen) -> check_options(options)
        fault tolerance's fold asks replica_groups(chosen, axis) of every registered one
      implied(model)                                        a model that asks for one (Float8Linear)
      compute_dtype(), precision_policy()                   the trace's dtype; the search's probes' policy
    planner.make_plan                                       planner.py
      reshape_mesh(mesh) -> validate(mesh, options, annotations)
      tracing(model)                                        around torch.export
      prepare_graph(traced)                                 value-preserving rewrites
      annotate(model, traced, annotations)                  layouts it stands for (expert parallel)
      prepare_seeded_graph(traced, seeds, mesh, data_axis)  every registered one (MoE blocks as one op)
      data_axis() / seed_inputs(seeds, mesh, inputs)        the seeds; token_axes() for ZeRO's fold
      -- with ap.Auto: the search asks every registered technique's search_* hooks (search/) --
      -- propagation; the lowerings ask attention_method(axis), piece_order(axis),
         loss_mean_on(axis) --
    Plan.finish                                             plan.py
      after_plan(plan)                                      -> plan.built[name] (pipeline stages)
    plan.program / plan.module(rank)                        plan.py, codegen/rank_module.py
      rewrite_program(plan, graph), gather_wire(plan)       the one emitted program (a wire's gathers:
        wired_gathers(plan, graph), gather_axes(plan), wired_params(plan, rank))
      stored / stored_start / stored_axes / counts_stored   what each rank keeps
      attach(plan, module, rank)                            runtime hooks on a rank's module
        synced_buffers(plan)                                the written buffers kept equal (fault tolerance)
    ap.parallelize                                          api.py, parallel/process_groups.py
      join(plan, timeout) -> process_groups(plan)
    training: grad_sync_axes (buckets), grad_shards (the sync's slices, ZeRO 1-2: then
      ap.Optimizer, ap.GradScaler and checkpoints ask them), grad_pieces (clipping)
    costing: collectives, step_shares, batch_pieces,        cost/, plan.memory_per_rank,
      activations -> rank_activations, memory,              ap.predict, the search
      memory_formulas, kept_saves, recomputed, rank_params, memory_ranks, stored_share,
      group_axes -> bucket_comms (a gradient bucket's group)
      op_extras(plan, sy, profile, fused)                   each op's seconds (cost/execution.py),
                                                            every registered one
      keeps_state, weight_shards, data_axis                 plan.state_storage, plan.weight_shards,
                                                            plan.batch_axis (asked outside parallel/)
      keeps_gathered                                        the memory phases (cost/plan_cost.phase_flags)
    checkpoints: stored_start, restored, checkpoint_mesh    checkpoint/, plan.load_state_dict
    plan.dry_run: dry_run_rank(plan, rank, device, stats)   dryrun/run.py: a rank's step run by the technique
      -> a DryRank (the pipeline's runner); its predicted figures ask rank_collectives
    display: describe, explain_param, explain_module; timeline (plan.timeline_figure);
      fields / from_fields (plan files); exact() for plan.check

Example (the shape of a new technique):
    >>> @register_technique
    ... @dataclass(frozen=True)
    ... class MyTechnique(Technique):
    ...     axis: str
    ...     name = "my_technique"          # ap.plan(..., my_technique=MyTechnique("tp"))
    ...     def validate(self, mesh, options, annotations): mesh.axis_index(self.axis)
    ...     def attach(self, plan, module, rank): module.my_hook = ...
"""

from __future__ import annotations

from autopar.parallel.protocols import (
    CostHooks,
    DisplayHooks,
    LayoutHooks,
    OptionHooks,
    RuntimeHooks,
    SearchHooks,
    StorageHooks,
)


class Technique(OptionHooks, LayoutHooks, StorageHooks, CostHooks, RuntimeHooks, DisplayHooks, SearchHooks):
    """Base of parallelism techniques; subclasses are frozen dataclasses."""

    #: its keyword in ap.plan / ap.parallelize, its field of ap.PlanOptions, its key in plan files
    name: str = ""
    #: where it applies among the techniques (lower first): the hooks chain in this order
    order: int = 50
    #: functions the technique offers as ``plan.<name>(...)`` (static methods taking the plan first)
    plan_methods: tuple = ()
