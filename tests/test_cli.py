import json
import subprocess
import sys

import pytest

from kdtree.capture import load

from conftest import ROOT, SHIPPED, sha


def kdtree(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "kdtree", *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env)


def test_diff_on_shipped_captures_passes_and_prints_grep_lines():
    r = kdtree("diff", *SHIPPED)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("[kdtree] L")]
    assert len(lines) == sum(len(load(p).meta.layer_ids) for p in SHIPPED)
    assert r.stdout.strip().splitlines()[-1].startswith("PASS")


def test_injected_fault_fails_with_exit_1():
    r = kdtree("diff", SHIPPED[0], "--inject", "prefix-only-kv")
    assert r.returncode == 1
    assert "worst: request" in r.stdout and r.stdout.strip().splitlines()[-1].startswith("FAIL")


def test_json_output():
    path = next(p for p in SHIPPED if "3layers" in p.name)
    r = kdtree("diff", path, "--json", "--impl", "emulation", "--ref", "capture", "--layer", "30")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["passed"] and doc["captures"][0]["impl"] == "emulation"
    layers = doc["captures"][0]["layers"]
    assert [l["layer"] for l in layers] == [30]
    assert {"max_abs_diff", "mean_abs_diff", "rel", "worst", "per_request", "nan", "unwritten"} <= set(layers[0])


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    before = sha(bad)
    for args in (
        ("diff", bad),
        ("diff", tmp_path / "missing.safetensors"),
        ("diff", SHIPPED[0], "--impl", "nope"),
        ("diff", SHIPPED[0], "--inject", "nope"),
        ("diff", SHIPPED[0], "--layer", "99"),
        ("info", bad),
        ("synth", "-o", tmp_path / "x.safetensors", "--batch", "3", "--prefix", "1,2"),
        ("synth", "-o", tmp_path / "x.safetensors", "--tree", "bush"),
        ("synth", "-o", tmp_path / "x.safetensors", "--reference", "bogus"),
        ("synth", "-o", tmp_path / "x.safetensors", "--preset", "nope"),
        ("synth", "-o", tmp_path / "x.safetensors", "--tree", "eagle", "-n", "100", "--topk", "1", "--max-depth", "2"),
        ("synth", "-o", tmp_path / "x.safetensors", "--prefix", "8", "--budget", "4", "--pool-size", "3"),
        ("synth", "-o", tmp_path / "x.safetensors", "--prefix", "8,x"),
        ("diff", SHIPPED[0], "--impl", "oracle", "--inject", "prefix-only-kv"),
        ("diff", SHIPPED[0], "--device", "tpu"),
        ("diff", SHIPPED[0], "--tol", "0"),
        ("plan", "--case", "mixed", "--sms", "0"),
        ("bench", "--chain", "--sglang", "-o", tmp_path / "b"),
        ("bench", "--target", "sm_90a-Blocks64", "-o", tmp_path / "b"),
    ):
        r = kdtree(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr
        err = [l for l in r.stderr.splitlines() if l.strip()]
        assert len(err) == 1 and err[0].startswith("kdtree: error:"), (args, r.stderr)
    assert sha(bad) == before
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "b").exists()


def test_bench_checks_its_options_before_it_needs_a_gpu(tmp_path):
    """A bad bench option is named in the error on any machine (the GPU is looked for after the options); without
    a GPU, good options get as far as that check."""
    from kdtree.impls import gpu_available

    for args, option in (
        (("--chain", "--flashinfer-backend", "fa4"), "--flashinfer-backend"),
        (("--flashinfer-backend", "fa2"), "--flashinfer-backend"),
        (("--target", "sm_90a-Blocks64"), "--target"),
        (("--chain", "--sglang"), "--sglang"),
    ):
        r = kdtree("bench", *args, "-o", tmp_path / "b")
        assert r.returncode == 2 and option in r.stderr and "GPU" not in r.stderr, (args, r.stderr)
    if gpu_available():
        pytest.skip("with a GPU, good options would run the bench")
    r = kdtree("bench", "--chain", "--flashinfer-backend", "fa2", "--target", "sm_120", "-o", tmp_path / "b")
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr, r.stderr
    assert not (tmp_path / "b").exists()


def test_unknown_option_is_a_usage_error_exit_2():
    r = kdtree("diff", SHIPPED[0], "--frobnicate")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_info_summarises(tmp_path):
    path = next(p for p in SHIPPED if "mixed" in p.name)
    r = kdtree("info", path, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)[0]
    assert s["prefix_lens"] == load(path).prefix_lens.tolist()
    assert s["requests"][0]["depth"] >= 1 and s["pool"]["referenced_slots"] > 0
    r = kdtree("info", path)
    assert "slot_runs" in r.stdout and r.returncode == 0


def test_synth_writes_a_valid_capture_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "c.safetensors"
    r = kdtree(
        "synth", "-o", out, "--preset", "deepseek-v3-tp8", "--batch", "2", "--prefix", "0,33", "--budget", "5", "--layers", "1,4"
    )
    assert r.returncode == 0, r.stderr
    cap = load(out)
    assert cap.meta.num_heads == 16 and cap.meta.layer_ids == [1, 4] and cap.prefix_lens.tolist() == [0, 33]
    before = sha(out)
    r = kdtree("synth", "-o", out, "--seed", "9")
    assert r.returncode == 2 and "--force" in r.stderr and sha(out) == before
    r = kdtree(
        "synth",
        "-o",
        out,
        "--preset",
        "deepseek-v3-tp8",
        "--batch",
        "2",
        "--prefix",
        "0,33",
        "--budget",
        "5",
        "--layers",
        "1,4",
        "--force",
    )
    assert r.returncode == 0 and sha(out) == before  # same parameters, same bytes


def test_compile_reports_every_configuration_and_refuses_a_missing_nvrtc(tmp_path):
    import pytest

    pytest.importorskip("cuda.bindings", reason="NVRTC not installed (pip install -e '.[nvrtc]')")
    r = kdtree("compile", "--arch", "sm_90")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(NVRTC 13." in r.stdout.splitlines()[0]
    bodies = {l.split()[1] for l in r.stdout.splitlines()[1:]}
    assert bodies == {"split_keys+few", "blocks64", "split_keys", "mma32"}  # sm_90 runs all four
    r = kdtree("compile", "--nvrtc", tmp_path / "libnvrtc.so.13")
    assert r.returncode == 2 and "--nvrtc: no such library" in r.stderr and r.stdout == ""


def test_plan_shows_what_the_cost_model_weighs_and_its_pick():
    """`kdtree plan` on a shipped capture and bench cases (no GPU): every plan `choose_plan` weighs, cheapest first,
    the one it picks marked, in the table and in --json; on Hopper with the H200's L2 mixed (81 MiB of pool rows)
    is over it and picks the aligned plan on blocks64, dsv3 32k x2 one tile a block; on sm_120 the only body
    is mma.sync at 32 rows."""
    from kdtree.bench import BENCH_CASES
    from kdtree.kernel import KernelConfig, choose_plan
    from kdtree.marshal import marshal
    from kdtree.synth import synthesize

    path = next(p for p in SHIPPED if "mixed" in p.name)
    r = kdtree("plan", path, "--case", "mixed", "--case", "32k x2", "--json")
    assert r.returncode == 0, r.stderr
    doc = {d["batch"]: d for d in json.loads(r.stdout)}
    cases = {c.name: c for c in BENCH_CASES}
    for name in (str(path), "kimi-tp8 mixed", "dsv3-tp8 ddtree256 32k x2"):
        cap = load(path) if name == str(path) else synthesize(cases[name].spec(), reference=False)
        rows = doc[name]["plans"]
        assert [r["picked"] for r in rows].count(True) == 1 and rows[0]["picked"]
        assert [r["cost"] for r in rows] == sorted(r["cost"] for r in rows)
        p = choose_plan(marshal(cap), cap.meta.num_heads, 132, KernelConfig.candidates("sm_90"), l2_bytes=60 << 20)
        assert (rows[0]["body"], rows[0]["grid"], rows[0]["partial_slots"]) == (p.config.body, p.grid, p.segments)
        assert rows[0]["keys"] == ("visible" if p.visible_keys else "all") and doc[name]["over_l2"] == (name != str(path))
    assert (doc["kimi-tp8 mixed"]["plans"][0]["body"], doc["kimi-tp8 mixed"]["plans"][0]["split"]) == ("blocks64", "aligned")
    assert doc["dsv3-tp8 ddtree256 32k x2"]["plans"][0]["split"] == "one tile a block"
    r = kdtree("plan", "--case", "mixed", "--target", "sm_120")  # planned for the RTX PRO 6000 unless told
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("kimi-tp8 mixed: sm_120 (as an RTX PRO 6000), 188 SMs, L2 122 MiB; pool rows 81.")
    assert "over it" not in lines[0]
    assert lines[2].startswith("* mma32 ") and all(l.startswith(("* mma32 ", "  mma32 ")) for l in lines[2:] if l.strip())


def test_plan_bad_input_exits_2(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a capture")
    for args, what in (
        ([], "give capture files"),
        (["--case", "no such case"], "--case matches none"),
        (["--case", "mixed", "--target", "sm_99"], "unknown target"),
        (["--case", "mixed", "--sms", "0"], "--sms"),
        (["--case", "mixed", "--l2-mib", "inf"], "--l2-mib"),
        ([SHIPPED[0], tmp_path / "missing.safetensors"], "missing.safetensors"),
        ([bad], "bad.safetensors"),
    ):
        r = kdtree("plan", *args)
        assert r.returncode == 2 and r.stdout == "" and what in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)


def test_a_directory_stands_for_its_captures_as_the_readme_writes_it(tmp_path):
    """`kdtree info data/captured_batches` (the README's form) reads every capture and not the README.md and
    regenerate.sh beside them; a directory without captures is bad input."""
    shipped = SHIPPED[0].parent
    r = kdtree("info", shipped, "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(s["path"] for s in json.loads(r.stdout)) == sorted(str(p) for p in SHIPPED)
    r = kdtree("diff", tmp_path)
    assert r.returncode == 2 and "no capture files" in r.stderr and r.stdout == ""


def test_ab_builds_the_committed_kernel_beside_the_edited_one(tmp_path):
    """kdtree.ab: HEAD's kernels/ from git, compiled beside another tree's; identical trees show no change, a
    broken edit names its line, a ref git does not know is bad input."""
    pytest.importorskip("cuda.bindings")
    import shutil

    from kdtree.ab import committed_source, compile_ab, format_compile_ab
    from kdtree.kernel import KERNEL_DIR, KernelCompileError

    head = committed_source("HEAD")
    assert head.name == "verify_mla.cu" and head.parent.name == "kernels" and head != KERNEL_DIR / "verify_mla.cu"
    copy = tmp_path / "kernels"
    shutil.copytree(head.parent, copy)
    rows = compile_ab(["sm_120"], head, copy / "verify_mla.cu")
    assert {r["kernel"] for r in rows} == {"verify_mla_fwd", "verify_mla_merge"}
    assert all(r["registers"][0] == r["registers"][1] for r in rows) and "changed" not in format_compile_ab(rows)
    src = copy / "verify_mla.cu"
    src.write_text(src.read_text() + "\nthis is not CUDA;\n")
    with pytest.raises(KernelCompileError, match="this is not CUDA"):
        compile_ab(["sm_120"], head, src)
    with pytest.raises(ValueError, match="not a commit"):
        committed_source("no-such-ref-anywhere")


def test_a_capture_that_breaks_a_rule_is_bad_input_naming_file_and_tensor(tmp_path):
    """A file that is safetensors but not a valid capture: exit 2, one line naming the file, the tensor and the rule."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(SHIPPED[0]), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "seq_lens"}
        metadata = f.metadata()
    bad = tmp_path / "no-seq-lens.safetensors"
    save_file(tensors, bad, metadata=metadata)
    for command in ("info", "diff", "plan"):
        r = kdtree(command, bad)
        assert r.returncode == 2 and r.stdout == "", (command, r.stdout, r.stderr)
        assert r.stderr.splitlines() == [f"kdtree: error: {bad}: seq_lens: missing tensor"], (command, r.stderr)


# runs the CLI with one of kdtree's functions replaced by one that fails as a bug would
BUG = """
import sys
import importlib
module, name, exc = sys.argv[1:4]
def bug(*args, **kwargs):
    raise getattr(__builtins__, exc)("an error of kdtree's own code")
setattr(importlib.import_module(module), name, bug)
from kdtree.cli import main
sys.argv = ["kdtree", *sys.argv[4:]]
main()
"""


@pytest.mark.parametrize(
    "module, name, exc, args",
    [
        ("kdtree.info", "summarize", "KeyError", ["info", SHIPPED[0]]),
        ("kdtree.plan_report", "plan_report", "IndexError", ["plan", SHIPPED[0]]),
        ("kdtree.impls", "diff_capture", "ValueError", ["diff", SHIPPED[0]]),
        ("kdtree.synth", "synthesize", "TypeError", ["synth", "-o", "{tmp}/x.safetensors"]),
        ("kdtree.info", "summarize", "BrokenPipeError", ["info", SHIPPED[0]]),  # not stdout's: a bug as any other
    ],
)
def test_a_bug_shows_its_traceback_and_asks_to_be_reported(tmp_path, module, name, exc, args):
    """An exception that is not BadInput - KeyError, IndexError, even ValueError - is a bug: exit 3 (not 2, bad
    input), its traceback, then the line asking to report it; nothing written."""
    from kdtree.cli import BUG_EXIT, BUG_HINT

    args = [str(a).replace("{tmp}", str(tmp_path)) for a in args]
    r = subprocess.run([sys.executable, "-c", BUG, module, name, exc, *args], capture_output=True, text=True)
    assert r.returncode == BUG_EXIT != 2, (r.returncode, r.stderr)
    assert "Traceback (most recent call last)" in r.stderr and f"{exc}: " in r.stderr, r.stderr
    assert "an error of kdtree's own code" in r.stderr and "kdtree: error:" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == BUG_HINT
    assert list(tmp_path.iterdir()) == []


def test_every_command_maps_its_errors_the_same_way():
    """Every command is registered through `command`, so bad input and bugs end every one of them alike."""
    from kdtree.cli import app, exit_codes

    wrapped = exit_codes(lambda: None).__code__
    names = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert {"info", "synth", "diff", "compile", "plan", "bench", "server-check"} <= names
    assert all(c.callback.__code__ is wrapped for c in app.registered_commands), names


def test_a_bad_kernel_target_in_the_environment_is_bad_input(tmp_path):
    import os

    r = kdtree("bench", "-o", tmp_path / "b", env=os.environ | {"KDTREE_KERNEL_TARGET": "sm_99"})
    assert r.returncode == 2 and "KDTREE_KERNEL_TARGET='sm_99'" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("args", [["info", "data/captured_batches"], ["diff", "data/captured_batches", "--impl", "model"]])
def test_a_reader_that_goes_away_is_not_a_bug(args):
    """`kdtree diff ... | head -1`: stdout closes before kdtree writes; it ends quietly (exit 141, as a process
    SIGPIPE ends), with no traceback and no request to report a bug."""
    from kdtree.cli import PIPE_CLOSED_EXIT

    p = subprocess.Popen([sys.executable, "-m", "kdtree", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the first line
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == PIPE_CLOSED_EXIT, err
    assert err == "", err
