"""Expert parallel, in one folder: technique.py (ap.ExpertParallel), annotation.py
(ap.expert_parallel), blocks.py and lists.py (an experts module as one moe_experts op),
tensor_parallel.py (each expert split over tp), moe_rule.py and dispatch.py (the op's layouts and
its rank program with the all-to-alls), moe_dispatch.py (the run-time steps around them),
grouped_mm_rule.py and local_experts.py (a grouped expert matmul split op by op), find.py (the
experts modules of a model). docs/experts.md."""

from autopar.parallel.experts.annotation import expert_parallel
from autopar.parallel.experts.find import expert_modules
from autopar.parallel.experts.technique import ExpertParallel

__all__ = ["ExpertParallel", "expert_modules", "expert_parallel"]
