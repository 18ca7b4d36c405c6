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

from conftest import NOT_A_CACHE_FILE, SHIPPED, not_a_cache_file

SEEDS = (17, 51)  # a DDTree at 8 heads with extreme logits, a star: ~1 s of oracle on a CPU


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(selfcheck.SKIP_VAR, raising=False)
    return tmp_path / "cache"


def _mixed():
    return [p for p in SHIPPED if "mixed" in p.name]


def test_a_verdict_is_cached_under_its_key_and_reused(cache):
    o = selfcheck.ensure("model", captures=_mixed(), seeds=SEEDS)
    v = o.verdict
    assert (
        v.passed
        and not o.cached
        and not o.notes
        and [r.name for r in v.rows] == ["mixed-prefix.safetensors", "fuzz seed 17", "fuzz seed 51"]
    )
    assert all(r.worst_rel < 1e-2 for r in v.rows)
    path = selfcheck.verdict_path(v.key)
    assert o.path == path and path.parent.parent == cache and json.loads(path.read_text())["key"] == dataclasses.asdict(v.key)
    again = selfcheck.ensure("model", captures=_mixed(), seeds=SEEDS)
    assert again.cached and again.verdict == v


def test_a_verdict_of_another_key_is_never_used(cache, monkeypatch):
    v = selfcheck.ensure("model", captures=[], seeds=SEEDS[:1]).verdict
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
        with pytest.raises(selfcheck.SelfCheckError, match="written for another key"):
            selfcheck.load(other)
    monkeypatch.setattr(selfcheck, "current_key", lambda impl: dataclasses.replace(v.key, driver="CUDA driver 99.0"))
    checked = selfcheck.ensure("model", captures=[], seeds=SEEDS[:1])
    assert not checked.cached and checked.verdict.key.driver == "CUDA driver 99.0"


def test_a_broken_kernel_fails_and_its_verdict_is_not_cached(cache):
    o = selfcheck.ensure("model", captures=_mixed(), seeds=SEEDS, fault="prefix-stride", force=True)
    v = o.verdict
    assert not v.passed and not o.cached and o.path is None and not v.rows[0].passed and v.rows[0].worst_rel > 0.1
    assert not selfcheck.verdict_path(v.key).exists()


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": "kdtree-selfcheck/1", "key": {}}), json.dumps([1, 2])])
def test_a_corrupt_cache_is_checked_again_and_replaced(cache, text):
    key = selfcheck.current_key("model")
    path = selfcheck.verdict_path(key)
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(selfcheck.SelfCheckError, match=str(path)):
        selfcheck.load(key)
    o = selfcheck.ensure("model", captures=[], seeds=SEEDS[:1])
    assert not o.cached and selfcheck.load(key) == o.verdict
    assert len(o.notes) == 1 and o.notes[0].startswith(f"cached verdict ignored: {path}: ")


def test_the_skip_variable_skips_unless_forced(cache, monkeypatch):
    monkeypatch.setenv(selfcheck.SKIP_VAR, "0")
    assert selfcheck.ensure("model", captures=[], seeds=SEEDS[:1]) == selfcheck.Outcome(None) and not cache.exists()
    assert selfcheck.ensure("model", captures=[], seeds=SEEDS[:1], honour_skip=False).verdict.passed


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


def _valid_json(cache) -> dict:
    return selfcheck.ensure("model", captures=[], seeds=SEEDS[:1]).verdict.to_json()


def _row0(d: dict, **kw) -> dict:
    return {**d, "rows": [{**d["rows"][0], **kw}, *d["rows"][1:]]}


MALFORMED = {
    "failed with no rows": lambda d: {**d, "passed": False, "rows": []},
    "passed with no rows": lambda d: {**d, "rows": []},
    "rel not a number": lambda d: _row0(d, worst_rel="0.001"),
    "rel infinite": lambda d: _row0(d, worst_rel=float("inf")),
    "passes with NaN": lambda d: _row0(d, worst_rel=float("nan")),
    "passes above tolerance": lambda d: _row0(d, worst_rel=0.5),
    "verdict not its rows'": lambda d: {**d, "passed": False},
    "passed a string": lambda d: {**d, "passed": "yes"},
    "layers a bool": lambda d: _row0(d, layers=True),
    "a row a list": lambda d: {**d, "rows": [[1, 2]]},
    "key of ints": lambda d: {**d, "key": {k: 1 for k in d["key"]}},
    "key with an extra field": lambda d: {**d, "key": {**d["key"], "x": "y"}},
    "tolerance negative": lambda d: {**d, "tolerance": -1},
    "seconds NaN": lambda d: {**d, "seconds": float("nan")},
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_verdict_for_this_key_is_named_and_checked_again(cache, name):
    """A file of this key's name whose fields do not hold a verdict (kdtree never wrote it): refused by name, never
    trusted, checked again and replaced - in the backend too (tests/test_sglang_cpu.py)."""
    good = _valid_json(cache)
    key = selfcheck.current_key("model")
    path = selfcheck.verdict_path(key)
    path.write_text(json.dumps(MALFORMED[name](good)))
    with pytest.raises(selfcheck.SelfCheckError, match=str(path)):
        selfcheck.load(key)
    o = selfcheck.ensure("model", captures=[], seeds=SEEDS[:1])
    assert not o.cached and o.verdict.passed and o.notes[0].startswith(f"cached verdict ignored: {path}: ")
    assert selfcheck.load(key) == o.verdict


@pytest.mark.parametrize("kind", NOT_A_CACHE_FILE)
def test_a_special_or_oversized_file_at_the_verdicts_path_never_stalls_the_check(cache, kind):
    """A FIFO is refused without being opened for a blocking read; a directory, a 2 MB file and bytes that are not
    UTF-8 are named and checked past."""
    key = selfcheck.current_key("model")
    path = selfcheck.verdict_path(key)
    path.parent.mkdir(parents=True)
    not_a_cache_file(path, kind)
    with pytest.raises(selfcheck.SelfCheckError, match=str(path)):
        selfcheck.load(key)
    o = selfcheck.ensure("model", captures=[], seeds=SEEDS[:1])
    assert o.verdict.passed and o.notes[0].startswith(f"cached verdict ignored: {path}: ")


def test_an_unwritable_cache_keeps_the_verdict_and_says_so(cache, monkeypatch):
    """The check passes and is said to; the cache that could not take it is named with the reason."""
    cache.write_text("a file where the cache folder should be")
    o = selfcheck.ensure("model", captures=[], seeds=SEEDS[:1])
    assert o.verdict.passed and not o.cached and o.path is None
    assert len(o.notes) == 1 and o.notes[0].startswith(f"cache not writable: {cache / 'selfcheck'}: ")
    assert cache.read_text().startswith("a file")


def test_a_failed_save_leaves_no_temporary_file_and_the_old_verdict(cache, monkeypatch):
    import os

    o = selfcheck.ensure("model", captures=[], seeds=SEEDS[:1])
    before = o.path.read_bytes()

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    again = selfcheck.ensure("model", captures=[], seeds=SEEDS[:1], force=True)
    assert again.notes == [f"cache not writable: {o.path.parent}: No space left on device"]
    assert o.path.read_bytes() == before and sorted(p.name for p in o.path.parent.iterdir()) == [o.path.name]


def test_the_command_survives_every_cache_fault_and_the_skip_variable(cache, monkeypatch):
    """`kdtree selfcheck` with KDTREE_SELFCHECK=0, an unwritable cache or a corrupt entry: the check runs, exit 0, a
    line says what happened - no traceback."""
    monkeypatch.setattr(selfcheck, "FUZZ_SEEDS", SEEDS[:1])
    monkeypatch.setattr(selfcheck, "shipped", list)
    runner = CliRunner()
    monkeypatch.setenv(selfcheck.SKIP_VAR, "0")
    r = runner.invoke(app, ["selfcheck", "--impl", "model"])
    assert r.exit_code == 0 and "checks all the same" in r.output and "PASS: 1 of 1" in r.output, r.output
    monkeypatch.delenv(selfcheck.SKIP_VAR)
    path = selfcheck.verdict_path(selfcheck.current_key("model"))
    path.write_text('{"format": "kdtree-selfcheck/1", "passed": false, "rows": []}')
    r = runner.invoke(app, ["selfcheck", "--impl", "model"])
    assert r.exit_code == 0 and "cached verdict ignored" in r.output and "Traceback" not in r.output, r.output
    path.unlink()
    path.parent.rmdir()
    cache.joinpath("selfcheck").write_text("not a folder")
    r = runner.invoke(app, ["selfcheck", "--impl", "model"])
    assert r.exit_code == 0 and "cache not writable" in r.output and "Traceback" not in r.output, r.output
