"""ap.calibrate's fit of alpha and beta from two all-reduce times (the collective part runs on
gloo in tests/simulated/test_auto_planning.py::test_calibrate_gloo)."""

from __future__ import annotations

import pytest

from autopar.search.calibrate import fit_link


def test_two_sizes_give_latency_and_bandwidth():
    alpha, beta = 20e-6, 1e9  # a ring of 4: 2(n-1) rounds, 2(n-1)/n of the bytes
    small, large = 64, 4 << 20
    t = lambda b: 6 * alpha + 1.5 * b / beta  # noqa: E731
    a, b = fit_link(4, small, t(small), large, t(large))
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


def test_noise_that_inverts_the_two_times_gives_a_bandwidth_of_the_link_order():
    """A loaded machine can time the large message no slower than the small one: beta then stays
    within twice what the large message alone gives (the fit once gave 7.9e14 B/s on loopback
    gloo, where the link moves ~1e9)."""
    alone = (1 << 20) / 1.0e-3
    for t_small in (1.2e-3, 1.0e-3, 0.9e-3):  # slower, equal, barely faster than the large one
        a, b = fit_link(2, 64, t_small, 1 << 20, 1.0e-3)
        assert alone <= b <= 2 * alone and a > 0
