"""kdtree.kernel.tuning and kdtree.tune on the CPU: the fit recovers a cost model from timings it generated, refuses what cannot be fitted,
and the tuning file is refused when corrupt, foreign or stale (the planner then keeps the shipped model)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kdtree import tune
from kdtree.kernel import tuning
from kdtree.kernel.tuning import CostModel, Timed, TuneError, TuningFile

from conftest import NOT_A_CACHE_FILE, not_a_cache_file

TRUE = CostModel({"wgmma64": 1.0, "mma64": 1.5, "mma32": 0.9}, {"wgmma64": 7.0, "mma64": 8.0, "mma32": 3.0})
US_PER_UNIT, LAUNCH_US = 1.7, 9.0


def timings(model: CostModel, seed: int = 0, noise: float = 0.01, kinds=("wgmma64", "mma64", "mma32")) -> list[Timed]:
    """Plans of 10-400 units on 1-12 segments timed as `model` says (plus a launch and 1 % noise)."""
    rng = np.random.default_rng(seed)
    out = []
    for kind in kinds:
        for _ in range(12):
            units, segments = float(rng.integers(10, 400)), float(rng.integers(1, 12))
            us = LAUNCH_US + US_PER_UNIT * (units * model.unit_cost[kind] + segments * model.segment_cost[kind])
            out.append(Timed(kind, units, segments, us / 1e3 * (1 + noise * rng.standard_normal())))
    return out


def test_the_fit_recovers_the_model_that_made_the_timings():
    f = tuning.fit(timings(TRUE), base=tuning.shipped_model())
    assert sorted(f.fitted) == ["mma32", "mma64", "wgmma64"] and f.rms_rel < 0.03
    for kind in f.fitted:
        assert f.model.unit_cost[kind] == pytest.approx(TRUE.unit_cost[kind], rel=0.05), kind
        assert f.model.segment_cost[kind] == pytest.approx(TRUE.segment_cost[kind], rel=0.25), kind
    assert f.ms_per_unit == pytest.approx(US_PER_UNIT / 1e3, rel=0.05) and f.intercept_ms == pytest.approx(
        LAUNCH_US / 1e3, abs=3e-3
    )
    shipped = tuning.shipped_model()
    unmeasured = set(shipped.unit_cost) - set(f.fitted)
    assert unmeasured and all(f.model.unit_cost[k] == shipped.unit_cost[k] for k in unmeasured)


def test_fitting_twice_on_fresh_timings_gives_the_same_model_within_noise():
    a, b = tuning.fit(timings(TRUE, seed=1)), tuning.fit(timings(TRUE, seed=2))
    for kind in a.fitted:
        assert a.model.unit_cost[kind] == pytest.approx(b.model.unit_cost[kind], rel=0.05)


def test_a_kind_measured_too_little_keeps_the_shipped_cost_and_a_shape_alone_fits_nothing():
    few = timings(TRUE, kinds=("wgmma64", "mma64")) + [Timed("mma32", 100.0, 2.0, 0.2)]
    f = tuning.fit(few)
    assert "mma32" not in f.fitted and f.model.unit_cost["mma32"] == tuning.shipped_model().unit_cost["mma32"]
    same_shape = [Timed("wgmma64", 100.0 * i, 2.0 * i, 0.1 * i) for i in range(1, 6)]  # proportional: rank 1
    with pytest.raises(TuneError, match="nothing to fit"):
        tuning.fit(same_shape)


def test_without_the_reference_body_as_on_sm120_the_first_fitted_body_keeps_its_shipped_unit():
    shipped = tuning.shipped_model()
    f = tuning.fit(timings(TRUE, kinds=("mma64", "mma32")))  # sm_120's configurations: no wgmma64
    assert sorted(f.fitted) == ["mma32", "mma64"]
    assert f.model.unit_cost["mma32"] == pytest.approx(shipped.unit_cost["mma32"])
    ratio = f.model.unit_cost["mma64"] / f.model.unit_cost["mma32"]
    assert ratio == pytest.approx(TRUE.unit_cost["mma64"] / TRUE.unit_cost["mma32"], rel=0.05)
    assert f.model.unit_cost["wgmma64"] == shipped.unit_cost["wgmma64"]
    assert f.ms_per_unit == pytest.approx(US_PER_UNIT / 1e3 * TRUE.unit_cost["mma32"] / shipped.unit_cost["mma32"], rel=0.05)


def test_a_tuning_file_round_trips_and_is_refused_when_corrupt_foreign_or_stale(tmp_path):
    f = tuning.fit(timings(TRUE))
    path = tuning.tuning_path("NVIDIA RTX PRO 6000 Blackwell", 188, "sm_120", tmp_path)
    assert path.name == "nvidia-rtx-pro-6000-blackwell-188sm-sm_120.json"
    rtx = dict(gpu="NVIDIA RTX PRO 6000 Blackwell", sms=188, target="sm_120")
    tuning.save(TuningFile(rtx["gpu"], 188, "abc123", f.model, f.fitted, f.rms_rel, target="sm_120"), path)
    ok = tuning.load(path, source_hash="abc123", **rtx)
    assert ok.model == f.model and ok.fitted == f.fitted
    with pytest.raises(TuneError, match="foreign .*NVIDIA H200"):
        tuning.load(path, gpu="NVIDIA H200", sms=132, source_hash="abc123", target="sm_120")
    with pytest.raises(TuneError, match="foreign .*target sm_90"):  # another target's configurations on this GPU
        tuning.load(path, source_hash="abc123", **(rtx | {"target": "sm_90"}))
    with pytest.raises(TuneError, match="stale .*run kdtree tune"):
        tuning.load(path, source_hash="def456", **rtx)
    good = json.loads(path.read_text())
    for broken in ("{", json.dumps({"format": "other"}), json.dumps({**good, "sms": "many"}),
                   json.dumps({**good, "model": {"unit_cost": {"wgmma64": -1.0}, "segment_cost": {}}})):  # fmt: skip
        path.write_text(broken)
        with pytest.raises(TuneError, match="corrupt"):
            tuning.load(path, source_hash="abc123", **rtx)
    with pytest.raises(TuneError, match="no such file"):
        tuning.load(tmp_path / "none.json", gpu="x", sms=1, source_hash="y")


def test_saving_a_model_with_an_impossible_cost_is_refused_and_writes_nothing(tmp_path):
    bad = CostModel({"wgmma64": float("nan")}, {"wgmma64": 9.0})
    with pytest.raises(TuneError, match="finite"):
        tuning.save(TuningFile("g", 1, "h", bad), tmp_path / "t.json")
    assert not list(tmp_path.iterdir())


def test_the_shipped_model_is_the_planners_own_costs():
    """`shipped_model()` restates the planner's constants: weighing a batch's plans with it gives the planner's
    costs exactly, and a model that doubles one body's unit cost changes only that body's plans' costs."""
    from kdtree.fuzz import fuzz_spec
    from kdtree.kernel import KernelConfig
    from kdtree.kernel.planner import cost_kind, weighed_plans
    from kdtree.marshal import marshal
    from kdtree.synth import synthesize

    cap = synthesize(fuzz_spec(22), reference=False)
    args, H = marshal(cap), cap.meta.num_heads
    configs = KernelConfig.candidates("sm_90")
    planner_costs = weighed_plans(args, H, 132, configs, l2_bytes=60 << 20)
    shipped = weighed_plans(args, H, 132, configs, l2_bytes=60 << 20, model=tuning.shipped_model())
    assert [c for _, c in shipped] == pytest.approx([c for _, c in planner_costs], rel=1e-12)
    m = tuning.shipped_model()
    doubled = CostModel({**m.unit_cost, "mma32": 2 * m.unit_cost["mma32"]}, m.segment_cost)
    for (p, c), (_, d) in zip(planner_costs, weighed_plans(args, H, 132, configs, l2_bytes=60 << 20, model=doubled)):
        assert (d > c) if cost_kind(p.config) == "mma32" else (d == pytest.approx(c)), p.config


def test_the_planner_loads_this_gpus_tuning_file_and_ignores_a_foreign_one(tmp_path, caplog):
    from kdtree.kernel import source_hash

    f = tuning.fit(timings(TRUE))
    path = tuning.tuning_path("GPU A", 188, "sm_90", tmp_path)
    tuning.save(TuningFile("GPU A", 188, source_hash(), f.model, f.fitted, target="sm_90"), path)
    env = {"KDTREE_CACHE_DIR": str(tmp_path)}
    tuning._active.clear()
    assert tuning.active_tuning("GPU A", 188, "sm_90", env).model == f.model  # found where `kdtree tune` writes it
    assert tuning.active_tuning("GPU A", 188, "sm_90", {"KDTREE_TUNING": "off"}) is None
    with caplog.at_level("WARNING", logger="kdtree"):
        assert tuning.active_tuning("GPU B", 132, "sm_90", {"KDTREE_TUNING": str(path)}) is None  # foreign: said, not used
    assert "foreign" in caplog.text and "shipped cost model" in caplog.text
    assert tuning.active_tuning("GPU A", 188, "sm_120", env) is None  # none for that target: the shipped model, silently


@pytest.mark.parametrize("kind", [*NOT_A_CACHE_FILE, "missing"])
def test_a_tuning_file_that_is_no_file_is_said_and_ignored(tmp_path, caplog, kind):
    """KDTREE_TUNING naming a FIFO (which once hung the planner's reader), a folder, a 2 MB file, bytes that are not
    UTF-8 or nothing: one warning naming the file and why; the shipped cost model plans."""
    path = not_a_cache_file(tmp_path / "tune.json", kind)
    tuning._active.clear()
    with caplog.at_level("WARNING", logger="kdtree"):
        assert tuning.active_tuning("GPU A", 188, "sm_90", {"KDTREE_TUNING": str(path)}) is None
    assert f"tuning file not used: {path}: " in caplog.text and "shipped cost model" in caplog.text


def test_a_batchs_picks_are_read_against_its_fastest_plan():
    bt = tune.BatchTimes("b", ["x", "y", "z"], [1.0, 0.8, 1.2], [1.0, 2.0, 3.0], [], tuned_cost=[3.0, 1.0, 2.0])
    s = tune.summary([bt])
    (row,) = s["rows"]
    assert (row["fastest"], row["shipped_pick"], row["tuned_pick"]) == ("y", "x", "y")
    assert row["shipped_ratio"] == pytest.approx(1.25) and row["tuned_ratio"] == 1.0
    assert "tuned picks over the fastest: geomean 1.000" in tune.format_summary(s)


# ----- measured picks: where the fit's pick loses to the fastest plan of a shape class ---------------------------
def _bt(name, shape, ms, fit_cost, labels=("a", "b", "c")):
    return tune.BatchTimes(name, list(labels), list(ms), list(fit_cost), [], tuned_cost=list(fit_cost), shape=shape)


def test_a_class_the_fit_misses_gets_the_plan_measured_fastest_over_its_batches():
    times = [
        _bt("x1", "X", [1.00, 1.10, 1.30], [1, 2, 3]),  # the fit picks a, the fastest: fine
        _bt("y1", "Y", [1.20, 1.00, 1.02], [1, 2, 3]),  # the fit picks a, 20 % off
        _bt("y2", "Y", [1.10, 1.04, 1.00], [1, 2, 3]),  # here c is fastest; b loses 4 %, c 0 %
        _bt("z1", "Z", [1.05, 1.00, 2.00], [1, 3, 2]),  # 5 % off, but b is the only better plan ...
        _bt("z2", "Z", [1.00, 1.50, 2.00], [1, 3, 2]),  # ... and it loses 50 % on the class's other batch
    ]
    picks = tune.measured_picks(times)
    assert picks == {"Y": "c"}  # c: 2 % + 0 % beats b: 0 % + 4 %; Z's fitted picks are the best it has
    s = tune.summary(times, picks)
    by = {r["batch"]: r for r in s["rows"]}
    assert (by["y1"]["tuned_pick"], by["y1"]["measured_pick"], by["y1"]["fit_ratio"]) == ("c", "c", pytest.approx(1.2))
    assert by["y1"]["tuned_ratio"] == pytest.approx(1.02) and by["x1"]["measured_pick"] is None
    assert s["within_margin"] == {"shipped": 2, "tuned": 4} and s["fit"]["worst"] == pytest.approx(1.2)
    assert "within 3% of the fastest on 4 of 5" in tune.format_summary(s)


def test_a_measured_pick_needs_a_plan_every_batch_of_its_class_weighs():
    times = [_bt("y1", "Y", [2.0, 1.0], [1, 2], labels=("a", "b")), _bt("y2", "Y", [2.0, 1.0], [1, 2], labels=("a", "c"))]
    assert tune.measured_picks(times) == {}  # only a is in both, and it is the fit's own pick


def test_the_planner_takes_a_tuning_files_pick_for_the_batchs_class_and_only_there():
    from kdtree.fuzz import fuzz_spec
    from kdtree.kernel import KernelConfig
    from kdtree.kernel.planner import choose_plan, plan_label, shape_class, weighed_plans
    from kdtree.marshal import marshal
    from kdtree.synth import synthesize

    cap = synthesize(fuzz_spec(22), reference=False)
    args, H = marshal(cap), cap.meta.num_heads
    configs = KernelConfig.candidates("sm_90")
    weighed = weighed_plans(args, H, 132, configs, l2_bytes=60 << 20)
    cheapest = plan_label(min(weighed, key=lambda pc: pc[1])[0])
    other = next(plan_label(p) for p, _ in weighed if plan_label(p) != cheapest)
    shape = shape_class(args, H)
    assert shape.startswith(f"h{H}-n") and f"-b{1 << max(0, args.batch_size - 1).bit_length()}" in shape
    assert plan_label(choose_plan(args, H, 132, configs, l2_bytes=60 << 20)) == cheapest
    assert plan_label(choose_plan(args, H, 132, configs, l2_bytes=60 << 20, picks={shape: other})) == other
    assert plan_label(choose_plan(args, H, 132, configs, l2_bytes=60 << 20, picks={"h1-n1-k1-b1": other})) == cheapest
    assert plan_label(choose_plan(args, H, 132, configs, l2_bytes=60 << 20, picks={shape: "no such plan"})) == cheapest


def test_a_tuning_files_picks_round_trip_and_malformed_ones_are_refused(tmp_path):
    from kdtree.kernel import source_hash

    f = tuning.fit(timings(TRUE))
    path = tmp_path / "t.json"
    tuning.save(TuningFile("GPU A", 188, source_hash(), f.model, f.fitted, picks={"h8-n16-k4096-b1": "blocks64"}), path)
    assert tuning.load(path, gpu="GPU A", sms=188, source_hash=source_hash()).picks == {"h8-n16-k4096-b1": "blocks64"}
    d = json.loads(path.read_text())
    d["picks"] = {"h8-n16-k4096-b1": 3}
    path.write_text(json.dumps(d))
    with pytest.raises(TuneError, match="corrupt.*picks"):
        tuning.load(path, gpu="GPU A", sms=188, source_hash=source_hash())


def test_tune_fits_picks_and_checks_them_on_the_first_pass_and_held_out_batches(monkeypatch):
    """`tune` on timings made up by a stand-in for the GPU (time_batches: the kernel cannot run here): each pass
    fitted and picked, the last pass's fit and picks read against the first pass's timings and held-out batches."""
    calls = []

    def fake_time_batches(batches, configs=None, say=None):
        calls.append([name for name, _ in batches])
        out = []
        for i, (name, _) in enumerate(batches):
            rng = np.random.default_rng(len(calls) * 100 + i)
            tm = timings(TRUE, seed=i, kinds=("wgmma64", "mma64", "mma32"))[:6] + timings(TRUE, seed=i)[12:18]
            labels = [f"p{j}" for j in range(len(tm))]
            ms = [t.ms * (1 + 0.01 * rng.standard_normal()) for t in tm]
            tm = [Timed(t.kind, t.units, t.segments, m) for t, m in zip(tm, ms)]  # as timed: the fit sees these times
            weigh = lambda model, tm=tm: [(_Plan(f"p{j}"), (model or TRUE).unit_cost[t.kind] * t.units) for j, t in enumerate(tm)]  # noqa: E731
            out.append(tune.BatchTimes(name, labels, ms, [c for _, c in weigh(None)], tm, weigh=weigh, shape=f"S{i % 3}"))
        return out

    class _Plan:
        def __init__(self, label):
            self.label = label

    monkeypatch.setattr(tune, "time_batches", fake_time_batches)
    monkeypatch.setattr(tune, "plan_label", lambda p: p.label)
    batches = [(f"b{i}", None) for i in range(6)]
    r = tune.tune(batches, repeat=2, holdout=[("h0", None), ("h1", None)])
    assert calls == [[f"b{i}" for i in range(6)]] * 2 + [["h0", "h1"]]
    assert len(r["repeat_same_picks"]) == 2 and all(0.0 <= x <= 1.0 for x in r["repeat_same_picks"])
    assert [row["batch"] for row in r["holdout"]["rows"]] == ["h0", "h1"]
    assert [row["batch"] for row in r["first_pass_under_last_fit"]["rows"]] == [f"b{i}" for i in range(6)]
    assert set(r["picks"]) <= {"S0", "S1", "S2"} and "wgmma64" in r["fit"]["fitted"]
    # a measured pick is kept only where it beats the fit's picks over its class: never worse in all
    s = r["summary"]
    assert s["tuned"]["geomean"] <= s["fit"]["geomean"] + 1e-12
    assert all(row["measured_pick"] == r["picks"].get(row["shape"]) for row in s["rows"])
    # every timed plan kept, so that the fit can be made again from tune.json alone
    t = json.loads(json.dumps(r["timings"]))
    assert [[b["batch"] for b in p] for p in t["passes"]] == [[f"b{i}" for i in range(6)]] * 2
    assert [b["batch"] for b in t["holdout"]] == ["h0", "h1"]
    last = [Timed(x["kind"], x["units"], x["segments"], x["ms"]) for b in t["passes"][-1] for x in b["plans"]]
    assert tuning.fit(last).model == r["_model"].model


def test_tune_times_all_twelve_bench_cases_unless_told_and_held_out_seeds_follow_the_fitted():
    from kdtree import bench

    assert [n for n, _ in tune.batches_to_time([], 2)] == [c.name for c in bench.BENCH_CASES] + ["fuzz seed 0", "fuzz seed 1"]
    assert len(bench.BENCH_CASES) == 12
    assert [n for n, _ in tune.batches_to_time(None, 2, first_seed=40)] == ["fuzz seed 40", "fuzz seed 41"]
    picked = tune.batches_to_time([bench.BENCH_CASES[0].name], 0)
    assert [n for n, _ in picked] == [bench.BENCH_CASES[0].name]
