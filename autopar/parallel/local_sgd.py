"""Local SGD on the data-parallel axis: ranks step on their own gradients and average their
parameters every k optimizer steps.

With ``ap.DataParallel("dp", local_sgd_every=k)`` the gradient sync does no collective on
the dp axis: each rank's gradient is that of its own slice's mean loss. The module carries
``autopar_local_sgd``; call its ``step()`` after each optimizer step, or ``attach`` it to
the optimizer once so that every ``optimizer.step()`` counts. Every k-th step the
parameters (those whose gradients would have been summed over dp) are averaged over the dp
group, fused into flat buckets like the gradients. Optimizer state stays per rank.

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
        self.buckets = [b for b in sync.buckets if sync.on_dp(b)]

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
        for b in self.buckets:
            flat = torch.cat([sync.params[n].detach().reshape(-1) for n in b.names])
            works.append((b, backend.all_reduce_async(flat, group, sync.rank)))
        for b, work in works:
            flat = work.wait().div_(len(group))
            offset = 0
            for n in b.names:
                p = sync.params[n]
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
