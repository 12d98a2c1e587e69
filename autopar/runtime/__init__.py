"""What runs: the collective ops (torch.library), the distributed and simulated backends, failures, consistency checks, comm stats, the gloo pool."""
