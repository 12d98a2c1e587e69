"""Models built on the meta device: rank modules get empty real pieces, filled later.

A model made under ``with torch.device("meta")`` holds shapes only, so it can be traced
and planned without memory. Planned with real example inputs, its rank modules then hold
uninitialised tensors of their local shapes on the inputs' device (what the rank needs anyway), so gradient sync, ZeRO flat buffers and the
optimizer attach to the real Parameters; ``ap.load_pretrained`` (or ``ap.set_state_dict``)
fills them in place. ap.parallelize does not broadcast them (there is nothing to agree on yet).

Example:
    >>> with torch.device("meta"):
    ...     model = LlamaForCausalLM(config)
    >>> module = ap.parallelize(model, mesh, kwargs=..., annotations=...)
    >>> ap.load_pretrained(module, "llama_dir")
"""

from __future__ import annotations

import torch.utils._pytree as pytree
import torch


def materialize(t: torch.Tensor, device) -> torch.Tensor:
    """An empty tensor on ``device`` of ``t``'s shape and dtype when ``t`` is on the meta device
    (``device`` None: the plan's inputs are meta too, so its rank modules stay shapes only)."""
    if device is None or t.device.type != "meta":
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=device)


def meta_names(model: torch.nn.Module) -> set[str]:
    """Names of the model's parameters and buffers that are on the meta device."""
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
    return {n for n, t in named if t.device.type == "meta"}


def retarget_meta_device(graph, device) -> int:
    """Replace ``device=meta`` baked into a graph traced from a meta model (metadata asserts,
    ``.to(buffer.device)``, factory calls) by ``device``, where the rank modules' tensors live.
    Returns how many arguments changed."""
    meta, device = torch.device("meta"), torch.device(device)
    changed = 0

    def fix(v):
        nonlocal changed
        if isinstance(v, torch.device) and v == meta:
            changed += 1
            return device
        if isinstance(v, (list, tuple)):
            return type(v)(fix(x) for x in v)
        return v

    for node in graph.nodes:
        node.args = tuple(fix(a) for a in node.args)
        node.kwargs = {k: fix(v) for k, v in node.kwargs.items()}
    return changed


def input_device(args, kwargs) -> torch.device | None:
    """The device of the first real tensor among example inputs (cpu if there is no tensor,
    None if they are all on the meta device: a shapes-only plan, e.g. to time planning)."""
    tensors = [x for x in pytree.tree_leaves((args, kwargs or {})) if isinstance(x, torch.Tensor)]
    real = [x for x in tensors if x.device.type != "meta"]
    if real:
        return real[0].device
    return None if tensors else torch.device("cpu")
