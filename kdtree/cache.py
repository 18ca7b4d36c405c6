"""Where kdtree keeps what it learns about this machine (self-check verdicts, tuning files): $KDTREE_CACHE_DIR,
else $XDG_CACHE_HOME/kdtree, else ~/.cache/kdtree."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(env: dict | None = None) -> Path:
    env = env if env is not None else os.environ
    if env.get("KDTREE_CACHE_DIR"):
        return Path(env["KDTREE_CACHE_DIR"])
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "kdtree"
