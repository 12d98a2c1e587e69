"""Local SGD on the data-parallel axis: ranks step on their own gradients and average their
parameters every k optimizer steps.

With ``ap.DataParallel("dp", local_sgd_every=k)`` the gradient sync does no collective on
the dp axis: each rank's gradient is that of its own slice's mean loss. The module carries
``autopar_local_sgd``; call its ``step()`` after each optimizer step, or ``attach`` it to
the optimizer once so that every ``optimizer.step()`` counts. Every k-th step the
parameters (those whose gradients would have been summed over dp) are averaged over the dp
group: they live as views of one flat buffer per gradient bucket (made once, as ZeRO's
shards), so an average is one in-place all-reduce and one division per bucket, with nothing
per parameter. Optimizer state stays per rank.

Example:
    >>> module.autopar_local_sgd.attach(opt)      # opt.step() now averages every k steps
    >>> for x in batches: loss = module(x).mean(); loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import torch

from autopar.runtime.backend import current_backend


class LocalSGD:
    def __init__(self, sync, every: int):
        self.sync, self.every, self.steps = sync, every, 0
        self.groups = [[sync.params[n] for n in b.names] for b in sync.buckets if sync.on_dp(b)]
        self.flats = [_flatten(params) for params in self.groups]

    def attach(self, optimizer: torch.optim.Optimizer):
        """Count every ``optimizer.step()``; returns the hook handle (``.remove()`` to detach)."""
        return optimizer.register_step_post_hook(lambda *_: self.step())

    def step(self) -> bool:
        """One optimizer step done; averages the parameters every ``every`` steps (returns True then)."""
        self.steps += 1
        if self.steps % self.every:
            return False
        self.average()
        return True

    @torch.no_grad()
    def average(self) -> None:
        """Average the dp-synced parameters over the dp group now (one collective per bucket)."""
        sync, backend = self.sync, current_backend()
        group = sync.dp_group()
        works = []
        for k, params in enumerate(self.groups):
            if not _lives_in(params, self.flats[k]):  # .data replaced since (module.to, a reload): again
                self.flats[k] = _flatten(params)
            works.append((self.flats[k], backend.all_reduce_async(self.flats[k], group, sync.rank)))
        for flat, work in works:
            result = work.wait()
            if result is not flat:
                flat.copy_(result)
            flat.div_(len(group))


def _flatten(params: list) -> torch.Tensor:
    """One flat buffer holding ``params``' values; each parameter becomes a view of its slot."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    at = 0
    for p in params:
        p.data = flat[at : at + p.numel()].view_as(p)
        at += p.numel()
    return flat


def _lives_in(params: list, flat: torch.Tensor) -> bool:
    base, at = flat.data_ptr(), 0
    for p in params:
        if p.data_ptr() != base + at * flat.element_size() or not p.is_contiguous():
            return False
        at += p.numel()
    return True
