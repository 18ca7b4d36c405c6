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
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kdtree.cache import cache_dir
from kdtree.diff import DEFAULT_TOLERANCE

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
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise SelfCheckError(f"not a {FORMAT} file")
        try:
            return cls(
                key=Key(**d["key"]),
                passed=bool(d["passed"]),
                tolerance=float(d["tolerance"]),
                rows=[Row(**r) for r in d["rows"]],
                seconds=float(d["seconds"]),
                checked_at=str(d["checked_at"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SelfCheckError(f"a field is missing or malformed ({type(e).__name__}: {e})") from e


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
    """The verdict cached for exactly `key`, or None (none, unreadable, or written for another key)."""
    path = verdict_path(key, directory)
    try:
        verdict = Verdict.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, SelfCheckError):
        return None
    return verdict if verdict.key == key else None


def save(verdict: Verdict, directory: Path | None = None) -> Path:
    """Write atomically (a temporary file renamed), so a reader never sees half a verdict."""
    path = verdict_path(verdict.key, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(verdict.to_json(), indent=1))
    os.replace(tmp, path)
    return path


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


def ensure(
    impl: str = "cuda",
    *,
    directory: Path | None = None,
    force: bool = False,
    captures: list[Path] | None = None,
    seeds: tuple[int, ...] | None = None,
    fault: str | None = None,
    on_row=None,
) -> tuple[Verdict | None, bool]:
    """(the verdict for this machine, whether it came from the cache): cached for this exact key, or checked now
    and cached (`force`: checked again; `fault`: checked with a marshaling bug injected, not cached). (None, False)
    when skipped (KDTREE_SELFCHECK=0) and not forced."""
    if skipped() and not force:
        return None, False
    key = current_key(impl)
    if not force and (cached := load(key, directory)) is not None:
        return cached, True
    verdict = run(key, captures, seeds, fault=fault, on_row=on_row)
    if fault is None:  # an injected fault's verdict says nothing of this machine: never cached
        save(verdict, directory)
    return verdict, False


def format_verdict(v: Verdict, cached_at: Path | None = None) -> str:
    k = v.key
    lines = [
        f"self-check of {k.impl} on {k.gpu} ({k.capability}, {k.driver}), kernel source {k.source_hash}"
        + (f", target {k.target}" if k.target and k.target != k.capability else ""),
        f"{'batch':34s} {'layers':>6s} {'worst rel':>10s}  verdict",
    ]
    lines += [f"{r.name:34s} {r.layers:6d} {r.worst_rel:10.2e}  {'PASS' if r.passed else 'FAIL'}" for r in v.rows]
    lines.append(
        f"{'PASS' if v.passed else 'FAIL'}: {sum(r.passed for r in v.rows)} of {len(v.rows)} within rel <= {v.tolerance:g} "
        f"({v.seconds:.1f} s, {v.checked_at})" + (f"; cached in {cached_at}" if cached_at else "")
    )
    return "\n".join(lines)
