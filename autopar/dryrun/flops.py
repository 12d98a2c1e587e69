"""FLOPs a dry run counts: torch's FlopCounterMode, with causal attention counted as it runs.

torch's formulas for the SDPA kernels count the whole S x S score matrix whatever ``is_causal``
says ("NB: We aren't accounting for causal attention here"); flash attention skips the blocks
above the diagonal, half the work at long sequences, which is what the cost model counts
(cost/op_time.node_flops) and what bench/gpu_calibration.py's measured rates are per. Here the
flash and efficient kernels' forward and backward are counted at half under ``is_causal``.

Example:
    >>> with counting_flops() as counter:
    ...     loss.backward()
    >>> counter.get_total_flops()
"""

from __future__ import annotations

from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import torch

aten = torch.ops.aten


def _forward(query, key, value, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> int:
    n = sdpa_flop_count(query, key, value)
    return n // 2 if is_causal else n


def _flash_backward(grad, query, key, value, out, lse, cq, ck, mq, mk, dropout_p, is_causal, *a, **kw) -> int:
    n = sdpa_backward_flop_count(grad, query, key, value)
    return n // 2 if is_causal else n


def _efficient_forward(query, key, value, bias, compute_lse, dropout_p=0.0, is_causal=False, *a, **kw) -> int:
    return _forward(query, key, value, dropout_p, is_causal)


def _efficient_backward(grad, query, key, value, bias, out, lse, ps, po, dropout_p, grad_bias, is_causal, *a, **kw):
    n = sdpa_backward_flop_count(grad, query, key, value)
    return n // 2 if is_causal else n


CAUSAL = {
    aten._scaled_dot_product_flash_attention: _forward,
    aten._scaled_dot_product_flash_attention_backward: _flash_backward,
    aten._scaled_dot_product_efficient_attention: _efficient_forward,
    aten._scaled_dot_product_efficient_attention_backward: _efficient_backward,
}


def counting_flops() -> FlopCounterMode:
    """A FlopCounterMode that counts causal attention at half (the module docstring)."""
    return FlopCounterMode(display=False, custom_mapping=CAUSAL)
