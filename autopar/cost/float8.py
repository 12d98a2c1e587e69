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

Example:
    >>> sorted(float8_linears(plan))               # ['linear', 'linear_1', ...] (not lm_head's)
    >>> cast_bytes(plan, Numbers(plan.mesh), compiled=True)["linear"]   # (forward, backward) bytes
"""

from __future__ import annotations

import torch

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
