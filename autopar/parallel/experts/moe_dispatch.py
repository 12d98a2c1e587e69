"""The local steps of a mixture-of-experts block, as a rank program runs them around its
all-to-alls (dispatch.py emits calls of these).

A MoE experts block maps each token t, routed to experts ``index[t, :]`` with weights
``weights[t, :]``, to ``sum_j weights[t, j] * expert_{index[t, j]}(hidden[t])``. Its rows:

- ``route``: every (token, choice) pair as a row of ``hidden``, sorted by expert (stable), and
  the number of rows of each expert: what a grouped matmul runs on and what a dispatch sends;
- ``dispatch_plan``: given the counts this rank sends to each expert and the counts it receives
  for its own experts (from every rank of the axis), the rows it sends to / receives from each
  rank, the order that groups the received rows by expert, and the grouped matmul's offsets;
- ``expert_rows`` / ``place_rows``: the rows of a block of experts (an expert split without a
  dispatch keeps the rows of its own experts, the others' rows stay zero);
- ``unroute``: the rows back in token order, times the routing weights, summed over the choices.

Every step is differentiable in the rows and the weights (gathers, scatters, narrow, cat).

Example (4 tokens, top-2 of 4 experts):
    >>> rows, order, counts, ids = route(hidden, index, 4)   # rows (8, H), counts e.g. [3, 0, 3, 2]
    >>> out = unroute(chain(rows, counts.cumsum(0), ids, *weights_of_experts), order, weights, hidden.dtype)
"""

from __future__ import annotations

import torch


def route(hidden: torch.Tensor, index: torch.Tensor, experts: int):
    """(rows of hidden sorted by expert, the sort's order over the token x choice pairs,
    rows per expert (int64, length ``experts``), each row's expert)."""
    flat = index.reshape(-1)
    ids, order = torch.sort(flat, stable=True)
    rows = hidden[order // index.shape[-1]]
    counts = torch.bincount(flat, minlength=experts)
    return rows, order, counts, ids


def expert_ids(per_expert: torch.Tensor) -> torch.Tensor:
    """Each row's (local) expert, for rows grouped by expert with ``per_expert`` rows each."""
    return torch.repeat_interleave(torch.arange(per_expert.numel(), device=per_expert.device), per_expert)


def unroute(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The expert outputs ``rows`` (in ``route``'s order) back in token order, each times its
    routing weight, summed over the choices: HF's ``(out * w).view(T, k, H).sum(1)``, the same
    products in the same order."""
    k = weights.shape[-1]
    back = torch.zeros_like(rows).index_copy(0, order, rows)
    out = back.view(-1, k, rows.shape[-1]) * weights.unsqueeze(-1)
    return out.sum(dim=1).to(dtype)


def dispatch_plan(counts: torch.Tensor, received: torch.Tensor, ranks: int):
    """For a dispatch over ``ranks`` ranks, each holding ``len(counts) / ranks`` experts in order:
    (rows sent to each rank, rows received from each rank, the order grouping the received rows
    by expert, the received rows per local expert (int64)).

    ``received[i * El + e]``: rows rank i sends for this rank's local expert e.
    """
    held = counts.numel() // ranks
    send = counts.view(ranks, held).sum(1)
    recv_grid = received.view(ranks, held)
    recv = recv_grid.sum(1)
    local_ids = torch.arange(held, device=counts.device).repeat(ranks)
    ids = torch.repeat_interleave(local_ids, received)
    regroup = torch.sort(ids, stable=True).indices
    return send, recv, regroup, recv_grid.sum(0)


def regroup_rows(rows: torch.Tensor, regroup: torch.Tensor) -> torch.Tensor:
    """The received rows grouped by local expert (each source's rows kept in order)."""
    return rows[regroup]


def ungroup_rows(rows: torch.Tensor, regroup: torch.Tensor) -> torch.Tensor:
    """``regroup_rows`` undone: the rows back in the order they arrived."""
    return torch.zeros_like(rows).index_copy(0, regroup, rows)


def expert_rows(rows: torch.Tensor, counts: torch.Tensor, first: int, held: int):
    """(the rows of experts first..first+held-1, their grouped matmul's offsets (int32), each
    row's expert among them)."""
    mine = counts[first : first + held]
    start = int(counts[:first].sum())
    return rows.narrow(0, start, int(mine.sum())), torch.cumsum(mine, 0, dtype=torch.int32), expert_ids(mine)


def place_rows(mine: torch.Tensor, counts: torch.Tensor, first: int, total: int) -> torch.Tensor:
    """``expert_rows`` undone: the block's rows at their place among ``total`` rows, zeros elsewhere."""
    start = int(counts[:first].sum())
    before = mine.new_zeros((start, *mine.shape[1:]))
    after = mine.new_zeros((total - start - mine.shape[0], *mine.shape[1:]))
    return torch.cat([before, mine, after], dim=0)
