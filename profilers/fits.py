"""Curve fits shared by compute and links: ``time = alpha + work / rate``.

The same affine model serves both halves: a GEMM of ``f`` FLOPs takes ``overhead + f / peak``
(so throughput ``f / t`` saturates at ``peak`` for large calls and has half of it at
``f = overhead * peak``), and a message of ``n`` bytes takes ``alpha + n / beta`` (Hockney's
alpha-beta model, as in Thakur, Rabenseifner & Gropp 2005). Least squares on the raw times, with
alpha clamped at >= 0 (a negative intercept is noise; refit through the origin).
"""

from __future__ import annotations

import math

import numpy as np


def affine_fit(work: list[float], seconds: list[float]) -> dict[str, float]:
    """Fit ``seconds = alpha + work / rate``; returns ``{"alpha_s", "rate", "r2", "n"}``.

    With one distinct work size only the rate through the origin is defined (alpha 0).
    """
    x = np.asarray(work, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if x.size == 0 or not np.all(np.isfinite(x)) or not np.all(np.isfinite(y)):
        return {"alpha_s": 0.0, "rate": 0.0, "r2": 0.0, "n": int(x.size)}
    alpha, slope = 0.0, None
    if np.unique(x).size >= 2:
        A = np.vstack([np.ones_like(x), x]).T
        (alpha, slope), *_ = np.linalg.lstsq(A, y, rcond=None)
    if slope is None or alpha < 0 or slope <= 0:
        alpha = 0.0
        slope = float(np.dot(x, y) / np.dot(x, x)) if np.dot(x, x) > 0 else 0.0
    pred = alpha + slope * x
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    rate = 1.0 / slope if slope > 0 else math.inf
    return {"alpha_s": float(alpha), "rate": float(rate), "r2": r2, "n": int(x.size)}


def predict(fit: dict[str, float], work: float) -> float:
    """Seconds the fit predicts for ``work`` units."""
    rate = fit.get("rate") or math.inf
    return fit.get("alpha_s", 0.0) + (work / rate if rate and math.isfinite(rate) else 0.0)
