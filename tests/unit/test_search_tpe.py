"""MemoTPESampler suggests exactly what Optuna's TPESampler does (same seed, same history)."""

from __future__ import annotations

import math

import optuna

from autotune.search.tpe import MemoTPESampler

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPACE = {
    "a": optuna.distributions.IntDistribution(0, 6),
    "b": optuna.distributions.FloatDistribution(0.0, 1.0),
    "c": optuna.distributions.CategoricalDistribution(["x", "y", "z", None]),
    "d": optuna.distributions.FloatDistribution(1e-3, 10.0, log=True),
    "e": optuna.distributions.CategoricalDistribution([True, False]),
    "f": optuna.distributions.IntDistribution(1, 64, log=True),
}


def _value(p: dict) -> float:
    return (-(p["a"] - 3) ** 2 + math.sin(7 * p["b"]) + {"x": 0.5, "y": 0.0, "z": -0.5, None: 1.0}[p["c"]]
            - abs(math.log10(p["d"])) + (0.3 if p["e"] else 0.0) - abs(math.log2(p["f"]) - 3) / 3)


def _run(sampler: optuna.samplers.BaseSampler) -> list[dict]:
    study = optuna.create_study(direction="maximize", sampler=sampler)
    # a history added as fixed trials, as the search adds its baselines and starts
    rng = optuna.samplers.RandomSampler(seed=5)
    seed_study = optuna.create_study(sampler=rng)
    for _ in range(120):
        t = seed_study.ask(SPACE)
        state = optuna.trial.TrialState.COMPLETE
        study.add_trial(optuna.trial.create_trial(params=t.params, distributions=SPACE, value=_value(t.params),
                                                  state=state))
        seed_study.tell(t, 0.0)
    asked = []
    for i in range(40):
        t = study.ask(SPACE)
        asked.append(dict(t.params))
        if i % 7 == 3:  # failed trials are skipped by TPE, as the search's failed plans are
            study.tell(t, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(t, _value(t.params))
    return asked


def test_it_suggests_what_optunas_tpe_suggests():
    kw = {"seed": 11, "multivariate": True, "n_startup_trials": 16}
    memo = MemoTPESampler(**kw)
    ours, theirs = _run(memo), _run(optuna.samplers.TPESampler(**kw))
    assert ours == theirs
    assert sum(len(rows) for rows in memo._rows.values()) >= 120  # the rows came from its cache
    assert len({tuple(sorted(p.items(), key=str)) for p in ours}) > 20  # it really sampled, not repeated one point


def test_it_still_overrides_a_method_optuna_has():
    """If Optuna renames the method, the cache would silently stop working: fail instead."""
    assert "_get_internal_repr" in vars(optuna.samplers.TPESampler)
    assert MemoTPESampler._get_internal_repr is not optuna.samplers.TPESampler._get_internal_repr
