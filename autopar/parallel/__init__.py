"""Parallelism techniques beyond layouts: data parallel (buckets, ZeRO, local SGD) and the pipeline."""
