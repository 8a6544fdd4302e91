"""Bulk-written trials read back through Optuna exactly as ``Study.add_trials`` writes them (the
reference), and numbered without gaps or repeats when processes write to one study at once."""

from __future__ import annotations

import multiprocessing as mp

import optuna
import pytest

from autotune.search.bulk import add_trials, encode_attrs, rdb_backend
from autotune.study import storage_for

optuna.logging.set_verbosity(optuna.logging.WARNING)
D = {"x": optuna.distributions.FloatDistribution(0.0, 1.0), "k": optuna.distributions.IntDistribution(0, 9),
     "c": optuna.distributions.CategoricalDistribution(("a", True, None, 2.5))}


def trials(n: int, tag: str = "") -> list[optuna.trial.FrozenTrial]:
    out = []
    for i in range(n):
        fail = i % 7 == 3
        out.append(optuna.trial.create_trial(
            params={"x": i / (n + 1), "k": i % 10, "c": D["c"].choices[i % 4]}, distributions=D,
            value=None if fail else (float("inf") if i == 5 else 1e3 * i + 0.25),
            state=optuna.trial.TrialState.FAIL if fail else optuna.trial.TrialState.COMPLETE,
            user_attrs={"origin": f"{tag}:{i}", "plan": {"degrees": {"dp": i}, "shares": [1, 2]}, "none": None,
                        "text": "ü\n\"q\""},
            constraints=None if fail else {"memory": -0.5 + i / n, "divisibility": 0.0},
            intermediate_values={0: 1.5, 3: -2.0} if i == 2 else None))
    return out


def fields(t: optuna.trial.FrozenTrial) -> tuple:
    return (t.number, t.state, t.values, t.params, t.distributions, t.user_attrs, t.system_attrs,
            t.intermediate_values, t.datetime_start, t.datetime_complete)


def study(url: str, name: str) -> optuna.Study:
    return optuna.create_study(study_name=name, storage=storage_for(url), direction="maximize", load_if_exists=True)


def test_bulk_trials_read_back_as_optunas_own(tmp_path):
    batch = trials(40)
    ref = study(f"sqlite:///{tmp_path}/ref.db", "s")
    ref.add_trials(batch[:15])
    ref.add_trials(batch[15:])
    got = study(f"sqlite:///{tmp_path}/bulk.db", "s")
    other = study(f"sqlite:///{tmp_path}/bulk.db", "other")  # another study's trials in between
    other.add_trials(trials(3))
    rdb = rdb_backend(got)
    add_trials(rdb, got._study_id, batch[:15])
    other.add_trials(trials(2))
    add_trials(rdb, got._study_id, batch[15:], user_json=[encode_attrs(t.user_attrs) for t in batch[15:]])
    assert [t.number for t in batch] == list(range(40))  # as stored: each batch trial knows its number
    a = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/ref.db").get_trials()
    b = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path}/bulk.db").get_trials()
    assert [fields(t) for t in b] == [fields(t) for t in a]
    assert [t._trial_id for t in batch] == [t._trial_id for t in b]
    assert got.best_trial.number == ref.best_trial.number
    assert [t.number for t in other.get_trials()] == list(range(5))
    got.add_trial(trials(1)[0])  # Optuna's own writes continue the numbering
    assert got.get_trials()[-1].number == 40


def test_a_journal_study_has_no_rdb_backend(tmp_path):
    assert rdb_backend(study(str(tmp_path / "j.log"), "s")) is None
    assert rdb_backend(optuna.create_study()) is None


def _write(url: str, tag: str, batches: int) -> None:
    s = optuna.load_study(study_name="race", storage=storage_for(url))
    for b in range(batches):
        add_trials(rdb_backend(s), s._study_id, trials(25, f"{tag}{b}"))
        s.add_trial(trials(1, f"{tag}{b}own")[0])  # Optuna's own path, interleaved


@pytest.mark.slow
def test_processes_writing_at_once_number_every_trial_once(tmp_path):
    url = f"sqlite:///{tmp_path}/race.db"
    study(url, "race")
    procs = [mp.get_context("spawn").Process(target=_write, args=(url, tag, 6)) for tag in "abc"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    got = optuna.load_study(study_name="race", storage=url).get_trials()
    assert sorted(t.number for t in got) == list(range(3 * 6 * 26))
    assert len({t.user_attrs["origin"] for t in got}) == len(got)


def test_encoded_attrs_are_json_dumps_text():
    # encode_attrs uses one shared encoder without the circular-reference check and splices a
    # placement's JSON in (EncodedList): the text must be json.dumps's, compact, key by key
    import json

    from autotune.search.bulk import EncodedList

    placement = EncodedList({"rank": r, "node": r // 4, "device": r % 4} for r in range(8))
    attrs = {"plan": {"degrees": {"dp": 4, "pp": 2}, "placement": placement, "x": [1.5, float("inf"), None]},
             "breakdown": {"stages": [{"stage": 0, "fwd_s": [0.1, 0.2]}], "text": "ü\n\"q\""}, "none": None}
    got = encode_attrs(attrs)
    assert got == {k: json.dumps(v, separators=(",", ":")) for k, v in attrs.items()}
    assert placement.json == json.dumps(list(placement), separators=(",", ":"))


def test_rank_values_encode_as_json_dumps():
    # predicted's per-rank figures (cost.report.RankValues) are written from one text per distinct
    # value: the text must be json.dumps's for every list, including values that compare equal but
    # write differently (0.0 and -0.0, 1 and 1.0 and True), inf and nan, nested in a plan's predicted
    import json

    from autotune.cost.report import RankValues

    lists = [[0.0] * 5, [1.5e12, 1.5e12, 3.0, 1.5e12], [0.0, -0.0, 0.0], [1, 1.0, True], [float("inf"), 2.0, float("nan")],
             [], [85520809984.0] * 3 + [34359738368.0] * 2]
    for values in lists:
        rv = RankValues(values)
        plan = {"degrees": {"dp": 2}, "predicted": {"step_time_s": 1.0, "memory_bytes": rv,
                                                   "capacity_bytes": RankValues(values[::-1])}, "tail": [1]}
        want = json.dumps(plan, separators=(",", ":"))
        assert encode_attrs({"plan": plan})["plan"] == want
        assert rv.encoded(json.JSONEncoder(separators=(",", ":")).encode) == json.dumps(values, separators=(",", ":"))


def test_trial_attrs_of_real_estimates_encode_as_json_dumps():
    # a breakdown's per-rank rows (cost.report.RankRows) are encoded once per template and spliced
    # in: the text of every trial's attrs must stay json.dumps's (uniform and per-stage plans, a
    # plan over memory, 16 ranks of two device types)
    import json
    from pathlib import Path

    from autotune.cost.report import RankRows, RankValues
    from autotune.search import SearchOptions
    from autotune.search.workers import setup
    from autotune.specs import load_cluster, load_model

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "bench"
    _ctx, space, ev = setup(load_model(str(bench / "gpt-neo-2.7b.yaml")),
                            load_cluster(str(bench / "sailor-a100-40x8-v100-16x8.yaml")), 2048, 256,
                            SearchOptions(dtype="fp16"), None)
    points = [p for _, p in space.baselines()[::9]] + [p for p in space.starts() if p["stages"] == "program"]
    seen = 0
    for p in points:
        attrs = ev.evaluate(p).attrs
        rows = (attrs.get("breakdown") or {}).get("ranks")
        if type(rows) is RankRows:
            seen += 1
        assert type(attrs["plan"]["predicted"]["memory_bytes"]) is RankValues
        assert encode_attrs(attrs) == {k: json.dumps(v, separators=(",", ":")) for k, v in attrs.items()}
    assert seen >= 3
