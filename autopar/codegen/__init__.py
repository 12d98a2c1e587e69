"""Code generation: one emitted program for every rank, the input guard, and the lowerings of ops that need more than a local call."""
