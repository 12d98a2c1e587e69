"""Jobs for tests/test_auto.py's gloo runs (module-level: the pool's workers import them)."""


def calibrate_job():
    import autopar as ap

    prof = ap.calibrate(matmul=64, small=64, large=1 << 16, repeat=3)
    return prof.flops_per_s, prof.intra[0], prof.intra[1]
