"""The first-use self-check (kdtree.selfcheck) on the CPU, with the kernel's torch model as the implementation
checked (the CUDA kernel is checked the same way on a GPU): verdicts cached per key and never used for another,
a broken kernel caught, a corrupt cache not trusted, the skip variable, the command."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from kdtree import selfcheck
from kdtree.cli import app

from conftest import SHIPPED

SEEDS = (17, 51)  # a DDTree at 8 heads with extreme logits, a star: ~1 s of oracle on a CPU


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(selfcheck.SKIP_VAR, raising=False)
    return tmp_path / "cache"


def _mixed():
    return [p for p in SHIPPED if "mixed" in p.name]


def test_a_verdict_is_cached_under_its_key_and_reused(cache):
    v, cached = selfcheck.ensure("model", captures=_mixed(), seeds=SEEDS)
    assert v.passed and not cached and [r.name for r in v.rows] == ["mixed-prefix.safetensors", "fuzz seed 17", "fuzz seed 51"]
    assert all(r.worst_rel < 1e-2 for r in v.rows)
    path = selfcheck.verdict_path(v.key)
    assert path.parent.parent == cache and json.loads(path.read_text())["key"] == dataclasses.asdict(v.key)
    again, cached = selfcheck.ensure("model", captures=_mixed(), seeds=SEEDS)
    assert cached and again == v


def test_a_verdict_of_another_key_is_never_used(cache, monkeypatch):
    v, _ = selfcheck.ensure("model", captures=[], seeds=SEEDS[:1])
    for field, value in (
        ("driver", "CUDA driver 99.0"),
        ("source_hash", "0" * 16),
        ("gpu", "another GPU"),
        ("capability", "sm_120"),
    ):
        other = dataclasses.replace(v.key, **{field: value})
        assert other.digest != v.key.digest and selfcheck.load(other) is None, field
        # a file that claims this key's path but holds another key's verdict is not trusted either
        selfcheck.verdict_path(other).write_text(json.dumps(v.to_json()))
        assert selfcheck.load(other) is None, field
    monkeypatch.setattr(selfcheck, "current_key", lambda impl: dataclasses.replace(v.key, driver="CUDA driver 99.0"))
    checked, cached = selfcheck.ensure("model", captures=[], seeds=SEEDS[:1])
    assert not cached and checked.key.driver == "CUDA driver 99.0"


def test_a_broken_kernel_fails_and_its_verdict_is_not_cached(cache):
    v, cached = selfcheck.ensure("model", captures=_mixed(), seeds=SEEDS, fault="prefix-stride", force=True)
    assert not v.passed and not cached and not v.rows[0].passed and v.rows[0].worst_rel > 0.1
    assert not selfcheck.verdict_path(v.key).exists()


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": "kdtree-selfcheck/1", "key": {}}), json.dumps([1, 2])])
def test_a_corrupt_cache_is_checked_again_and_replaced(cache, text):
    key = selfcheck.current_key("model")
    path = selfcheck.verdict_path(key)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert selfcheck.load(key) is None
    v, cached = selfcheck.ensure("model", captures=[], seeds=SEEDS[:1])
    assert not cached and selfcheck.load(key) == v


def test_the_skip_variable_skips_unless_forced(cache, monkeypatch):
    monkeypatch.setenv(selfcheck.SKIP_VAR, "0")
    assert selfcheck.ensure("model", captures=[], seeds=SEEDS[:1]) == (None, False) and not cache.exists()
    v, _ = selfcheck.ensure("model", captures=[], seeds=SEEDS[:1], force=True)
    assert v.passed


def test_the_command_prints_the_table_and_exits_by_the_verdict(cache, monkeypatch):
    monkeypatch.setattr(selfcheck, "FUZZ_SEEDS", SEEDS)
    monkeypatch.setattr(selfcheck, "shipped", _mixed)
    runner = CliRunner()
    r = runner.invoke(app, ["selfcheck", "--impl", "model"])
    assert r.exit_code == 0, r.output
    assert "self-check of model on" in r.output and "PASS: " in r.output and "mixed-prefix.safetensors" in r.output
    r = runner.invoke(app, ["selfcheck", "--impl", "model", "--inject", "prefix-stride"])
    assert r.exit_code == 1 and "FAIL" in r.output
    r = runner.invoke(app, ["selfcheck", "--impl", "model", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["passed"] is True
    r = runner.invoke(app, ["selfcheck", "--impl", "oracle"])
    assert r.exit_code == 2 and "--impl" in r.output
