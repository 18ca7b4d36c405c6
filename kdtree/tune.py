"""The planner's cost model fitted to the present GPU (`kdtree tune`), and the file that carries the fit.

The planner (`kdtree.kernel.planner.estimated_cost`) prices a plan by its slowest block: padded units x the body's
unit cost, plus a cost per segment. The shipped constants were fitted on one GPU; on another (more SMs, another L2,
another MMA rate) the ratios between bodies can differ, and so can the pick. `fit` takes timed plans - each the
slowest block's padded units and segments, the body's cost kind and the launch's median time - and solves, by
least squares with one intercept shared by all bodies (the launch), for each body's time a unit and a segment;
the unit costs are then relative to the reference body's, as the planner's are. A body with too few distinct
measurements keeps the shipped cost.

A tuning file is per GPU (name and SM count) and kernel source (hash): `load` refuses one that is corrupt, of
another GPU (foreign) or of another kernel source (stale), with a message naming which; the caller then uses the
shipped model.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

FORMAT = "kdtree-tune/1"
REFERENCE_KIND = "wgmma64"  # unit costs are relative to this body's unit, as the planner's are


class TuneError(Exception):
    """A tuning file that cannot be used (corrupt, foreign, stale): the shipped model is used instead."""


@dataclass(frozen=True)
class CostModel:
    """Per cost kind (`kdtree.kernel.planner.cost_kind`): a unit's cost and a segment's, in reference units."""

    unit_cost: dict[str, float]
    segment_cost: dict[str, float]

    def check(self) -> None:
        for name, table in (("unit_cost", self.unit_cost), ("segment_cost", self.segment_cost)):
            for kind, v in table.items():
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                    raise TuneError(f"{name}[{kind!r}] = {v!r}: a cost must be a finite number > 0")


def shipped_model() -> CostModel:
    """The planner's constants as a CostModel (segment cost = SEGMENT_COST_PER_ROW x the body's rows x its scale)."""
    from kdtree.kernel import planner

    rows = {"wgmma64": 64, "mma64": 64, "mma32": 32}
    unit = dict(planner.UNIT_COST)
    segment = {k: planner.SEGMENT_COST_PER_ROW * rows.get(k, 64) * planner.SEGMENT_COST_SCALE.get(k, 1.0) for k in unit}
    return CostModel(unit, segment)


@dataclass(frozen=True)
class Timed:
    """One timed plan: its body's cost kind, its slowest block's padded units and segments, its median time."""

    kind: str
    units: float
    segments: float
    ms: float


@dataclass
class Fit:
    model: CostModel
    fitted: list[str]  # the kinds the measurements determined; the others keep the shipped costs
    rms_rel: float  # rms of (predicted - measured) / measured over the measurements
    intercept_ms: float
    ms_per_unit: float  # the reference body's


def fit(timed: list[Timed], base: CostModel | None = None, *, min_points: int = 3) -> Fit:
    """Least squares of ms = intercept + sum over kinds of (units x a_kind + segments x b_kind). A kind needs
    `min_points` measurements whose (units, segments) are not all proportional, or it keeps `base`'s costs; the
    reference kind must be fitted (its unit is the scale)."""
    base = base or shipped_model()
    kinds = sorted({t.kind for t in timed})
    usable = []
    for k in kinds:
        x = np.array([[t.units, t.segments] for t in timed if t.kind == k], dtype=float)
        if len(x) >= min_points and np.linalg.matrix_rank(x) == 2:
            usable.append(k)
    if REFERENCE_KIND not in usable:
        raise TuneError(f"too few distinct measurements of the reference body ({REFERENCE_KIND}) to fit a scale")
    rows = [t for t in timed if t.kind in usable]
    a = np.zeros((len(rows), 2 * len(usable) + 1))
    for i, t in enumerate(rows):
        j = usable.index(t.kind)
        a[i, 2 * j], a[i, 2 * j + 1], a[i, -1] = t.units, t.segments, 1.0
    y = np.array([t.ms for t in rows])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    ref_unit = coef[2 * usable.index(REFERENCE_KIND)]
    if not ref_unit > 0:
        raise TuneError(f"the fit gave the reference body a unit time of {ref_unit:.3g} ms: measurements inconsistent")
    unit, segment = dict(base.unit_cost), dict(base.segment_cost)
    for j, k in enumerate(usable):
        unit[k], segment[k] = coef[2 * j] / ref_unit, coef[2 * j + 1] / ref_unit
    model = CostModel(unit, segment)
    model.check()  # a negative fitted cost means the measurements cannot tell the terms apart
    pred = a @ coef
    return Fit(model, usable, float(np.sqrt(np.mean(((pred - y) / y) ** 2))), float(coef[-1]), float(ref_unit))


@dataclass
class TuningFile:
    gpu: str
    sms: int
    source_hash: str
    model: CostModel
    fitted: list[str] = field(default_factory=list)
    rms_rel: float = 0.0
    made_at: str = ""
    target: str = ""  # the configurations fitted (the GPU's own target, or $KDTREE_KERNEL_TARGET's)

    def to_json(self) -> dict:
        return {"format": FORMAT, **asdict(self)}


def save(t: TuningFile, path: Path) -> Path:
    """Atomically: a temporary file renamed over `path`."""
    t.model.check()
    if not t.made_at:
        import time

        t.made_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(t.to_json(), indent=1))
    os.replace(tmp, path)
    return path


def load(path: Path, *, gpu: str, sms: int, source_hash: str, target: str = "") -> TuningFile:
    """The tuning file at `path` if it was made for this GPU, target and kernel source; TuneError naming why not."""
    try:
        d = json.loads(Path(path).read_text())
    except OSError as e:
        raise TuneError(f"{path}: cannot be read ({e.strerror or e})") from e
    except ValueError as e:
        raise TuneError(f"{path}: corrupt (not JSON: {e})") from e
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise TuneError(f"{path}: corrupt (not a {FORMAT} file)")
    try:
        t = TuningFile(
            gpu=str(d["gpu"]),
            sms=int(d["sms"]),
            source_hash=str(d["source_hash"]),
            model=CostModel(dict(d["model"]["unit_cost"]), dict(d["model"]["segment_cost"])),
            fitted=list(d.get("fitted", [])),
            rms_rel=float(d.get("rms_rel", 0.0)),
            made_at=str(d.get("made_at", "")),
            target=str(d.get("target", "")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise TuneError(f"{path}: corrupt (a field is missing or malformed: {type(e).__name__}: {e})") from e
    if (t.gpu, t.sms, t.target) != (gpu, sms, target):
        raise TuneError(
            f"{path}: foreign (made for {t.gpu} with {t.sms} SMs, target {t.target or '-'}; this is {gpu} with {sms}, "
            f"target {target or '-'})"
        )
    if t.source_hash != source_hash:
        raise TuneError(f"{path}: stale (made for kernel source {t.source_hash}, this is {source_hash}); run kdtree tune")
    try:
        t.model.check()
    except TuneError as e:
        raise TuneError(f"{path}: corrupt ({e})") from e
    return t


def tuning_path(gpu: str, sms: int, target: str = "", directory: Path | None = None) -> Path:
    """Where `kdtree tune` writes, and the planner looks, for this GPU and target: the cache directory's tune/."""
    from kdtree.selfcheck import cache_dir

    slug = "".join(c if c.isalnum() else "-" for c in gpu).strip("-").lower()
    return (directory or cache_dir()) / "tune" / f"{slug}-{sms}sm{'-' + target if target else ''}.json"


# ----- on a GPU: time every plan the planner weighs, fit, compare the picks ---------------------------------------
@dataclass
class BatchTimes:
    """One batch: every plan `weighed_plans` weighs, timed, with its cost under the shipped model and the fit."""

    name: str
    labels: list[str]  # a plan's configuration and options
    ms: list[float]
    shipped_cost: list[float]
    timed: list[Timed]  # the fit's view of each plan (its slowest block under the shipped model)
    tuned_cost: list[float] = field(default_factory=list)

    def pick(self, costs: list[float]) -> int:
        return int(np.argmin(costs))  # the first on ties, as `choose_plan`

    def ratio(self, costs: list[float]) -> float:
        """The picked plan's time over the fastest plan's."""
        return self.ms[self.pick(costs)] / min(self.ms)


def plan_label(p) -> str:
    """A weighed plan by its body and options (row tiles over all keys, cut alike, one row tile a block)."""
    return (
        p.config.body
        + ("" if p.visible_keys else " all-keys")
        + (" aligned" if p.aligned else "")
        + (" tile-a-block" if not p.split and p.grid == p.row_tiles else "")
    )


def slowest_block(p) -> tuple[float, float]:
    """(padded units, segments) of the block the shipped model prices highest: what ends the launch."""
    from kdtree.kernel import planner

    if p.block_padded_work is None:
        return float(p.work) / p.grid, float(p.segments) / p.grid
    kind = planner.cost_kind(p.config)
    shipped = shipped_model()
    cost = p.block_padded_work * shipped.unit_cost.get(kind, 1.0) + p.block_segments * shipped.segment_cost.get(kind, 9.0)
    b = int(np.argmax(cost))
    return float(p.block_padded_work[b]), float(p.block_segments[b])


def time_batches(batches, configs=None, *, say=lambda _: None) -> list[BatchTimes]:
    """Each (name, SynthSpec) synthesized and marshaled; every plan `weighed_plans` weighs for this GPU's candidate
    configurations timed (median, L2 flushed) on the kernel built for its configuration."""
    import torch

    from kdtree import bench
    from kdtree.kernel import KernelConfig, VerifyKernel
    from kdtree.kernel.config import target_arch
    from kdtree.kernel.planner import cost_kind, weighed_plans
    from kdtree.marshal import marshal
    from kdtree.synth import synthesize

    configs = configs or KernelConfig.candidates(target_arch())
    kerns = {c: VerifyKernel.get(c) for c in configs}
    first = kerns[configs[0]]
    out = []
    for name, spec in batches:
        say(f"tune: timing {name}")
        cap = synthesize(spec, reference=False)
        args, H = marshal(cap), cap.meta.num_heads
        dev, lid = args.to("cuda"), cap.meta.layer_ids[0]
        q, pool = cap.layer(lid).q.cuda(), cap.pool(lid, "cuda")
        bt = BatchTimes(name, [], [], [], [])
        for p, cost in weighed_plans(args, H, first.num_sms, configs, l2_bytes=first.l2_bytes):
            run = bench.CaseLaunch(cap, p.to("cuda"), dev, q, pool, *bench.launch_outputs(cap, p))
            bt.labels.append(plan_label(p))
            bt.ms.append(bench.median_ms(lambda run=run, k=kerns[p.config]: run.launch(k)))
            bt.shipped_cost.append(cost)
            bt.timed.append(Timed(cost_kind(p.config), *slowest_block(p), bt.ms[-1]))
        out.append(bt)
        torch.cuda.empty_cache()
    return out


def retime_costs(batches, times: list[BatchTimes], model: CostModel, configs=None) -> None:
    """Each batch's plans costed again under `model` (the plans weighed are the model's too: same order)."""
    from kdtree.kernel import KernelConfig, VerifyKernel
    from kdtree.kernel.config import target_arch
    from kdtree.kernel.planner import weighed_plans
    from kdtree.marshal import marshal
    from kdtree.synth import synthesize

    configs = configs or KernelConfig.candidates(target_arch())
    first = VerifyKernel.get(configs[0])
    for (name, spec), bt in zip(batches, times):
        cap = synthesize(spec, reference=False)
        weighed = weighed_plans(marshal(cap), cap.meta.num_heads, first.num_sms, configs, l2_bytes=first.l2_bytes, model=model)
        assert [plan_label(p) for p, _ in weighed] == bt.labels, name
        bt.tuned_cost = [c for _, c in weighed]


def summary(times: list[BatchTimes]) -> dict:
    """Per batch the shipped pick's and the tuned pick's time over the fastest plan's; their geomeans and worst."""
    rows = [
        {
            "batch": bt.name,
            "fastest": bt.labels[int(np.argmin(bt.ms))],
            "shipped_pick": bt.labels[bt.pick(bt.shipped_cost)],
            "shipped_ratio": bt.ratio(bt.shipped_cost),
            "tuned_pick": bt.labels[bt.pick(bt.tuned_cost)] if bt.tuned_cost else None,
            "tuned_ratio": bt.ratio(bt.tuned_cost) if bt.tuned_cost else None,
        }
        for bt in times
    ]

    def geo(key):
        vals = [r[key] for r in rows if r[key] is not None]
        return float(np.exp(np.mean(np.log(vals)))) if vals else None

    worst = lambda key: max((r[key] for r in rows if r[key] is not None), default=None)  # noqa: E731
    return {"rows": rows, "shipped": {"geomean": geo("shipped_ratio"), "worst": worst("shipped_ratio")},
            "tuned": {"geomean": geo("tuned_ratio"), "worst": worst("tuned_ratio")}}  # fmt: skip


def format_summary(s: dict) -> str:
    head = f"{'batch':34s} {'fastest':26s} {'shipped pick':26s} {'x':>6s} {'tuned pick':26s} {'x':>6s}"
    lines = [head]
    for r in s["rows"]:
        tuned = f"{r['tuned_pick'] or '-':26s} {r['tuned_ratio']:6.3f}" if r["tuned_ratio"] else f"{'-':26s} {'-':>6s}"
        lines.append(
            f"{r['batch'][:34]:34s} {r['fastest'][:26]:26s} {r['shipped_pick'][:26]:26s} {r['shipped_ratio']:6.3f} {tuned}"
        )
    for k in ("shipped", "tuned"):
        if s[k]["geomean"] is not None:
            lines.append(f"{k} picks over the fastest: geomean {s[k]['geomean']:.3f}, worst {s[k]['worst']:.3f}")
    return "\n".join(lines)


def batches_to_time(cases: list[str], fuzz: int) -> list[tuple[str, object]]:
    """The bench cases (substrings; none: all twelve) and fuzz batches of seeds 0 .. fuzz-1."""
    from kdtree import bench
    from kdtree.fuzz import fuzz_spec

    out = [(c.name, c.spec()) for c in bench.select_cases(cases)]
    return out + [(f"fuzz seed {s}", fuzz_spec(s)) for s in range(fuzz)]


def tune(batches, configs=None, *, repeat: int = 1, say=lambda _: None) -> dict:
    """Time every weighed plan of every batch (`repeat` times), fit the cost model to each pass, and compare the
    shipped model's picks and each fit's with the fastest plans. The last pass's fit is the result."""
    passes = []
    for i in range(repeat):
        times = time_batches(batches, configs, say=lambda m, i=i: say(f"pass {i + 1}: {m}"))
        f = fit([t for bt in times for t in bt.timed])
        retime_costs(batches, times, f.model, configs)
        passes.append((times, f))
    times, f = passes[-1]
    out = {"fit": {"model": asdict(f.model), "fitted": f.fitted, "rms_rel": f.rms_rel, "intercept_ms": f.intercept_ms,
                   "ms_per_unit": f.ms_per_unit}, "summary": summary(times)}  # fmt: skip
    if repeat > 1:  # the same picks within noise: each pass's tuned picks against the last's
        last = [bt.labels[bt.pick(bt.tuned_cost)] for bt in times]
        out["repeat_same_picks"] = [
            sum(a == b for a, b in zip([bt.labels[bt.pick(bt.tuned_cost)] for bt in t], last)) / len(last) for t, _ in passes
        ]
    out["_model"] = f
    return out


_active: dict = {}


def active_model(gpu: str, sms: int, target: str = "", env: dict | None = None) -> CostModel | None:
    """The cost model the planner uses on this GPU: the tuning file `kdtree tune` wrote for it (or the one
    $KDTREE_TUNING names), else None (the shipped constants). A file that cannot be used is said once (logger
    `kdtree`) and ignored; KDTREE_TUNING=off ignores any."""
    import logging

    from kdtree.kernel import source_hash
    from kdtree.selfcheck import cache_dir

    env = env if env is not None else os.environ
    named = env.get("KDTREE_TUNING", "").strip()
    if named.lower() in ("off", "0", "none"):
        return None
    path = Path(named) if named else tuning_path(gpu, sms, target, cache_dir(env))
    key = (str(path), gpu, sms, target)
    if key not in _active:
        model = None
        if path.exists() or named:
            try:
                model = load(path, gpu=gpu, sms=sms, source_hash=source_hash(), target=target).model
            except TuneError as e:
                logging.getLogger("kdtree").warning("[kdtree] tuning file not used: %s; the shipped cost model plans", e)
        _active[key] = model
    return _active[key]
