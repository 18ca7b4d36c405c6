"""The server check without a GPU: the tiny checkpoint's config and tokenizer, the log reader, the verdicts,
and process clean-up on every path, against `tests/server_standin.py` (SGLang's server needs a GPU; the real one
runs in tests/test_server_gpu.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kdtree.cli import app
from kdtree.server import check, logscan
from kdtree.server.checkpoint import (
    KV_LORA_RANK,
    QK_ROPE_HEAD_DIM,
    SGLANG_FIELDS,
    CheckpointError,
    TinySpec,
    build_checkpoint,
    config_dict,
)
from kdtree.server.process import ServerError, ServerProcess, free_port, group_alive, port_in_use

STANDIN = Path(__file__).with_name("server_standin.py")
REPO = Path(__file__).resolve().parents[1]


def standin(*flags: str):
    return lambda port: [sys.executable, str(STANDIN), str(port), *flags]


def standin_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


# ----- the tiny checkpoint ---------------------------------------------------------------------------------
def test_config_has_kimi_and_deepseeks_mla_dims_and_what_sglangs_loader_reads():
    cfg = config_dict(TinySpec(heads_per_rank=16, tp=2, layers=3), vocab_size=512)
    assert cfg["num_attention_heads"] == 32  # heads per rank x TP
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (KV_LORA_RANK, QK_ROPE_HEAD_DIM) == (512, 64)
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576  # absorbed q/k
    assert cfg["first_k_dense_replace"] == 3  # every layer dense: no MoE kernels
    assert cfg["max_position_embeddings"] == 4096
    assert all(cfg[k] == v for k, v in SGLANG_FIELDS.items()) and cfg["moe_layer_freq"] == 1


@pytest.mark.parametrize(
    "bad, word", [(dict(heads_per_rank=0), "heads_per_rank"), (dict(hidden_size=100), "hidden_size"), (dict(vocab=100), "vocab")]
)
def test_a_spec_that_cannot_make_a_model_names_its_field(bad, word):
    with pytest.raises(ValueError, match=word):
        TinySpec(**bad).check()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    return build_checkpoint(TinySpec(layers=1, hidden_size=64, context_length=512), tmp_path_factory.mktemp("ckpt") / "tiny")


def test_the_checkpoint_loads_with_transformers_and_keeps_sglangs_fields(tiny):
    from transformers import AutoConfig, AutoTokenizer

    saved = json.loads((tiny / "config.json").read_text())
    assert all(saved[k] == v for k, v in SGLANG_FIELDS.items())
    cfg = AutoConfig.from_pretrained(tiny)
    assert (cfg.model_type, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.num_hidden_layers) == ("deepseek_v3", 8, 512, 1)
    tok = AutoTokenizer.from_pretrained(tiny)
    assert cfg.vocab_size >= len(tok) and cfg.vocab_size % 64 == 0
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text)  # merges learned, byte-level round trip
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>hi\n<|assistant|>"
    weights = {p.name for p in tiny.glob("*.safetensors")}
    assert weights == {"model.safetensors"}


def test_a_checkpoint_of_the_same_spec_is_reused_and_another_is_refused(tiny):
    before = (tiny / "model.safetensors").stat().st_mtime_ns
    assert build_checkpoint(TinySpec(layers=1, hidden_size=64, context_length=512), tiny) == tiny
    assert (tiny / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(CheckpointError, match="not a kdtree tiny checkpoint"):
        build_checkpoint(TinySpec(layers=2, hidden_size=64, context_length=512), tiny)
    assert (tiny / "model.safetensors").stat().st_mtime_ns == before


def test_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import transformers

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", boom)
    with pytest.raises(OSError, match="disk full"):
        build_checkpoint(TinySpec(layers=1, hidden_size=64), tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


# ----- the log --------------------------------------------------------------------------------------------
LOG = textwrap.dedent(
    """\
    [2026-12-06 04:00:00] Capture target verify CUDA graph begin. backend=full, num_tokens_per_req=16
    [2026-12-06 04:00:02] Capture target verify CUDA graph end. bs=[1, 2, 3, 4], elapsed=2.00 s, mem usage=0.1 GB
    [kdtree] attention backend kdtree, mode shadow (KDTREE_MODE), body default (KDTREE_BODY), TP rank 0
    [kdtree] L0 max_abs_diff=3.9062e-03 mean=3.7352e-05 rel=7.7061e-04
    [kdtree] L1 max_abs_diff=4.1e-01 mean=1.0e-02 rel=9.9e-01 nonfinite=3 worst: request=3 node=17 head=5 abs=4.1e-01 (step 12)
    2026-12-06 04:00:03 WARNING kdtree: [kdtree] kdtree failed (ValueError: bad); Triton serves
    [kdtree] capture stopped: 16 files written to caps, the KDTREE_CAPTURE_MAX_FILES budget; serving goes on
    [kdtree] Triton serves: not TARGET_VERIFY (prefill, decode and draft modes are Triton's)
    Traceback (most recent call last):
    """
)


def test_the_log_reader_sorts_kdtrees_lines():
    s = logscan.scan(LOG)
    assert [(x.layer, x.rel, x.nonfinite) for x in s.shadow] == [(0, 7.7061e-04, 0), (1, 9.9e-01, 3)]
    assert s.worst_rel == 9.9e-01 and s.nonfinite == 3
    assert s.graph_batch_sizes == [1, 2, 3, 4]
    assert s.fallbacks == ["kdtree failed (ValueError: bad); Triton serves"]  # refusals of prefill are not fallbacks
    assert len(s.budget_stops) == 1 and "KDTREE_CAPTURE_MAX_FILES" in s.budget_stops[0]
    assert not s.served and s.errors == ["Traceback (most recent call last):"]


# ----- process clean-up -----------------------------------------------------------------------------------
def _server(tmp_path, *flags, port=None):
    port = port or free_port()
    return ServerProcess(standin(*flags)(port), port=port, log_path=tmp_path / "server.log", env=standin_env())


def test_a_ready_server_is_ended_with_its_whole_group_and_frees_its_port(tmp_path):
    with _server(tmp_path) as server:
        server.wait_ready(30)
        assert port_in_use(server.port) and group_alive(server.pgid)
    stopped = server.stopped
    assert (stopped["stopped"], stopped["sigkill"], stopped["group_left"], stopped["port_free"]) == (True, False, False, True)
    assert stopped["exit_code"] is not None and not group_alive(server.pgid)


def test_a_server_that_ignores_sigterm_is_killed(tmp_path):
    with _server(tmp_path, "--ignore-sigterm") as server:
        server.wait_ready(30)
        server.stop(grace=1.0)
    assert server.stopped["sigkill"] is True and not group_alive(server.pgid)


def test_a_server_that_dies_while_starting_is_an_error_with_its_log(tmp_path):
    with pytest.raises(ServerError, match="exited with code 3") as e:
        with _server(tmp_path, "--exit-early", "3") as server:
            server.wait_ready(30)
    assert "told to exit early" in e.value.log_tail
    assert not group_alive(server.pgid)  # its scheduler child is gone too


def test_a_server_never_ready_times_out_and_is_ended(tmp_path):
    with pytest.raises(ServerError, match="not ready after 2 s"):
        with _server(tmp_path, "--never-ready") as server:
            server.wait_ready(2)
    assert not group_alive(server.pgid)


def test_ctrl_c_inside_the_block_ends_the_group(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with _server(tmp_path) as server:
            server.wait_ready(30)
            raise KeyboardInterrupt
    assert not group_alive(server.pgid) and not port_in_use(server.port)


def test_a_port_in_use_is_refused_before_anything_starts(tmp_path):
    with _server(tmp_path) as first:
        first.wait_ready(30)
        second = _server(tmp_path / "b", port=first.port)
        with pytest.raises(ServerError, match="in use"):
            second.start()
        assert second.proc is None


def _caller(tmp_path, flags: tuple, body: str):
    """A process that runs a stand-in server under `sigterm_as_interrupt` (as `kdtree server-check` does),
    writes the server's group id once it answers, then runs `body` (`s` is the server); (process, port, pgid)."""
    port = free_port()
    pgid_file = tmp_path / "pgid"
    code = textwrap.dedent(
        f"""
        import os, sys, time
        from pathlib import Path
        from kdtree.server import client
        from kdtree.server.process import ServerProcess, sigterm_as_interrupt
        with sigterm_as_interrupt(), ServerProcess({standin(*flags)(port)!r}, port={port}, log_path=Path({str(tmp_path / "s.log")!r})) as s:
            s.wait_ready(30)
            Path({str(pgid_file) + ".tmp"!r}).write_text(str(s.pgid))
            os.replace({str(pgid_file) + ".tmp"!r}, {str(pgid_file)!r})
        """
    ) + textwrap.indent(textwrap.dedent(body), "    ")
    caller = subprocess.Popen([sys.executable, "-c", code], env=standin_env())
    deadline = time.monotonic() + 30
    while not pgid_file.exists() and time.monotonic() < deadline and caller.poll() is None:
        time.sleep(0.1)
    return caller, port, int(pgid_file.read_text())


def _reap(caller, pgid):
    if caller.poll() is None:
        caller.kill()
    if group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)


def test_sigterm_to_the_caller_ends_the_server(tmp_path):
    caller, port, pgid = _caller(tmp_path, (), "time.sleep(60)")
    try:
        assert group_alive(pgid)
        caller.send_signal(signal.SIGTERM)
        assert caller.wait(timeout=30) != 0
        assert not group_alive(pgid) and not port_in_use(port)
    finally:
        _reap(caller, pgid)


def test_sigterm_while_requests_are_in_flight_does_not_wait_for_the_queue(tmp_path):
    """Eight 20-second requests, two at a time: SIGTERM two seconds in ends the caller and the server in
    seconds, not after the queue."""
    body = "client.drive(s.url, ['p'] * 8, concurrency=2, max_new_tokens=4, timeout=60)"
    caller, port, pgid = _caller(tmp_path, ("--slow", "20"), body)
    try:
        time.sleep(2)
        t0 = time.monotonic()
        caller.send_signal(signal.SIGTERM)
        caller.wait(timeout=40)
        assert time.monotonic() - t0 < 25 and not group_alive(pgid)
    finally:
        _reap(caller, pgid)


def test_a_second_signal_does_not_cut_the_clean_up_short(tmp_path):
    """The server ignores SIGTERM, so stopping it waits out the grace period; a second SIGTERM to the caller
    meanwhile still ends with the server's group gone (SIGKILL)."""
    caller, port, pgid = _caller(tmp_path, ("--ignore-sigterm",), "time.sleep(60)")
    try:
        caller.send_signal(signal.SIGTERM)
        time.sleep(2)  # inside stop()'s grace period
        caller.send_signal(signal.SIGTERM)
        caller.wait(timeout=60)
        assert not group_alive(pgid)
    finally:
        _reap(caller, pgid)


# ----- a mode's run and verdict against the stand-in -------------------------------------------------------
SETTINGS = check.CheckSettings(requests=3, concurrency=2, max_new_tokens=8, startup_timeout=30)


def _run(mode, tmp_path, monkeypatch, rel="1.2e-03", settings=SETTINGS):
    monkeypatch.setenv("STANDIN_REL", rel)
    monkeypatch.setenv("PYTHONPATH", standin_env()["PYTHONPATH"])
    return check.run_mode(mode, tmp_path / "model", TinySpec(), settings, tmp_path, launcher=standin())


def test_shadow_passes_within_tolerance_and_fails_beyond_it(tmp_path, monkeypatch):
    good = _run("shadow", tmp_path, monkeypatch)
    assert good.passed, good.reasons
    assert (good.answered, good.scan["shadow_lines"], good.scan["worst_rel"]) == (3, 6, 1.2e-03)
    assert good.openai == {"/v1/completions": True, "/v1/chat/completions": True}
    assert good.accept_length == 2.0 and not good.stopped["group_left"]
    bad = _run("shadow", tmp_path, monkeypatch, rel="9.9e-01")
    assert not bad.passed and any("worst shadow rel 0.99" in r for r in bad.reasons)


def test_serve_needs_the_graph_capture_and_kdtrees_own_lines(tmp_path, monkeypatch):
    r = _run("serve", tmp_path, monkeypatch)
    assert r.passed, r.reasons
    assert r.scan["graph_batch_sizes"] == [1, 2, 3, 4] and r.scan["kdtree_served"] and r.scan["kdtree_graph_replayed"]
    triton = _run("triton", tmp_path, monkeypatch)  # the baseline: graphs, no kdtree lines, still a pass
    assert triton.passed and not triton.scan["kdtree_served"]
    r.scan["kdtree_served"] = False
    assert "kdtree served no verify step" in check.verdict(r, SETTINGS)
    assert r.scan["selfcheck"] == "self-check passed on the stand-in GPU (cached)"
    monkeypatch.setenv("STANDIN_SELFCHECK", "failed")
    failed = _run("serve", tmp_path, monkeypatch)  # the backend's self-check failed: a fallback, the mode fails
    assert not failed.passed and any("self-check FAILED" in why for why in failed.reasons), failed.reasons


def test_capture_files_are_validated_diffed_and_must_be_private(tmp_path, monkeypatch):
    r = _run("capture", tmp_path, monkeypatch)
    assert r.passed, r.reasons
    assert len(r.captures) == 3 and all(c["valid"] and c["mode"] == "0o600" for c in r.captures)
    assert all(c["passed_vs_capture"] and c["passed_vs_oracle"] and c["impl"] == "model" for c in r.captures)
    r.captures[0]["mode"] = "0o644"
    assert any("not 0o600" in why for why in check.verdict(r, SETTINGS))


@pytest.mark.parametrize("mode", ["shadow", "capture"])
def test_at_tp_2_every_rank_must_print_and_capture(tmp_path, monkeypatch, mode):
    """Above TP 1 the check asks every rank for its shadow lines (`[kdtree] TP<r> L...`) and its capture files
    (`-tp<r>`), and the server is told `KDTREE_RANKS=all`; a server whose rank 1 says nothing fails."""
    monkeypatch.setenv("PYTHONPATH", standin_env()["PYTHONPATH"])
    monkeypatch.delenv("KDTREE_RANKS", raising=False)
    spec = TinySpec(tp=2)
    r = check.run_mode(mode, tmp_path / "model", spec, SETTINGS, tmp_path, launcher=standin("--tp", "2"))
    assert r.passed, r.reasons
    if mode == "shadow":
        assert r.scan["shadow_ranks"] == [0, 1] and r.scan["shadow_lines"] == 12
    else:
        assert {Path(c["path"]).name.split("-")[-1] for c in r.captures} == {"tp0.safetensors", "tp1.safetensors"}
    one = check.run_mode(mode, tmp_path / "model", spec, SETTINGS, tmp_path, launcher=standin("--tp", "2"),
                         env={"KDTREE_RANKS": "0"})  # fmt: skip
    assert not one.passed and any("from TP rank 1" in why for why in one.reasons), one.reasons
    assert check.server_env(mode, SETTINGS, Path("c"), base={}, tp=2)["KDTREE_RANKS"] == "all"
    assert check.server_env(mode, SETTINGS, Path("c"), base={"KDTREE_RANKS": "1"}, tp=2)["KDTREE_RANKS"] == "1"
    assert "KDTREE_RANKS" not in check.server_env(mode, SETTINGS, Path("c"), base={})


def test_the_log_reader_takes_the_rank_from_the_shadow_line():
    import torch

    from kdtree.sglang.shadow import shadow_diff

    d = shadow_diff(torch.ones(2, 1, 4), torch.ones(2, 1, 4), torch.tensor([0, 2]), layer=3, step=0)
    text = "\n".join([d.line(5e-3, rank=1), "[2026-12-06 09:41:07 TP0] " + d.line(5e-3, rank=0), d.line(5e-3)])
    assert text.splitlines()[0].startswith("[kdtree] TP1 L3 max_abs_diff=")
    assert [(s.rank, s.layer) for s in logscan.scan(text).shadow] == [(1, 3), (0, 3), (0, 3)]
    assert logscan.scan(text).summary()["shadow_ranks"] == [0, 1]


def test_a_server_that_dies_mid_reply_fails_its_mode_without_a_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", standin_env()["PYTHONPATH"])
    s = check.CheckSettings(requests=2, concurrency=1, startup_timeout=30)
    r = check.run_mode("serve", tmp_path, TinySpec(), s, tmp_path, launcher=standin("--die-mid-reply"))
    assert not r.passed and r.answered == 0 and "2 of 2 requests not answered" in r.reasons
    assert all(x["error"] for x in r.replies) and not r.stopped["group_left"]


def test_a_server_that_never_answers_fails_its_mode_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", standin_env()["PYTHONPATH"])
    s = check.CheckSettings(requests=1, startup_timeout=2)
    r = check.run_mode("shadow", tmp_path, TinySpec(), s, tmp_path, launcher=standin("--never-ready"))
    assert not r.passed and r.reasons == ["the server was not ready after 2 s"]
    assert r.stopped["group_left"] is False and r.stopped["port_free"] is True


def test_the_command_line_is_sglangs_with_kdtree_and_ngram():
    s = check.CheckSettings(draft_tokens=64, bfs_breadth=8)
    argv = check.server_argv(Path("m"), 30000, s, TinySpec(tp=2, context_length=40960), "serve")
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--attention-backend"] == "kdtree" and flags["--speculative-algorithm"] == "NGRAM"
    assert (flags["--speculative-num-draft-tokens"], flags["--tp-size"], flags["--context-length"]) == ("64", "2", "40960")
    assert flags["--host"] == "127.0.0.1" and flags["--cuda-graph-max-bs-decode"] == "4"
    assert "--cuda-graph-backend-decode" not in argv  # serve: SGLang's target-verify graphs
    eager = check.server_argv(Path("m"), 1, s, TinySpec(), "shadow")
    assert eager[eager.index("--cuda-graph-backend-decode") + 1] == "disabled"
    serve = check.server_argv(Path("m"), 1, check.CheckSettings(entrypoint="serve"), TinySpec(), "serve")
    assert serve[3] == "serve" and "sglang.cli.main" in serve[2]
    env = check.server_env("capture", s, Path("caps"), base={"PATH": "/bin"})
    assert env["KDTREE_MODE"] == "capture" and env["KDTREE_CAPTURE_DIR"] == "caps" and env["HF_HUB_OFFLINE"] == "1"


def test_the_report_is_written_whole_with_every_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_REL", "1.0e-03")
    monkeypatch.setenv("PYTHONPATH", standin_env()["PYTHONPATH"])
    pytest.importorskip("transformers")
    s = check.CheckSettings(modes=("shadow", "serve"), requests=2, max_new_tokens=4, startup_timeout=30)
    spec = TinySpec(layers=1, hidden_size=64, context_length=512)
    report = check.run_check(spec, s, tmp_path / "out", launcher=standin())
    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    assert on_disk["passed"] is report["passed"] is True and on_disk["complete"]
    assert list(on_disk["modes"]) == ["shadow", "serve"] and on_disk["sgl_kernel"]["route"] in (
        "absent",
        "sgl_kernel",
        "stand-in",
    )
    from kdtree.server.report import format_report

    text = format_report(report)
    assert "shadow: PASS" in text and "serve: PASS" in text and text.endswith(f"in {report['seconds']:.0f} s")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mode", "fast"], "unknown mode 'fast'"),
        (["--page-size", "16"], "needs --bfs-breadth 1"),
        (["--heads", "0"], "heads_per_rank must be at least 1"),
        (["--entrypoint", "docker"], "--entrypoint"),
        (["--draft-tokens", "1"], "at least 2"),
        (["--mode", "shadow", "--mode", "shadow"], "each mode once"),
        (["--startup-timeout", "0"], "--startup-timeout must be > 0"),
    ],
)
def test_bad_options_exit_2_before_anything_runs(args, message, tmp_path):
    r = CliRunner().invoke(app, ["server-check", "-o", str(tmp_path / "o"), *args])
    assert r.exit_code == 2 and message in r.output
    assert not (tmp_path / "o").exists()


# ----- the server bench's arithmetic ------------------------------------------------------------------------
def test_server_bench_pairs_kdtree_with_triton_point_by_point():
    from kdtree.server.bench import format_table, pair_rows

    def row(backend, n, tps, step):
        return {"heads": 8, "draft_tokens": 16, "backend": backend, "prompt_len": n, "batch": 4,
                "tokens_per_s": tps, "step_ms": step, "accept_length": 3.0}  # fmt: skip

    rows = [row("serve", 1024, 600.0, 2.0), row("triton", 1024, 300.0, 5.0), row("serve", 8192, 500.0, 2.5)]
    pairs = pair_rows(rows)
    assert len(pairs) == 1  # 8192 has no Triton row
    p = pairs[0]
    assert (p["prompt_len"], p["tokens_per_s_gain"], p["step_speedup"]) == (1024, 2.0, 2.5)
    assert "| 8 | 16 | 1024 | 4 | 600 | 300 | 2.00x | 2.00 | 5.00 | 2.50x |" in format_table(pairs)
    from kdtree.plots import server_bench_figure

    fig = server_bench_figure(pairs)
    assert fig.axes[0].get_title().endswith("2.00-2.00x") and fig._suptitle is None
    assert server_bench_figure(pairs, title="GPU X: tiny model")._suptitle.get_text() == "GPU X: tiny model"


def test_server_bench_settings_size_the_server_for_the_longest_point():
    from kdtree.server.bench import ServerBenchSettings

    s = ServerBenchSettings(prompt_lens=(1024, 32768), batches=(1, 16), draft_tokens=(64,), heads=(16,))
    assert s.context_length % 1024 == 0 and s.context_length >= 32768 + s.short_tokens + s.new_tokens + 64
    cs = s.server(64)
    assert (cs.max_running_requests, cs.cuda_graph_max_bs, cs.cuda_graph_bs) == (16, 16, (1, 16))
    assert cs.max_total_tokens >= 16 * (32768 + s.short_tokens + s.new_tokens + 64)
    argv = check.server_argv(Path("m"), 1, cs, s.spec(16), "serve")
    assert argv[argv.index("--cuda-graph-bs-decode") :][:3] == ["--cuda-graph-bs-decode", "1", "16"]
    assert s.spec(16).heads_per_rank == 16
    tp2 = ServerBenchSettings(heads=(8,), tp=2).spec(8)
    assert (tp2.heads_per_rank, tp2.tp, tp2.num_heads) == (8, 2, 16)  # 8 a rank, as Kimi at TP8
    with pytest.raises(ValueError, match="--batch"):
        ServerBenchSettings(batches=(0,)).check()
    with pytest.raises(ValueError, match="--tp"):
        ServerBenchSettings(tp=0).check()


def test_server_bench_prompts_have_exact_lengths_and_distinct_openings(tiny):
    from kdtree.server.bench import token_prompts

    ids = token_prompts(tiny, 300, 3)
    assert [len(x) for x in ids] == [300, 300, 300] and len({tuple(x[:8]) for x in ids}) == 3


def test_bench_server_options_are_checked_first(tmp_path):
    r = CliRunner().invoke(app, ["bench", "--server", "--batch", "0", "-o", str(tmp_path / "b")])
    assert r.exit_code == 2 and "--batch" in r.output and not (tmp_path / "b").exists()
    r = CliRunner().invoke(app, ["bench", "--heads", "8"])
    assert r.exit_code == 2 and "go with --server" in r.output
    r = CliRunner().invoke(app, ["bench", "--tp", "2"])
    assert r.exit_code == 2 and "--tp goes with --server" in r.output


def test_the_server_bench_times_decode_alone_and_profiles_the_extra_steps(tmp_path, monkeypatch):
    """Against the stand-in's clock (150 ms a request, 5 ms a verify step; a trace of 3 ms attention and 0.5 ms
    else per step, and a one-off kernel per request): the pairs of rounds cancel the per-request cost, so the step
    time is the step's (not 150 ms spread over the steps), and the profile's GPU time per step is the step's."""
    from kdtree.server import bench

    for k, v in {"STANDIN_REQUEST_MS": 150, "STANDIN_STEP_MS": 5, "STANDIN_ATTENTION_US": 3000, "STANDIN_GEMM_US": 500}.items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.setenv("PYTHONPATH", standin_env()["PYTHONPATH"])
    s = bench.ServerBenchSettings(
        prompt_lens=(48,), batches=(1, 3), draft_tokens=(4,), heads=(8,), new_tokens=40, short_tokens=4, layers=1,
        hidden_size=64, profile_points=((48, 3),),
    )  # fmt: skip
    result = bench.run(s, tmp_path, launcher=standin())
    assert result["problems"] == [] and len(result["rows"]) == 4 and len(result["pairs"]) == 2
    for row in result["rows"]:
        assert row["answered"] == row["requests"] == row["batch"] * (2 + 2 * s.repeats)
        assert row["verify_steps"] == 20 and row["tokens"] == 40 * row["batch"]
        assert 4.0 < row["step_ms"] < 7.5, row  # 5 ms; the old single round read (150 + 5 * 22) / 22 = 11.8 ms
    profiled = [r for r in result["rows"] if "profile" in r]
    assert [(r["backend"], r["batch"]) for r in profiled] == [("serve", 3), ("triton", 3)]
    for r in profiled:
        p = r["profile"]
        assert (
            p["steps"] == 20 and p["gpu_ms_per_step"] == pytest.approx(3.5) and p["attention_ms_per_step"] == pytest.approx(3.0)
        )
        assert p["not_on_gpu_ms_per_step"] == pytest.approx(r["step_ms"] - 3.5)
        assert all(Path(t).exists() for t in p["traces"])
    assert json.loads((tmp_path / "bench-server.json").read_text())["pairs"] == json.loads(json.dumps(result["pairs"]))


def test_replies_sent_in_parts_keep_their_place_in_the_whole_list(tmp_path):
    with _server(tmp_path) as server:
        server.wait_ready(30)
        from kdtree.server import client

        parts = client.drive(server.url, ["a", "b"], concurrency=2, max_new_tokens=2) + client.drive(
            server.url, ["c"], concurrency=1, max_new_tokens=2, first_index=2
        )
    assert [r.prompt_index for r in parts] == [0, 1, 2] and all(r.ok for r in parts)


def test_a_profile_finds_attentions_share_and_what_the_gpu_does_not_account_for(tmp_path):
    import gzip

    from kdtree.server import profile

    events = [
        {"ph": "X", "cat": "kernel", "name": "_fwd_kernel", "dur": 6000.0},  # Triton's extend attention, 2 steps
        {"ph": "X", "cat": "kernel", "name": "verify_mla_fwd<64>", "dur": 1000.0},
        {"ph": "X", "cat": "kernel", "name": "ampere_bf16_gemm", "dur": 3000.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9999.0},  # host ops are not GPU time
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    p = profile.step_profile(profile.kernel_times(profile.load_trace(path)), steps=2, wall_ms_per_step=10.0)
    assert p["gpu_ms_per_step"] == 5.0 and p["attention_ms_per_step"] == 3.5
    assert p["attention_share_of_gpu"] == 0.7 and p["attention_share_of_wall"] == 0.35 and p["not_on_gpu_ms_per_step"] == 5.0
    assert [k["attention"] for k in p["top_kernels"]] == [True, False, True]
    assert profile.amdahl(0.5, 4.0) == pytest.approx(1.6) and profile.amdahl(0.0, 9.0) == 1.0
    with pytest.raises(ValueError):
        profile.amdahl(1.5, 2.0)


def test_the_bench_profiles_the_longest_prompt_at_small_batches_unless_told():
    from kdtree.server.bench import ServerBenchSettings

    assert ServerBenchSettings().profiled == {(32768, 1), (32768, 4)}
    assert ServerBenchSettings(batches=(16,)).profiled == {(32768, 16)}
    assert ServerBenchSettings(profile_points=((1024, 1),)).profiled == {(1024, 1)}


def test_profiled_pairs_say_where_the_time_goes():
    from kdtree.server.bench import pair_rows

    prof = {
        "serve": {"attention_ms_per_step": 1.0, "not_on_gpu_ms_per_step": 2.0, "attention_share_of_wall": 0.2},
        "triton": {"attention_ms_per_step": 8.0, "not_on_gpu_ms_per_step": 2.5, "attention_share_of_wall": 0.8},
    }
    rows = [
        {
            "heads": 8,
            "draft_tokens": 16,
            "backend": b,
            "prompt_len": 32768,
            "batch": 1,
            "tokens_per_s": 1.0,
            "step_ms": 1.0,
            "accept_length": 3.0,
            "profile": prof[b],
        }  # fmt: skip
        for b in ("serve", "triton")
    ]
    (p,) = pair_rows(rows)
    assert (p["triton_attention_share"], p["attention_speedup"], p["triton_not_on_gpu_ms"]) == (0.8, 8.0, 2.5)
    assert p["amdahl_step_speedup"] == pytest.approx(1 / (0.2 + 0.1))


# ----- the projection to a large model and runs merged ---------------------------------------------------------
def _profiled_pair(heads=8, triton_att=24.0, kdtree_att=0.4):
    return {"heads": heads, "draft_tokens": 16, "prompt_len": 32768, "batch": 1,
            "triton_attention_ms": triton_att, "kdtree_attention_ms": kdtree_att}  # fmt: skip


def test_a_projection_carries_attention_a_layer_to_the_models_layers():
    from kdtree.server import projection as pj

    kimi = next(t for t in pj.TARGETS if t.heads_per_rank == 8)
    r = pj.project(_profiled_pair(), bench_layers=4, target=kimi, other_ms=10.0)
    assert (r["triton_layer_ms"], r["kdtree_layer_ms"]) == (6.0, 0.1)
    assert r["triton_step_ms"] == pytest.approx(61 * 6.0 + 10) and r["kdtree_step_ms"] == pytest.approx(61 * 0.1 + 10)
    assert r["step_speedup"] == pytest.approx(376 / 16.1) and r["triton_attention_share"] == pytest.approx(366 / 376)
    rows = pj.projections([_profiled_pair(), _profiled_pair(heads=16), {"heads": 8}], bench_layers=4, other_ms=(10.0, 40.0))
    assert [(r["target"], r["other_ms"]) for r in rows] == [
        ("Kimi K2.6 at TP8", 10.0), ("Kimi K2.6 at TP8", 40.0), ("DeepSeek-V3 at TP8", 10.0), ("DeepSeek-V3 at TP8", 40.0)
    ]  # fmt: skip
    table = pj.format_projections(rows)
    assert "| Kimi K2.6 at TP8 | 16 | 32768 | 1 | 6.00 / 0.100 | 23.4x | " in table and "rest 40 ms" in table
    assert pj.format_projections([]) == ""
    with pytest.raises(ValueError):
        pj.project(_profiled_pair(), bench_layers=0, target=kimi, other_ms=10.0)


def _bench_result(heads, layers=4):
    prof = {"serve": {"attention_ms_per_step": 0.4, "attention_share_of_wall": 0.1},
            "triton": {"attention_ms_per_step": 24.0, "attention_share_of_wall": 0.9}}  # fmt: skip
    rows = [
        {"heads": heads, "draft_tokens": 16, "backend": b, "prompt_len": 32768, "batch": 1, "tokens_per_s": tps,
         "step_ms": step, "accept_length": 4.0, "profile": prof[b]}
        for b, tps, step in (("serve", 800.0, 5.0), ("triton", 160.0, 25.0))
    ]  # fmt: skip
    return {"settings": {"heads": [heads], "layers": layers, "hidden_size": 256, "new_tokens": 256, "short_tokens": 32,
                         "tp": 1}, "environment": {"gpu": "NVIDIA H100 80GB HBM3"},
            "rows": rows, "servers": [], "pairs": [], "problems": []}  # fmt: skip


def test_bench_server_from_merges_runs_into_one_table_projection_and_figure(tmp_path):
    for heads in (8, 16):
        (tmp_path / f"h{heads}.json").write_text(json.dumps(_bench_result(heads)))
    older = _bench_result(16)  # written before the bench knew --tp and the environment: TP 1, no GPU named
    del older["settings"]["tp"], older["environment"]
    (tmp_path / "h16.json").write_text(json.dumps(older))
    out = tmp_path / "merged"
    args = ["bench", "--server", "--from", str(tmp_path / "h8.json"), "--from", str(tmp_path / "h16.json"), "-o", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    merged = json.loads((out / "bench-server.json").read_text())
    assert merged["settings"]["heads"] == [8, 16] and len(merged["pairs"]) == 2
    assert merged["environment"] == {"gpu": "NVIDIA H100 80GB HBM3"}
    assert {p["step_speedup"] for p in merged["pairs"]} == {5.0}
    assert {x["target"] for x in merged["projections"]} == {"Kimi K2.6 at TP8", "DeepSeek-V3 at TP8"}
    assert "| DeepSeek-V3 at TP8 | 16 | 32768 | 1 | 6.00 / 0.100 |" in r.output
    assert (out / "bench-server.png").stat().st_size > 0


@pytest.mark.parametrize(
    "files, extra, message",
    [
        (["h8", "h8"], [], "is also in"),
        (["h8", "l2"], [], "differ from the first file's"),
        (["h8", "missing"], [], "no such file"),
        (["h8", "junk"], [], "not readable JSON"),
        (["h8", "other"], [], "not a `kdtree bench --server` result"),
        (["h8"], ["--heads", "8"], "do not apply"),
        (["h8", "flat"], [], "not a `kdtree bench --server` result"),
        (["h8", "rowless"], [], "rows[0] lacks step_ms"),
        (["h8", "gpu2"], [], "runs of two GPUs do not merge"),
    ],
)
def test_bench_server_from_refuses_what_cannot_merge_and_writes_nothing(tmp_path, files, extra, message):
    (tmp_path / "h8.json").write_text(json.dumps(_bench_result(8)))
    (tmp_path / "l2.json").write_text(json.dumps(_bench_result(16, layers=2)))
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "flat.json").write_text(json.dumps({"settings": [], "rows": []}))
    rowless = _bench_result(16)
    del rowless["rows"][0]["step_ms"]
    (tmp_path / "rowless.json").write_text(json.dumps(rowless))
    (tmp_path / "gpu2.json").write_text(json.dumps(_bench_result(16) | {"environment": {"gpu": "NVIDIA H200"}}))
    args = ["bench", "--server", "-o", str(tmp_path / "o"), *extra]
    for f in files:
        args += ["--from", str(tmp_path / f"{f}.json")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and message in r.output, r.output
    assert not (tmp_path / "o").exists()


def test_from_goes_with_server(tmp_path):
    r = CliRunner().invoke(app, ["bench", "--from", str(tmp_path / "x.json"), "-o", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--from goes with --server" in r.output


def test_a_star_is_no_branch_below_the_root_and_a_ddtree_is():
    """What the NGRAM capture tests count: SGLang pads a short NGRAM draft with children of the root, so only a
    node below the root with two children shows a tree (`max_branching_below_root`)."""
    from kdtree.info import summarize
    from kdtree.synth import SynthSpec, synthesize

    def tree(kind, n):
        spec = SynthSpec(preset="kimi-k2-tp8", prefix_lens=[64], tree=kind, num_draft_tokens=n, seed=3)
        (r,) = summarize(synthesize(spec, reference="none"))["requests"]
        return r["max_branching"], r["max_branching_below_root"]

    assert tree("star", 16) == (15, 0)
    assert tree("chain", 16) == (1, 1)
    assert tree("ddtree", 65)[1] > 1


def test_a_machine_without_a_gpu_is_told_so_first_and_nothing_is_written(tmp_path):
    """On a machine without a GPU (CI), the server check and the server bench name the GPU among what is missing
    (not only SGLang, which alone would not make them run), exit 2 and write nothing."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for args in (["server-check"], ["bench", "--server"]):
        r = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "o")])
        assert r.exit_code == 2 and "a CUDA GPU" in r.output and "missing here" in r.output, r.output
        assert not (tmp_path / "o").exists()
