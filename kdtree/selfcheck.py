"""The kernel's first-use self-check: on a (GPU, compute capability, driver, kernel source) it has not seen, run the
shipped captures and a few seeded fuzz batches through the kernel against the fp64 oracle, and cache the verdict
under that key in the user's cache directory. A miscompile or a wrong assumption about a part nobody here has run
is then caught on the owner's machine before a server serves from it. A verdict cached under another key is never
used: a new driver, GPU or kernel source checks again.

`KDTREE_SELFCHECK=0` skips it (the backend then serves without one); `KDTREE_CACHE_DIR` moves the cache (default
`$XDG_CACHE_HOME/kdtree` or `~/.cache/kdtree`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kdtree.cache import cache_dir
from kdtree.diff import DEFAULT_TOLERANCE
from kdtree.errors import printable
from kdtree.files import UnreadableFile, parse_json, read_small_text, write_text_atomic

FORMAT = "kdtree-selfcheck/1"
FUZZ_SEEDS = (0, 2, 6, 9, 17, 32, 42, 51)  # every tree kind, 8-128 heads, N 64-1025, extreme logits
MAX_PREFIX = 2048  # a fuzz batch's prefixes are cut to this (the kernel's long-prefix paths: the shipped captures)
MAX_REQUESTS = 4
SKIP_VAR = "KDTREE_SELFCHECK"


class SelfCheckError(Exception):
    """A cached verdict that cannot be read (corrupt, another format): checked again, never trusted."""


@dataclass(frozen=True)
class Key:
    """What a verdict holds for: the GPU by name and compute capability, its driver, the kernel's source, and the
    target whose configurations run (the GPU's own, or $KDTREE_KERNEL_TARGET's)."""

    gpu: str
    capability: str
    driver: str
    source_hash: str
    impl: str = "cuda"
    target: str = ""

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:24]


@dataclass
class Row:
    """One capture or fuzz batch: the worst rel of its layers against the oracle."""

    name: str
    layers: int
    worst_rel: float
    passed: bool
    seconds: float


@dataclass
class Verdict:
    key: Key
    passed: bool
    tolerance: float
    rows: list[Row] = field(default_factory=list)
    seconds: float = 0.0
    checked_at: str = ""

    def to_json(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict) -> "Verdict":
        """A verdict from its JSON, checked field by field as untrusted input: SelfCheckError names what is wrong."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise SelfCheckError(f"not a {FORMAT} file")
        try:
            key = Key(**{f.name: _typed(d["key"], f.name, str) for f in dataclasses.fields(Key)})
            if set(d["key"]) != {f.name for f in dataclasses.fields(Key)}:
                raise ValueError(f"key has the fields {sorted(d['key'])}")
            rows = [_row(r) for r in _typed(d, "rows", list)]
            v = cls(
                key, _typed(d, "passed", bool), _finite(d, "tolerance"), rows, _finite(d, "seconds"), _typed(d, "checked_at", str)
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SelfCheckError(f"a field is missing or malformed ({type(e).__name__}: {e})") from e
        if not v.rows:
            raise SelfCheckError("no batch was checked (rows is empty)")
        if v.tolerance <= 0 or v.passed != all(r.passed for r in v.rows):
            raise SelfCheckError(f"its verdict ({'PASS' if v.passed else 'FAIL'}) is not its rows' (tolerance {v.tolerance})")
        if any(r.passed and not r.worst_rel <= v.tolerance for r in v.rows):
            raise SelfCheckError(f"a row passes with a rel above the tolerance {v.tolerance}")
        return v


def _typed(d, name: str, kind: type):
    """d[name], which must be a `kind` (a bool is no int, an int no bool)."""
    if not isinstance(d, dict):
        raise TypeError(f"expected an object holding {name!r}, got {type(d).__name__}")
    value = d[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{name}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _finite(d, name: str, *, nan_ok: bool = False) -> float:
    value = d[name] if isinstance(d, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    try:
        value = float(value)  # a 400-digit integer: OverflowError
    except OverflowError:
        raise ValueError(f"{name}: past any float") from None
    if not (math.isfinite(value) and value >= 0) and not (nan_ok and math.isnan(value)):
        raise ValueError(f"{name}: {value} is not a finite number >= 0")
    return value


def _row(r) -> Row:
    row = Row(
        _typed(r, "name", str),
        _typed(r, "layers", int),
        _finite(r, "worst_rel", nan_ok=True),
        _typed(r, "passed", bool),
        _finite(r, "seconds"),
    )
    if set(r) != {f.name for f in dataclasses.fields(Row)} or row.layers < 1 or (row.passed and math.isnan(row.worst_rel)):
        raise ValueError(f"row {row.name!r}: fields {sorted(r)}, layers {row.layers}, rel {row.worst_rel}, passed {row.passed}")
    return row


def skipped(env: dict | None = None) -> bool:
    return (env if env is not None else os.environ).get(SKIP_VAR, "1").strip().lower() in ("0", "false", "no", "off")


def verdict_path(key: Key, directory: Path | None = None) -> Path:
    return (directory or cache_dir()) / "selfcheck" / f"{key.digest}.json"


def current_key(impl: str = "cuda") -> Key:
    """This process's GPU (torch's current device), its driver (CUDA's version number) and the kernel's source hash;
    `impl` other than cuda (the torch model on a CPU) keys by the host instead."""
    import platform

    import torch

    from kdtree.kernel import source_hash
    from kdtree.kernel.config import target_arch

    if impl == "cuda":
        dev = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(dev)
        gpu, capability, driver = torch.cuda.get_device_name(dev), f"sm_{major}{minor}", driver_version()
        return Key(gpu, capability, driver, source_hash(), impl, target_arch())
    host = platform.processor() or platform.machine()
    return Key(host, "cpu", f"torch {torch.__version__}", source_hash(), impl, os.environ.get("KDTREE_KERNEL_TARGET", ""))


def driver_version() -> str:
    try:
        import cupy

        v = cupy.cuda.runtime.driverGetVersion()
        return f"CUDA driver {v // 1000}.{v % 1000 // 10}"
    except Exception:  # noqa: BLE001 - the key then names what is known
        import torch

        return f"torch CUDA {torch.version.cuda}"


def load(key: Key, directory: Path | None = None) -> Verdict | None:
    """The verdict cached for exactly `key`, or None where none is. SelfCheckError, naming the file and why, for a
    file there that is not a verdict for this key (corrupt, cut short, another key's, no regular file)."""
    path = verdict_path(key, directory)
    try:
        text = read_small_text(path)
        if text is None:
            return None
        verdict = Verdict.from_json(parse_json(text))
    except UnreadableFile as e:
        raise SelfCheckError(str(e)) from e
    except ValueError as e:  # json's errors
        raise SelfCheckError(f"{path}: not JSON ({e})") from e
    except SelfCheckError as e:
        raise SelfCheckError(f"{path}: {e}") from e
    if verdict.key != key:
        raise SelfCheckError(
            f"{path}: written for another key ({verdict.key.gpu}, {verdict.key.driver}, source {verdict.key.source_hash})"
        )
    return verdict


def save(verdict: Verdict, directory: Path | None = None) -> Path:
    """Write atomically and durably (`kdtree.files`): a reader never sees half a verdict; OSError when it cannot."""
    return write_text_atomic(verdict_path(verdict.key, directory), json.dumps(verdict.to_json(), indent=1))


def fuzz_batches(seeds: tuple[int, ...] = FUZZ_SEEDS):
    """Seeded fuzz specs, cut to at most MAX_REQUESTS requests of at most MAX_PREFIX keys (their tree, N, heads and
    logits kept): the oracle checks each in about a second."""
    from kdtree.fuzz import fuzz_spec

    for seed in seeds:
        s = fuzz_spec(seed)
        prefixes = [min(p, MAX_PREFIX) for p in s.prefix_lens[:MAX_REQUESTS]]
        yield f"fuzz seed {seed}", dataclasses.replace(s, batch_size=len(prefixes), prefix_lens=prefixes).resolved()


def run(
    key: Key,
    captures: list[Path] | None = None,
    seeds: tuple[int, ...] | None = None,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    fault: str | None = None,
    on_row=None,
) -> Verdict:
    """Every capture and fuzz batch through `key.impl` against the fp64 oracle. `fault` injects a marshaling bug
    (what a broken kernel looks like to this check)."""
    from kdtree.capture import load as load_capture
    from kdtree.impls import diff_capture
    from kdtree.synth import synthesize

    t0 = time.perf_counter()
    verdict = Verdict(key, passed=True, tolerance=tolerance)
    device = "cuda" if key.impl == "cuda" else "cpu"
    items = [(p.name, lambda p=p: load_capture(p)) for p in (captures if captures is not None else shipped())]
    batches = fuzz_batches(seeds if seeds is not None else FUZZ_SEEDS)
    items += [(name, lambda s=s: synthesize(s, reference=False)) for name, s in batches]
    if not items:
        raise ValueError("a self-check of no batch checks nothing: give captures or seeds")
    for name, make in items:
        t = time.perf_counter()
        diffs = diff_capture(make(), key.impl, "oracle", fault=fault, tolerance=tolerance, device=device)
        row = Row(name, len(diffs), max(d.rel for d in diffs), all(d.passed for d in diffs), time.perf_counter() - t)
        verdict.rows.append(row)
        verdict.passed &= row.passed
        if on_row is not None:
            on_row(row)
    verdict.seconds = time.perf_counter() - t0
    verdict.checked_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return verdict


def shipped() -> list[Path]:
    """The repository's shipped captures, where kdtree runs from a checkout (an installed wheel has none)."""
    root = Path(__file__).resolve().parent.parent / "data" / "captured_batches"
    return sorted(root.glob("*.safetensors"))


@dataclass
class Outcome:
    """What `ensure` did: the verdict (None: skipped), whether it came from the cache, the file that holds it (None:
    not cached), and one line for each thing worth saying (a cached file ignored and why; a cache not writable)."""

    verdict: Verdict | None
    cached: bool = False
    path: Path | None = None
    notes: list[str] = field(default_factory=list)


def ensure(
    impl: str = "cuda",
    *,
    directory: Path | None = None,
    force: bool = False,
    captures: list[Path] | None = None,
    seeds: tuple[int, ...] | None = None,
    fault: str | None = None,
    on_row=None,
    honour_skip: bool = True,
) -> Outcome:
    """This machine's verdict: cached for this exact key, or checked now and cached (`force`: checked again;
    `fault`: checked with a marshaling bug injected, never cached). A cached file that is not a verdict for this key
    is ignored and checked again; a cache that cannot be written keeps the verdict uncached. Either is one line of
    `notes`. Skipped (verdict None) where KDTREE_SELFCHECK=0 and `honour_skip` (the backend's check, not the
    command's)."""
    if honour_skip and skipped():
        return Outcome(None)
    key = current_key(impl)
    path, notes = verdict_path(key, directory), []
    if not force:
        try:
            if (cached := load(key, directory)) is not None:
                return Outcome(cached, True, path)
        except SelfCheckError as e:
            notes.append(f"cached verdict ignored: {e}")
    verdict = run(key, captures, seeds, fault=fault, on_row=on_row)
    if fault is not None:  # an injected fault's verdict says nothing of this machine: never cached
        return Outcome(verdict, False, None, notes)
    try:
        save(verdict, directory)
    except OSError as e:
        notes.append(f"cache not writable: {path.parent}: {e.strerror or e}")
        path = None
    return Outcome(verdict, False, path, notes)


def format_verdict(v: Verdict, cached_at: Path | None = None) -> str:
    k = v.key
    lines = [
        printable(
            f"self-check of {k.impl} on {k.gpu} ({k.capability}, {k.driver}), kernel source {k.source_hash}"
            + (f", target {k.target}" if k.target and k.target != k.capability else "")
        ),
        f"{'batch':34s} {'layers':>6s} {'worst rel':>10s}  verdict",
    ]
    lines += [f"{printable(r.name):34s} {r.layers:6d} {r.worst_rel:10.2e}  {'PASS' if r.passed else 'FAIL'}" for r in v.rows]
    lines.append(
        f"{'PASS' if v.passed else 'FAIL'}: {sum(r.passed for r in v.rows)} of {len(v.rows)} within rel <= {v.tolerance:g} "
        f"({v.seconds:.1f} s, {printable(v.checked_at)})" + (f"; cached in {printable(cached_at)}" if cached_at else "")
    )
    return "\n".join(lines)
