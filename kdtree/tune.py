"""`kdtree tune`: on the present GPU, time every plan the planner weighs for the bench cases and fuzz batches, fit
the cost model to the timings (`kdtree.kernel.tuning`), and compare the shipped model's picks and the fit's with
the fastest plan of each batch.

Where the fit's pick is more than PICK_MARGIN slower than the fastest plan on a batch, the batch's shape class
(`kdtree.kernel.planner.shape_class`) gets a measured pick: the plan that was fastest over the class's timed
batches, which the planner then takes for any batch of that class. Batches timed apart (`holdout`: more fuzz
seeds) and never fitted or picked on say how far both carry beyond the batches they were made on."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np

from kdtree.kernel.planner import pick_index, plan_label
from kdtree.kernel.tuning import CostModel, Timed, fit, shipped_model

PICK_MARGIN = 0.03  # a class whose fitted picks lose more than this to its fastest plans gets a measured pick
PICKERS = ("shipped", "fit", "tuned")  # the shipped model, the fit alone, the fit with the measured picks


@dataclass
class BatchTimes:
    """One batch: every plan `weighed_plans` weighs, timed, with its cost under the shipped model and the fit."""

    name: str
    labels: list[str]  # a plan's configuration and options
    ms: list[float]
    shipped_cost: list[float]
    timed: list[Timed]  # the fit's view of each plan (its slowest block under the shipped model)
    tuned_cost: list[float] = field(default_factory=list)
    weigh: object = field(default=None, repr=False)  # weigh(model=...) -> [(plan, cost)]: `weighed_plans` on this batch
    shape: str = ""  # `shape_class` of the batch

    def pick(self, costs: list[float], label: str | None = None) -> int:
        """The plan `choose_plan` takes under `costs` and a measured pick `label` (`planner.pick_index`)."""
        return pick_index(self.labels, costs, label)

    def ratio(self, costs: list[float], label: str | None = None) -> float:
        """The picked plan's time over the fastest plan's."""
        return self.ms[self.pick(costs, label)] / min(self.ms)

    def label_ratio(self, label: str) -> float | None:
        return self.ms[self.labels.index(label)] / min(self.ms) if label in self.labels else None


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
    from kdtree.kernel.planner import cost_kind, shape_class, weighed_plans
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
        bt = BatchTimes(
            name, [], [], [], [], weigh=partial(weighed_plans, args, H, first.num_sms, configs, l2_bytes=first.l2_bytes)
        )
        bt.shape = shape_class(args, H)
        for p, cost in bt.weigh(model=None):
            run = bench.CaseLaunch(cap, p.to("cuda"), dev, q, pool, *bench.launch_outputs(cap, p))
            bt.labels.append(plan_label(p))
            bt.ms.append(bench.median_ms(lambda run=run, k=kerns[p.config]: run.launch(k)))
            bt.shipped_cost.append(cost)
            bt.timed.append(Timed(cost_kind(p.config), *slowest_block(p), bt.ms[-1]))
        out.append(bt)
        torch.cuda.empty_cache()
    return out


def timings_json(times: list[BatchTimes]) -> list[dict]:
    """Every timed plan of every batch as `tune.json` keeps it: its label, its body's cost kind, its slowest block's
    padded units and segments (the fit's inputs), its median ms and its cost under the shipped model - enough to
    refit, or try another cost model, on another machine (a report sent back from a GPU not run here)."""
    return [
        {
            "batch": bt.name,
            "shape": bt.shape,
            "plans": [
                {"label": lab, "kind": t.kind, "units": t.units, "segments": t.segments, "ms": ms, "shipped_cost": c}
                for lab, t, ms, c in zip(bt.labels, bt.timed, bt.ms, bt.shipped_cost)
            ],
        }
        for bt in times
    ]


def retime_costs(times: list[BatchTimes], model: CostModel) -> None:
    """Each batch's plans costed again under `model`, on the arguments they were timed on (the plans weighed are
    the model's too, in the same order)."""
    for bt in times:
        weighed = bt.weigh(model=model)
        assert [plan_label(p) for p, _ in weighed] == bt.labels, bt.name
        bt.tuned_cost = [c for _, c in weighed]


def measured_picks(times: list[BatchTimes], margin: float = PICK_MARGIN) -> dict[str, str]:
    """Per shape class whose fitted picks lose more than `margin` to the fastest plan on one of its batches: the
    plan (by label) with the least summed log time over the fastest across the class's batches, among the plans
    every one of them weighs - kept where it beats the fitted picks there."""
    by_class: dict[str, list[BatchTimes]] = {}
    for bt in times:
        by_class.setdefault(bt.shape, []).append(bt)
    picks = {}
    for shape, bts in sorted(by_class.items()):
        fitted = [bt.ratio(bt.tuned_cost) for bt in bts]
        if max(fitted) <= 1 + margin:
            continue
        common = [lab for lab in bts[0].labels if all(lab in bt.labels for bt in bts)]
        if not common:
            continue
        loss = {lab: sum(math.log(bt.label_ratio(lab)) for bt in bts) for lab in common}
        best = min(common, key=lambda lab: loss[lab])  # the first on ties
        if loss[best] < sum(math.log(r) for r in fitted):
            picks[shape] = best
    return picks


def summary(times: list[BatchTimes], picks: dict[str, str] | None = None) -> dict:
    """Per batch the shipped pick's, the fit's and the tuned planner's (the fit with the measured picks) time over
    the fastest plan's; their geomeans and worst."""
    picks = picks or {}
    rows = []
    for bt in times:
        label = picks.get(bt.shape)
        tuned = bool(bt.tuned_cost)
        rows.append(
            {
                "batch": bt.name,
                "shape": bt.shape,
                "fastest": bt.labels[int(np.argmin(bt.ms))],
                "shipped_pick": bt.labels[bt.pick(bt.shipped_cost)],
                "shipped_ratio": bt.ratio(bt.shipped_cost),
                "fit_ratio": bt.ratio(bt.tuned_cost) if tuned else None,
                "tuned_pick": bt.labels[bt.pick(bt.tuned_cost, label)] if tuned else None,
                "tuned_ratio": bt.ratio(bt.tuned_cost, label) if tuned else None,
                "measured_pick": label if tuned and label in bt.labels else None,
            }
        )

    def geo(key):
        vals = [r[key] for r in rows if r[key] is not None]
        return float(np.exp(np.mean(np.log(vals)))) if vals else None

    worst = lambda key: max((r[key] for r in rows if r[key] is not None), default=None)  # noqa: E731
    out = {"rows": rows}
    for name in PICKERS:
        out[name] = {"geomean": geo(f"{name}_ratio"), "worst": worst(f"{name}_ratio")}
    out["within_margin"] = {
        name: sum(r[f"{name}_ratio"] <= 1 + PICK_MARGIN for r in rows if r[f"{name}_ratio"] is not None)
        for name in ("shipped", "tuned")
    }
    return out


def format_summary(s: dict) -> str:
    head = f"{'batch':34s} {'fastest':26s} {'shipped pick':26s} {'x':>6s} {'tuned pick':26s} {'x':>6s}"
    lines = [head]
    for r in s["rows"]:
        tuned = f"{r['tuned_pick'] or '-':26s} {r['tuned_ratio']:6.3f}" if r["tuned_ratio"] else f"{'-':26s} {'-':>6s}"
        mark = " (measured)" if r.get("measured_pick") else ""
        lines.append(
            f"{r['batch'][:34]:34s} {r['fastest'][:26]:26s} {r['shipped_pick'][:26]:26s} {r['shipped_ratio']:6.3f} {tuned}{mark}"
        )
    return "\n".join(lines + format_totals(s))


def format_totals(s: dict) -> list[str]:
    """A summary's last lines: each picker's geomean and worst over the fastest, and how many batches it got within
    PICK_MARGIN of it."""
    n, lines = len(s["rows"]), []
    for k in PICKERS:
        if s.get(k, {}).get("geomean") is not None:
            within = s.get("within_margin", {}).get(k)
            count = f"; within {PICK_MARGIN:.0%} of the fastest on {within} of {n}" if within is not None else ""
            lines.append(f"{k} picks over the fastest: geomean {s[k]['geomean']:.3f}, worst {s[k]['worst']:.3f}{count}")
    return lines


def batches_to_time(cases: list[str], fuzz: int, first_seed: int = 0) -> list[tuple[str, object]]:
    """The bench cases (substrings; none: all twelve; `None`: no case) and fuzz batches of seeds
    first_seed .. first_seed + fuzz - 1."""
    from kdtree import bench
    from kdtree.fuzz import fuzz_spec

    picked = [] if cases is None else bench.select_cases(cases) if cases else list(bench.BENCH_CASES)
    out = [(c.name, c.spec()) for c in picked]
    return out + [(f"fuzz seed {s}", fuzz_spec(s)) for s in range(first_seed, first_seed + fuzz)]


def tune(batches, configs=None, *, repeat: int = 1, holdout=(), say=lambda _: None) -> dict:
    """Time every weighed plan of every batch (`repeat` times), fit the cost model to each pass and take the
    measured picks of the classes the fit misses, and compare the shipped model's picks and the tuned planner's
    with the fastest plans. The last pass's fit and picks are the result; the `holdout` batches, timed once after
    and used for nothing else, say how they carry to batches they were not made on."""
    passes = []
    for i in range(repeat):
        times = time_batches(batches, configs, say=lambda m, i=i: say(f"pass {i + 1}: {m}"))
        f = fit([t for bt in times for t in bt.timed])
        retime_costs(times, f.model)
        passes.append((times, f, measured_picks(times)))
    times, f, picks = passes[-1]
    out = {"fit": {"model": asdict(f.model), "fitted": f.fitted, "rms_rel": f.rms_rel, "intercept_ms": f.intercept_ms,
                   "ms_per_unit": f.ms_per_unit}, "picks": picks, "summary": summary(times, picks)}  # fmt: skip
    if repeat > 1:  # the same picks within noise: each pass's tuned picks against the last's
        last = [bt.labels[bt.pick(bt.tuned_cost, picks.get(bt.shape))] for bt in times]
        out["repeat_same_picks"] = [
            sum(a == b for a, b in zip([bt.labels[bt.pick(bt.tuned_cost, p.get(bt.shape))] for bt in t], last)) / len(last)
            for t, _, p in passes
        ]
        # the last pass's fit and picks on the first pass's timings: the picks' loss to noise alone
        first = passes[0][0]
        retime_costs(first, f.model)
        out["first_pass_under_last_fit"] = summary(first, picks)
    out["timings"] = {"passes": [timings_json(t) for t, _, _ in passes]}
    if holdout:
        held = time_batches(holdout, configs, say=lambda m: say(f"holdout: {m}"))
        retime_costs(held, f.model)
        out["holdout"] = summary(held, picks)
        out["timings"]["holdout"] = timings_json(held)
    out["_model"] = f
    return out
