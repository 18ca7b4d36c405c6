"""`kdtree tune`: on the present GPU, time every plan the planner weighs for the bench cases and fuzz batches, fit
the cost model to the timings (`kdtree.kernel.tuning`), and compare the shipped model's picks and the fit's with
the fastest plan of each batch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np

from kdtree.kernel.tuning import CostModel, Timed, fit, shipped_model


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
        bt = BatchTimes(
            name, [], [], [], [], weigh=partial(weighed_plans, args, H, first.num_sms, configs, l2_bytes=first.l2_bytes)
        )
        for p, cost in bt.weigh(model=None):
            run = bench.CaseLaunch(cap, p.to("cuda"), dev, q, pool, *bench.launch_outputs(cap, p))
            bt.labels.append(plan_label(p))
            bt.ms.append(bench.median_ms(lambda run=run, k=kerns[p.config]: run.launch(k)))
            bt.shipped_cost.append(cost)
            bt.timed.append(Timed(cost_kind(p.config), *slowest_block(p), bt.ms[-1]))
        out.append(bt)
        torch.cuda.empty_cache()
    return out


def retime_costs(times: list[BatchTimes], model: CostModel) -> None:
    """Each batch's plans costed again under `model`, on the arguments they were timed on (the plans weighed are
    the model's too, in the same order)."""
    for bt in times:
        weighed = bt.weigh(model=model)
        assert [plan_label(p) for p, _ in weighed] == bt.labels, bt.name
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
        retime_costs(times, f.model)
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
