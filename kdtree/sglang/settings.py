"""What the kdtree backend does, from environment variables (read once, when SGLang builds the backend).

| variable | meaning | default |
|---|---|---|
| `KDTREE_MODE` | `serve` (kdtree's output is the layer's), `shadow` (Triton's is served; kdtree runs beside it and the diff is printed), `capture` (Triton's is served and written, with its inputs, as capture files), `triton` (Triton only) | `serve` |
| `KDTREE_LAYERS` | layers that shadow prints and capture writes: `all`, or ids and ranges (`0,30-32,58`) | `all` |
| `KDTREE_RANKS` | TP ranks that print and capture: `all` or ids | `0` |
| `KDTREE_EVERY` | every K-th verify step (0, K, 2K, ...) | `1` |
| `KDTREE_TOLERANCE` | shadow's rel beyond which the worst request/node/head is printed too | `5e-3` |
| `KDTREE_CAPTURE_DIR` | where capture mode writes | `kdtree-captures` |
| `KDTREE_CAPTURE_MAX_FILES` | capture mode stops after this many files | `16` |
| `KDTREE_CAPTURE_MAX_BYTES` | ... or before the files would pass this many bytes (suffixes K, M, G) | `1G` |
| `KDTREE_BODY` | the kernel body the server runs: `default` (the target's first configuration: on Hopper split_keys with few-row tiles) or `blocks64` (Hopper: the blocks64 body, FlashMLA's schedule on 64-key blocks, for long batches: docs/sglang.md, "Which body"; another target keeps its default and says so once) | `default` |

A value that does not parse (or is out of range: ids up to 2^31 - 1, finite numbers) is `SettingsError`, naming the
variable; the backend then says it in one line when the server starts, and Triton serves every step.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

MODES = ("serve", "shadow", "capture", "triton")
BODIES = ("default", "blocks64")


class SettingsError(ValueError):
    """An environment variable kdtree reads has a value it cannot use."""


MAX_ID = 2**31 - 1  # layer and rank ids are int32 in SGLang
MAX_SETTING_CHARS = 4096
MAX_BYTES = 2**50  # KDTREE_CAPTURE_MAX_BYTES: a PiB is past any disk


@dataclass(frozen=True)
class IdRanges:
    """Ids as inclusive ranges (`0,30-32` is ((0, 0), (30, 32))), never expanded: a range of 300 million ids costs
    what one of three does."""

    ranges: tuple[tuple[int, int], ...]

    def __contains__(self, i: int) -> bool:
        return any(lo <= i <= hi for lo, hi in self.ranges)


def _id_set(name: str, raw: str) -> IdRanges | None:
    """`all` -> None (every id); `0,30-32` -> IdRanges(((0, 0), (30, 32)))."""
    raw = raw.strip()
    if raw == "all":
        return None
    if len(raw) > MAX_SETTING_CHARS:
        raise SettingsError(f"{name}: {len(raw):,} characters; at most {MAX_SETTING_CHARS:,}")
    ranges = []
    for part in raw.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        if not (_digits(lo) and (_digits(hi) or not dash)):
            raise SettingsError(f"{name}={raw!r}: expected 'all' or ids and ranges such as 0,30-32") from None
        a, b = int(lo), int(hi) if hi else int(lo)
        if b < a or b > MAX_ID:
            raise SettingsError(f"{name}={raw!r}: {part!r} is not a range of ids from 0 to {MAX_ID}")
        ranges.append((a, b))
    return IdRanges(tuple(ranges))


def _digits(s: str) -> bool:
    return s.isascii() and s.isdigit()


def _number(name: str, raw: str, kind=int, minimum=0, maximum=MAX_ID):
    """A finite number in [minimum, maximum], written in ASCII without underscores; SettingsError naming the
    variable otherwise (inf, nan, 1e400, junk)."""
    if len(raw) > 64 or not raw.strip().isascii() or "_" in raw:
        raise SettingsError(f"{name}={raw[:64]!r}: expected a number in ASCII digits")
    try:
        value = kind(raw)
    except (ValueError, OverflowError):
        raise SettingsError(f"{name}={raw!r}: expected a {'whole ' if kind is int else ''}number") from None
    if not math.isfinite(value) or not minimum <= value <= maximum:
        raise SettingsError(f"{name}={raw!r}: must be a finite number from {minimum} to {maximum:g}")
    return value


def _folder(name: str, raw: str) -> Path:
    if not raw.strip() or "\0" in raw or len(raw) > MAX_SETTING_CHARS:
        raise SettingsError(f"{name}={raw[:80]!r}: expected a folder's path (not empty, no NUL)")
    return Path(raw)


def _bytes(name: str, raw: str) -> int:
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(raw.strip()[-1:].upper(), 1)
    digits = raw.strip()[:-1] if scale > 1 else raw.strip()
    return int(_number(name, digits, float, 1, MAX_BYTES / scale) * scale)


@dataclass(frozen=True)
class Settings:
    mode: str = "serve"
    layers: IdRanges | None = None  # None: all
    ranks: IdRanges | None = IdRanges(((0, 0),))
    every: int = 1
    tolerance: float = 5e-3
    capture_dir: Path = Path("kdtree-captures")
    capture_max_files: int = 16
    capture_max_bytes: int = 2**30
    body: str = "default"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        mode = env.get("KDTREE_MODE", "serve").strip().lower()
        if mode not in MODES:
            raise SettingsError(f"KDTREE_MODE={mode!r}: expected one of {', '.join(MODES)}")
        body = env.get("KDTREE_BODY", "default").strip().lower()
        if body not in BODIES:
            raise SettingsError(f"KDTREE_BODY={body!r}: expected one of {', '.join(BODIES)}")
        return cls(
            mode=mode,
            body=body,
            layers=_id_set("KDTREE_LAYERS", env.get("KDTREE_LAYERS", "all")),
            ranks=_id_set("KDTREE_RANKS", env.get("KDTREE_RANKS", "0")),
            every=_number("KDTREE_EVERY", env.get("KDTREE_EVERY", "1"), int, 1),
            tolerance=_number("KDTREE_TOLERANCE", env.get("KDTREE_TOLERANCE", "5e-3"), float, 0, 1e6),
            capture_dir=_folder("KDTREE_CAPTURE_DIR", env.get("KDTREE_CAPTURE_DIR", "kdtree-captures")),
            capture_max_files=_number("KDTREE_CAPTURE_MAX_FILES", env.get("KDTREE_CAPTURE_MAX_FILES", "16"), int, 1),
            capture_max_bytes=_bytes("KDTREE_CAPTURE_MAX_BYTES", env.get("KDTREE_CAPTURE_MAX_BYTES", "1G")),
        )

    def watches(self, step: int, layer_id: int, rank: int) -> bool:
        """Whether shadow prints / capture writes this step's layer on this rank."""
        return (
            step % self.every == 0
            and (self.layers is None or layer_id in self.layers)
            and (self.ranks is None or rank in self.ranks)
        )
