"""How often a chain comes back: the Gamma-Poisson estimate behind the `value` order
(cachemgr.gc.value), shared with that order's miniature (cachemgr.gc.minisim).

Returns are Poisson with a rate drawn from a Gamma prior fitted to all the segments ranked
(empirical Bayes, `prior`); a conversation ends at any return with probability END (it moves
on to a new chain), so a long silence makes it likely over (`worth`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from operator import mul
from typing import NamedTuple

from cachemgr.gil import slices

END = 0.05  # probability that a conversation ends at a return (moves on to a new chain)
SHAPE_MIN, SHAPE_MAX = 0.05, 50.0  # bounds of the fitted prior's shape (few chains: noisy)


def prior(chains: Iterable[tuple[int, int]]) -> tuple[float, float]:
    """The Gamma(shape, rate) prior of a chain's return rate, fitted to all segments' (returns,
    exposure) by the method of moments (empirical Bayes): its mean is the pooled rate, its
    spread what the counts vary by beyond Poisson noise."""
    return fitted(moments(chains))


def moments(chains: Iterable[tuple[int, int]], m: Moments | None = None) -> Moments:
    """`m` (default: none) plus the sums over these (returns, exposure). Summed a slice at a
    time (the sums of 10M segments at once held the GIL for most of a second: cachemgr.gil)."""
    m = m or Moments(0, 0, 0, 0, 0)
    for part in slices(chains):
        returns = [c for c, _ in part]
        exposures = [e for _, e in part]
        m = Moments(
            m.c + sum(returns),
            m.e + sum(exposures),
            m.cc + sum(map(mul, returns, returns)),
            m.ce + sum(map(mul, returns, exposures)),
            m.ee + sum(map(mul, exposures, exposures)),
        )
    return m


class Moments(NamedTuple):
    """Sums over the segments' (returns c, exposure e) that fit the prior (`fitted`)."""

    c: int
    e: int
    cc: int
    ce: int
    ee: int


def fitted(m: Moments) -> tuple[float, float]:
    """`prior` from the sums. In integers, exactly: with mean n/t, the excess variance
    sum((c - mean e)^2 - mean e) is x / t^2 for the x below, so shape = mean^2 ee / excess
    = n^2 ee / x."""
    n, t = m.c, m.e
    if n <= 0 or t <= 0:
        return 1.0, 1.0  # nothing came back yet: every chain looks alike
    x = t * t * m.cc - 2 * n * t * m.ce + n * n * m.ee - n * t * t
    shape = min(max(n * n * m.ee / x, SHAPE_MIN), SHAPE_MAX) if x > 0 else SHAPE_MAX
    return shape, shape * t / n


def worth(fitted: tuple[float, float], returns: int, span: int, silence: int) -> float:
    """A segment's expected hits per page per step from now: the rate of returns that continue
    its chain. Its return rate is Gamma(α + returns, β + span) after `span` steps of use; a
    return ends the chain with probability END; after `silence` steps without one, the chain is
    alive with the odds (no return yet : a return that ended it), and its rate is the mean
    rate given that silence."""
    a, b = fitted[0] + returns, fitted[1] + span
    quiet = math.exp(-a * math.log1p(silence / b))  # P(no return in the silence)
    alive = quiet / (quiet + END * (1.0 - quiet))
    return (1.0 - END) * alive * a / (b + silence)
