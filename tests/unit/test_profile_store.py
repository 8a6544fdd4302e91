"""The profile store: one transaction per profile, export/import round trip, schema errors that leave
the database as it was, and ``profile:ID`` devices in cluster files."""

import copy
import dataclasses
import json
import statistics

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from autotune.errors import InputError, WorkError
from autotune.specs.cluster import load_cluster
from profilers import store
from profilers.compute import fit_compute, run_compute
from profilers.links import fit_links, pairs


@pytest.fixture(scope="module")
def compute_samples():
    """A real quick compute sweep of this CPU, measured once in-process (no process group needed)."""
    return run_compute("cpu", True, None, lambda what: None)


def _link_samples(world):
    rows = []
    for i, j in pairs(world):
        for size in (8, 1 << 20):
            ow = 5e-5 + size / 1e9
            rows.append({"kind": "p2p", "params": {"src": i, "dst": j, "bytes": size}, "work": size,
                         "timing": {"median_s": 2 * ow, "spread": 0.0, "unstable": False, "samples": [2 * ow]},
                         "metrics": {"one_way_s": ow, "bandwidth_bytes_per_s": size / ow}})
    return rows


def make_result(compute_samples, world=2, emulated=None):
    ranks = []
    for r in range(world):
        ranks.append({"rank": r, "local_rank": r, "host": "node-a", "device": "cpu", "device_name": "Test CPU",
                      "threads": 1, "emulated_slowdown": (emulated or {}).get(r), "emulated_s": 0.0,
                      "compute": copy.deepcopy(compute_samples), "links": _link_samples(world) if r == 0 else []})
    return {"schema_version": 1, "world": world, "device": "cpu", "quick": True, "hosts": ["node-a"] * world,
            "ranks": ranks, "fingerprint": {"hostname": "node-a"}, "versions": {"torch": "x"}, "measure_s": 1.0,
            "emulated": {str(k): v for k, v in (emulated or {}).items()}}


def _counts(url):
    with Session(store.engine_for(url)) as s:
        return tuple(s.scalar(select(func.count()).select_from(t)) for t in
                     (store.ProfileRun, store.ProfileSample, store.ProfileFit))


@pytest.fixture
def url(tmp_path):
    return f"sqlite:///{tmp_path}/p.db"


def test_save_load_keeps_every_sample_and_the_fits(url, compute_samples):
    res = make_result(compute_samples, emulated={1: 2.0})
    pid = store.save_profile(res, url, label="lab", wall_s=3.0)
    doc = store.load_profile(pid, url)
    assert doc["schema_version"] == store.SCHEMA_VERSION and doc["units"]
    assert doc["run"]["label"] == "lab" and doc["run"]["emulated"] == {"1": 2.0}
    n = sum(len(r["compute"]) + len(r["links"]) for r in res["ranks"])
    assert len(doc["samples"]) == n == _counts(url)[1]
    # The stored fits are what fit_compute / fit_links give on the raw samples (the reference).
    assert doc["fits"]["compute"]["0"]["gemm"] == json.loads(json.dumps(fit_compute(compute_samples)["gemm"]))
    assert doc["fits"]["compute"]["1"]["emulated_slowdown"] == 2.0
    assert doc["fits"]["links"]["p2p_bandwidth"] == fit_links(res["ranks"][0]["links"], res["hosts"])["p2p_bandwidth"]
    assert [p["id"] for p in store.list_profiles(url)] == [pid]


def test_export_import_round_trip(url, compute_samples, tmp_path):
    pid = store.save_profile(make_result(compute_samples), url)
    doc = store.load_profile(pid, url)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    other = f"sqlite:///{tmp_path}/other.db"
    new = store.import_file(path, other)
    back = store.load_profile(new, other)
    assert back["samples"] == doc["samples"]
    assert back["fits"] == doc["fits"]
    assert back["fits"]["compute"]["0"]["overheads"]["gemm_call_s"]
    assert store.device_spec_from_profile(str(new), other).profile["overheads"] == \
        store.device_spec_from_profile(str(pid), url).profile["overheads"]
    assert back["run"]["origin"] == "imported" and back["run"]["imported_from"]["id"] == pid
    assert back["run"]["fingerprint"] == doc["run"]["fingerprint"]


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.update(schema_version=99), "schema_version"),
    (lambda d: d.update(kind="optuna-study"), "kind"),
    (lambda d: d.pop("samples"), "samples"),
    (lambda d: d["run"].pop("nproc"), "run.nproc"),
    (lambda d: d["samples"][0].update(rank=7), "samples[0].rank"),
    (lambda d: d["samples"][3].pop("timing"), "samples[3].timing"),
])
def test_wrong_schema_import_is_an_input_error_and_changes_nothing(url, compute_samples, tmp_path, mutate, field):
    pid = store.save_profile(make_result(compute_samples), url)
    doc = store.load_profile(pid, url)
    mutate(doc)
    before = _counts(url)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError) as e:
        store.import_file(path, url)
    assert e.value.field == field and e.value.source == str(path)
    assert _counts(url) == before


def test_import_of_non_json_and_missing_file(url, tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(InputError, match="not a readable JSON"):
        store.import_file(p, url)
    with pytest.raises(InputError, match="no such file"):
        store.import_file(tmp_path / "missing.json", url)
    with pytest.raises(InputError, match="expected a JSON object"):
        store.import_profile([1, 2], url)


def test_failed_write_leaves_nothing_half_written(url, compute_samples):
    store.save_profile(make_result(compute_samples), url)
    before = _counts(url)
    bad = make_result(compute_samples)
    bad["ranks"][1]["compute"][-1]["metrics"]["x"] = object()  # not JSON: the flush fails after other rows
    with pytest.raises(WorkError):
        store.save_profile(bad, url)
    assert _counts(url) == before


def test_device_spec_from_profile_and_cluster_file(url, compute_samples, tmp_path):
    pid = store.save_profile(make_result(compute_samples, emulated={1: 3.0}), url)
    fit = fit_compute(compute_samples)
    dev = store.device_spec_from_profile(str(pid), url)
    assert dev.provenance == "measured" and dev.name == f"profile:{pid}" and dev.kind == "cpu"
    assert dev.achievable_fraction == 1.0
    for dt, g in fit["gemm"].items():
        assert dev.peak_flops[dt] in (pytest.approx(g["peak_flops_per_s"]), pytest.approx(g["best_flops_per_s"]))
    assert dev.memory_bytes == pytest.approx(fit["memory"]["capacity_bytes"] / 2)  # two ranks share the host
    assert dev.intra_node_bandwidth == pytest.approx(1e9) and dev.intra_node_latency == pytest.approx(5e-5)
    assert set(dev.profile) >= {"gemm", "attention", "memory", "links"}
    # the measured per-call costs reach the cost model, which prices with them instead of its defaults
    from autotune.cost.compute import CPU_GEMM_CALL_S, CPU_OP_S, rates_for

    over = dev.profile["overheads"]
    assert over == json.loads(json.dumps(fit["overheads"]))
    assert set(over["gemm_call_s"]) == set(fit["gemm"]) and over["op_s"] >= 0
    # each call cost is the measured excess over the large-GEMM rate, clamped at 0 as
    # profilers.overheads documents: a 0 only where the smallest calls' median excess was <= 0
    # (under load the rate can be read low enough for that), never a measured positive cost lost
    from profilers.overheads import CALL_POINTS

    for dt, got in over["gemm_call_s"].items():
        pts = sorted((s for s in compute_samples if s["kind"] == "gemm_call" and s["params"]["dtype"] == dt),
                     key=lambda s: s["work"])[:CALL_POINTS]
        excess = statistics.median(s["timing"]["median_s"] - s["work"] / fit["gemm"][dt]["best_flops_per_s"]
                                   for s in pts)
        assert pts and got >= 0
        assert got == pytest.approx(excess) if excess > 0 else got == 0.0
    assert dev.profile["attention_trial"] == json.loads(json.dumps(fit["attention_trial"]))
    for dt in over["gemm_call_s"]:
        r = rates_for(dev, dt, 32)
        assert r.gemm_call_s == pytest.approx(over["gemm_call_s"][dt]) and r.op_s == pytest.approx(over["op_s"])
        plain = dataclasses.replace(dev, profile={k: v for k, v in dev.profile.items() if k != "overheads"})
        d = rates_for(plain, dt, 32)
        assert d.gemm_call_s == CPU_GEMM_CALL_S[dt] and d.op_s == CPU_OP_S
        assert r.gemm_time(1e6) - d.gemm_time(1e6) == pytest.approx(over["gemm_call_s"][dt] - CPU_GEMM_CALL_S[dt])
    assert dev.profile["links"]["p2p_bandwidth"][0][1] > 0
    emu = store.device_spec_from_profile(f"{pid}:1", url)
    assert "EMULATED 3x" in emu.source and emu.profile["emulated_slowdown"] == 3.0
    cfile = tmp_path / "c.yaml"
    cfile.write_text(f"name: measured\nnodes:\n  - count: 1\n    devices_per_node: 2\n    device: profile:{pid}\n")
    cluster = load_cluster(str(cfile), storage=url)
    assert cluster.devices[0].spec.provenance == "measured" and cluster.devices[0].spec.profile["id"] == pid
    cfile.write_text("nodes:\n  - {count: 1, devices_per_node: 2, device: 'profile:99'}\n")
    with pytest.raises(InputError, match="no profile 99"):
        load_cluster(str(cfile), storage=url)


@pytest.mark.parametrize("ref", ["abc", "0", "1:x", "-3", "1:-1"])
def test_bad_profile_refs(ref, url):
    with pytest.raises(InputError, match="bad profile id"):
        store.parse_ref(ref)


def test_bad_storage_url_is_an_input_error():
    with pytest.raises(InputError) as e:
        store.engine_for("results/profiles.txt")  # neither a URL nor a journal file (.log)
    assert e.value.field == "--storage"
    with pytest.raises(InputError):
        store.engine_for("nosuchdialect://x")


def test_dtype_support_follows_onednn_and_says_why(monkeypatch):
    import torch

    from profilers.compute import dtype_support

    ok, why = dtype_support("cpu", ("fp32", "bf16", "fp16"))
    want = ["fp32"] + [dt for dt in ("bf16", "fp16") if getattr(torch.ops.mkldnn, f"_is_mkldnn_{dt}_supported")()]
    assert ok == want and set(why) == {"bf16", "fp16"} - set(want)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
    ok, why = dtype_support("cpu", ("fp32", "fp16"))
    assert ok == ["fp32"] and "no native fp16 matmul" in why["fp16"]


def test_an_unsupported_dtype_is_stored_shown_exported_and_refused(url, compute_samples, tmp_path):
    from profilers.summary import summarize_profile

    reason = "no native fp16 matmul on this CPU (test)"
    samples = [s for s in compute_samples if s["params"].get("dtype") != "fp16"]
    res = make_result(samples)
    for r in res["ranks"]:
        r["unsupported"] = {"fp16": reason}
    pid = store.save_profile(res, url)
    doc = store.load_profile(pid, url)
    assert doc["fits"]["compute"]["0"]["gemm_unsupported"] == {"fp16": reason}
    assert "fp16" not in doc["fits"]["compute"]["0"]["gemm"]
    assert summarize_profile(doc)["compute"]["1"]["gemm_unsupported"] == {"fp16": reason}
    dev = store.device_spec_from_profile(str(pid), url)
    assert dev.profile["gemm_unsupported"] == {"fp16": reason} and "fp16" not in dev.peak_flops
    with pytest.raises(InputError, match="no fp16 support"):
        dev.flops("fp16")  # a plan in fp16 on this device is refused, not costed at a made-up rate
    path = tmp_path / "e.json"
    path.write_text(json.dumps(doc))
    back = store.load_profile(store.import_file(path, url), url)
    assert back["fits"]["compute"]["1"]["gemm_unsupported"] == {"fp16": reason}  # survives export/import


def test_fits_are_computed_from_the_median_of_round_medians(compute_samples):
    """The stored median is the median of the round medians of the raw repeats (recomputed here from
    ``samples`` split by ``per_round``), and every GEMM point of the fit is work / that median."""
    import statistics

    for s in compute_samples:
        t = s["timing"]
        assert sum(t["per_round"]) == len(t["samples"]) and len(t["per_round"]) >= 3
        chunks, at = [], 0
        for n in t["per_round"]:
            chunks.append(t["samples"][at:at + n])
            at += n
        assert t["median_s"] == pytest.approx(statistics.median(statistics.median(c) for c in chunks), rel=1e-12)
    fit = fit_compute(compute_samples)
    for dt, g in fit["gemm"].items():
        pts = sorted((s["work"], s["work"] / s["timing"]["median_s"]) for s in compute_samples
                     if s["kind"] == "gemm" and s["params"]["dtype"] == dt)
        # (shapes with equal FLOPs, e.g. 256x256x1024 and 256x1024x256, may come in either order)
        assert sorted(tuple(p) for p in g["points"]) == [pytest.approx(p, rel=1e-12) for p in pts]


def test_processes_opening_one_fresh_storage_together_all_get_it(tmp_path, monkeypatch):
    """The agents of a profile across hosts open one new storage at the same moment; a table the
    other process created between ``create_all``'s check and its CREATE is not an error (it once
    failed a two-agent profile: 'table autotune_profile_samples already exists')."""
    from sqlalchemy.exc import OperationalError

    from autotune.specs.profiles import Base

    real = Base.metadata.create_all
    calls = []

    def racing(eng, *a, **k):  # the first call loses the race: another process just created a table
        calls.append(1)
        if len(calls) == 1:
            real(eng, *a, **k)
            raise OperationalError("CREATE TABLE autotune_profile_samples", {}, Exception(
                "table autotune_profile_samples already exists"))
        return real(eng, *a, **k)

    monkeypatch.setattr(Base.metadata, "create_all", racing)
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    store.engine_for(url)
    assert len(calls) == 2 and store.list_profiles(url) == []
    # any other storage error still reaches the user as one line
    monkeypatch.setattr(Base.metadata, "create_all", lambda eng, *a, **k: (_ for _ in ()).throw(
        OperationalError("CREATE TABLE x", {}, Exception("disk I/O error"))))
    with pytest.raises(InputError, match="disk I/O error"):
        store.engine_for(f"sqlite:///{tmp_path / 'other.db'}")


def test_a_profile_stores_the_load_it_was_measured_under(monkeypatch, url, compute_samples):
    """run_profile watches the machine's load while the ranks measure and stores it with the profile;
    a device read from the profile carries it (issue 39 item 9; the reading injected)."""
    from autotune import machine_load as L
    from autotune.specs.profiles import device_spec_from_profile
    from profilers import launch, run
    from profilers.options import ProfileOptions

    monkeypatch.setattr(launch, "launch_local", lambda *a, **kw: make_result(compute_samples))
    readings = iter([L.Counters(0.0, 0.0, 0.0, 0.0, 0.5, 2), L.Counters(8.0, 0.0, 10.0, 1.0, 0.5, 2)])
    monkeypatch.setattr(L, "SAMPLER", lambda: next(readings))
    stored = run.run_profile(ProfileOptions(storage=url), run.ProfileRequest(kind="cpu", nproc=2, nnodes=1,
                                                                              node_rank=None), lambda *a: None)
    assert device_spec_from_profile(stored.pid, url).profile["load"]["others_share"] == pytest.approx(0.7)


def test_a_relative_storage_url_names_the_profiles_of_todays_working_directory(tmp_path, monkeypatch):
    """The engine of a relative SQLite URL is the file in the directory current when it is asked
    for: one cached under the URL string once answered a second directory's `tune` with the first
    directory's profiles ("no profile 1 ... the store has no profiles yet")."""
    from autotune.specs.profiles import absolute_sqlite, engine_for

    url = "sqlite:///results/autotune.db"
    engines = []
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        engines.append(engine_for(url))
        assert absolute_sqlite(url) == f"sqlite:///{tmp_path / name / 'results' / 'autotune.db'}"
        assert (tmp_path / name / "results" / "autotune.db").exists()
    assert engines[0] is not engines[1]
    monkeypatch.chdir(tmp_path / "first")
    assert engine_for(url) is engines[0]
