"""The arrival streams' draws written out in compiled code (`fleetsim.processes`) are
the standard library's draws, number for number: a seed keeps its run."""

from __future__ import annotations

import random

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_poisson_gaps_are_random_expovariate_draws():
    """`_poisson_times` writes expovariate out (no interpreted call per arrival): the
    same times as drawing with `random.Random.expovariate`, so seeds keep their runs."""
    from fleetsim.processes import _poisson_times

    rng, t, want = random.Random(5), 0.0, []
    while (t := t + rng.expovariate(3.5)) < 20.0:
        want.append(t)
    assert list(_poisson_times(random.Random(5), 3.5, 20.0)) == want
    assert len(want) > 40


def test_length_draws_are_random_gauss_draws():
    """`processes.gauss` writes Random.gauss out (no interpreted call per request): the
    same numbers, the second value it keeps on the generator included, so seeds keep
    their runs and either may follow the other."""
    from fleetsim.processes import gauss

    ours, theirs = random.Random(11), random.Random(11)
    got = [gauss(ours, 5.0, 0.7) for _ in range(7)] + [ours.gauss(5.0, 0.7)]
    got += [gauss(ours, -1.0, 2.0) for _ in range(4)]
    want = [theirs.gauss(5.0, 0.7) for _ in range(8)] + [theirs.gauss(-1.0, 2.0)
                                                          for _ in range(4)]
    assert got == want and len(set(got)) == len(got)
