"""Interpolation between measured points, shared by the device and the CPU throughput models."""

from __future__ import annotations

import bisect
import math


def loglinear(xs: list[float], ys: list[float], x: float) -> float:
    """y at x, interpolated linearly in log(x) between measured points, clamped at the ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    k = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + w * (y1 - y0)


def loglog(xs: list[float], ys: list[float], x: float, short_exponent: float) -> float:
    """y at x, linear in (log x, log y) between points and beyond the last (its segment's slope,
    at least 0); below the first point as x ** ``short_exponent``."""
    if x <= xs[0]:
        return ys[0] * (x / xs[0]) ** short_exponent if x > 0 else 0.0
    if len(xs) == 1:
        return ys[0]
    k = len(xs) - 1 if x >= xs[-1] else bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
    slope = max(0.0, (math.log(y1) - math.log(y0)) / (math.log(x1) - math.log(x0)))
    return math.exp(math.log(y0) + slope * (math.log(x) - math.log(x0)))
