"""`kdtree report`'s assembly on the CPU: the environment and the compile report run for real (NVRTC); the parts
that time a GPU (self-check on the kernel, bench, tune) are stood in for by functions returning what those parts
return, because CI has no GPU - their own code is tested in test_selfcheck.py, test_tune.py and on the GPU."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kdtree import environment, report, selfcheck
from kdtree.cli import app

from conftest import ROOT

pytest.importorskip("cuda.bindings", reason="NVRTC not installed (pip install -e '.[nvrtc]')")


def _selfcheck_stand_in() -> dict:
    v = selfcheck.run(selfcheck.current_key("model"), captures=[], seeds=(51,))  # the torch model, on the CPU
    return {"verdict": v.to_json(), "text": selfcheck.format_verdict(v)}


def _tune_stand_in() -> dict:
    return {"summary": {"rows": [], "shipped": {"geomean": 1.031, "worst": 1.2}, "tuned": {"geomean": 1.004, "worst": 1.02}}}


def _bench_fails() -> dict:
    raise RuntimeError("SGLang's Triton kernel did not import")


def test_a_report_records_every_part_and_a_failed_one_does_not_stop_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_KERNEL_TARGET", "sm_120")  # the compile part's target on a machine without a GPU
    parts = dict(report.PARTS, selfcheck=_selfcheck_stand_in, bench=_bench_fails, tune=_tune_stand_in)
    r = report.run(tmp_path / "rep", parts=parts)
    saved = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert saved["format"] == "kdtree-report/2" and list(saved["parts"]) == list(report.PARTS)
    assert saved["parts"]["environment"]["result"]["torch"] and saved["parts"]["compile"]["result"]["target"] == "sm_120"
    assert saved["parts"]["compile"]["ok"] and any("verify_mla_fwd" in x for x in saved["parts"]["compile"]["result"]["lines"])
    bench = saved["parts"]["bench"]
    assert not bench["ok"] and "did not import" in bench["error"] and "Traceback" in bench["traceback"]
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "FAILED: `RuntimeError: SGLang's Triton kernel did not import`" in md
    assert "self-check of model on" in md and "PASS: 1 of 1" in md and "tuned picks over the fastest plan: geomean 1.004" in md
    assert "target sm_120: fits" in md and not (tmp_path / "rep" / "report.png").exists()
    assert r["parts"]["tune"]["ok"]


def test_the_command_needs_a_gpu():
    r = CliRunner().invoke(app, ["report", "-o", "x"])
    assert r.exit_code == 2 and "needs a CUDA GPU" in r.output


def test_where_the_bench_fails_the_figure_shows_the_tuners_picks_and_the_summary_counts_them(tmp_path):
    tune = json.loads((ROOT / "tests/fixtures/tune-h100.json").read_text())  # `kdtree tune`'s result on an H100
    r = report.run(tmp_path / "rep", parts={"bench": _bench_fails, "tune": lambda: tune})
    assert not r["parts"]["bench"]["ok"] and (tmp_path / "rep" / "report.png").stat().st_size > 10_000
    md = (tmp_path / "rep" / "summary.md").read_text()
    n, within = len(tune["summary"]["rows"]), tune["summary"]["within_margin"]
    assert f"within 3 % on {within['shipped']} of {n} batches" in md and f"within 3 % on {within['tuned']} of {n}" in md
    assert f"measured picks for {len(tune['picks'])} shape class(es)" in md
    empty = report.run(tmp_path / "none", parts={"bench": _bench_fails, "tune": lambda: {"summary": {"rows": []}}})
    assert empty["parts"]["tune"]["ok"] and not (tmp_path / "none" / "report.png").exists()


def test_the_environment_names_the_software_the_gpu_and_what_nccl_is_told(monkeypatch):
    import torch

    for k in environment.NCCL_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    env = environment.describe()
    assert env["torch"] == torch.__version__ and env["cuda"] == torch.version.cuda
    assert env["nccl_env"] == {"NCCL_NVLS_ENABLE": "0"}  # only what is set, as it is set
    assert env["gpus"] == torch.cuda.device_count() and (env["gpu"] is None) == (not torch.cuda.is_available())
    assert environment.version("no-such-distribution-kdtree") is None and environment.version("numpy")
