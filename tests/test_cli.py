import json
import subprocess
import sys

from kdtree.capture import load

from conftest import SHIPPED, sha


def kdtree(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "kdtree", *map(str, args)], capture_output=True, text=True, cwd=cwd)


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
        ("bench", "--chain", "--sglang", "-o", tmp_path / "b"),
        ("bench", "--target", "sm_90a-B64", "-o", tmp_path / "b"),
    ):
        r = kdtree(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr
        err = [l for l in r.stderr.splitlines() if l.strip()]
        assert len(err) == 1 and err[0].startswith("kdtree: error:"), (args, r.stderr)
    assert sha(bad) == before
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "b").exists()


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
    assert {l.split()[1] for l in r.stdout.splitlines()[1:]} == {"bm64+f16", "bm64/b64", "bm64", "bm32"}  # sm_90 runs all four
    r = kdtree("compile", "--nvrtc", tmp_path / "libnvrtc.so.13")
    assert r.returncode == 2 and "--nvrtc: no such library" in r.stderr and r.stdout == ""
