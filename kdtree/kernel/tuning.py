"""The planner's cost model fitted to the present GPU, and the file that carries the fit (`kdtree tune` measures;
this module fits, saves, loads and picks the model the planner uses).

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

from kdtree.files import UnreadableFile, parse_json, read_small_text, write_text_atomic

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
    from kdtree.kernel.planner import SEGMENT_COST_PER_ROW, SEGMENT_COST_SCALE, UNIT_COST

    rows = {"wgmma64": 64, "mma64": 64, "mma32": 32}
    unit = dict(UNIT_COST)
    segment = {k: SEGMENT_COST_PER_ROW * rows.get(k, 64) * SEGMENT_COST_SCALE.get(k, 1.0) for k in unit}
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
    `min_points` measurements whose (units, segments) are not all proportional, or it keeps `base`'s costs. The
    scale is the reference kind's unit, or where it was not measured, the shipped unit of the first fitted kind by name."""
    base = base or shipped_model()
    kinds = sorted({t.kind for t in timed})
    usable = []
    for k in kinds:
        x = np.array([[t.units, t.segments] for t in timed if t.kind == k], dtype=float)
        if len(x) >= min_points and np.linalg.matrix_rank(x) == 2:
            usable.append(k)
    if not usable:
        raise TuneError(f"no body has {min_points} measurements of distinct shapes: nothing to fit")
    # the scale: the reference body's unit where it was measured; else (sm_120's configurations have no wgmma64) the
    # first fitted body by name keeps its shipped unit, so the unfitted bodies stay comparable to the fitted ones
    anchor = REFERENCE_KIND if REFERENCE_KIND in usable else usable[0]
    rows = [t for t in timed if t.kind in usable]
    a = np.zeros((len(rows), 2 * len(usable) + 1))
    for i, t in enumerate(rows):
        j = usable.index(t.kind)
        a[i, 2 * j], a[i, 2 * j + 1], a[i, -1] = t.units, t.segments, 1.0
    y = np.array([t.ms for t in rows])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    anchor_unit = coef[2 * usable.index(anchor)]
    if not anchor_unit > 0:
        raise TuneError(f"the fit gave {anchor} a unit time of {anchor_unit:.3g} ms: measurements inconsistent")
    ref_unit = anchor_unit / base.unit_cost[anchor]  # ms per reference unit
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
    picks: dict[str, str] = field(default_factory=dict)  # shape class -> the plan measured fastest there (`kdtree.tune`)

    def to_json(self) -> dict:
        return {"format": FORMAT, **asdict(self)}


def save(t: TuningFile, path: Path) -> Path:
    """Atomically and durably (`kdtree.files`); OSError when it cannot."""
    t.model.check()
    if not t.made_at:
        import time

        t.made_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return write_text_atomic(path, json.dumps(t.to_json(), indent=1))


def load(path: Path, *, gpu: str, sms: int, source_hash: str, target: str = "") -> TuningFile:
    """The tuning file at `path` if it was made for this GPU, target and kernel source; TuneError naming why not."""
    try:
        text = read_small_text(path)
        if text is None:
            raise TuneError(f"{path}: no such file")
        d = parse_json(text)
    except UnreadableFile as e:
        raise TuneError(str(e)) from e
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
            picks=dict(d.get("picks", {})),
        )
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in t.picks.items()):
            raise ValueError("picks must map shape classes to plan labels (strings)")
    except (KeyError, TypeError, ValueError, OverflowError) as e:
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
    from kdtree.cache import cache_dir

    slug = "".join(c if c.isalnum() else "-" for c in gpu).strip("-").lower()
    return (directory or cache_dir()) / "tune" / f"{slug}-{sms}sm{'-' + target if target else ''}.json"


_active: dict = {}


def active_tuning(gpu: str, sms: int, target: str = "", env: dict | None = None) -> TuningFile | None:
    """The tuning the planner uses on this GPU: the file `kdtree tune` wrote for it (or the one $KDTREE_TUNING
    names), else None (the shipped constants, no measured picks). A file that cannot be used is said once (logger
    `kdtree`) and ignored; KDTREE_TUNING=off ignores any."""
    import logging

    from kdtree.cache import cache_dir
    from kdtree.kernel.config import source_hash

    env = env if env is not None else os.environ
    named = env.get("KDTREE_TUNING", "").strip()
    if named.lower() in ("off", "0", "none"):
        return None
    path = Path(named) if named else tuning_path(gpu, sms, target, cache_dir(env))
    key = (str(path), gpu, sms, target)
    if key not in _active:
        tuning = None
        if named or path.exists():
            try:
                tuning = load(path, gpu=gpu, sms=sms, source_hash=source_hash(), target=target)
            except (TuneError, OSError) as e:  # OSError: a name the system refuses (too long)
                logging.getLogger("kdtree").warning("[kdtree] tuning file not used: %s; the shipped cost model plans", e)
        _active[key] = tuning
    return _active[key]
