"""kdtree's one logger inside SGLang, and "say it once": a serving process must not repeat a line per layer."""

from __future__ import annotations

import logging

logger = logging.getLogger("kdtree")
_said: set[str] = set()


def once(key: str, message: str, level: int = logging.WARNING) -> bool:
    """Log `message` the first time `key` is seen in this process; True when it was logged."""
    if key in _said:
        return False
    _said.add(key)
    logger.log(level, "[kdtree] %s", message)
    return True


def said(key: str) -> bool:
    """Whether `key` was logged in this process (lets a hot path skip building a line it will not log)."""
    return key in _said
