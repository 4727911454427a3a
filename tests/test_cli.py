"""`python -m acceldemo`: info, generate, warmup and cache as a person runs them — parsing and refusals in this
process through `cli.main(argv)`, the exit-code contract and restarts in real processes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from acceldemo import cli as acceldemo_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "acceldemo", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=timeout, stdin=subprocess.DEVNULL)


def json_lines(done):
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main(capsys, *args) -> tuple[int, str, str]:
    """The CLI in this process: exit status, stdout, stderr."""
    try:
        status = acceldemo_cli.main(list(args))
    except SystemExit as exit:  # argparse's own exits (--help, a bad choice)
        status = exit.code
    out, err = capsys.readouterr()
    return status, out, err


def rows_of(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("command", [[], ["info"], ["generate"], ["warmup"], ["cache"], ["bench"]])
def test_help_everywhere(capsys, command):
    status, out, _ = main(capsys, *command, "--help")
    assert status == 0 and "usage: python -m acceldemo" in out


def test_info_lists_absent_hardware_with_reasons_and_models(capsys):
    status, out, _ = main(capsys, "info", "--json")
    info = json.loads(out)
    hardware = {h["name"]: h for h in info["hardware"]}
    models = {m["name"]: m for m in info["models"]}
    assert status == 0 and hardware["cpu"]["available"] and hardware["cpu"]["devices"][0]["device"] == "cpu:0"
    assert (hardware["tpu"]["available"], hardware["tpu"]["reason"]) == (False, "torch_tpu is not installed")
    assert models["flux2-dev"]["pipeline"] == "Flux2Pipeline"
    (on_cpu,) = models["tiny-sd3"]["offers"]
    regional = next(o for o in on_cpu["modes"] if o["name"] == "regional")
    assert on_cpu["hardware"] == "cpu" and regional["ok"] is False and "no repeated blocks" in regional["reason"]
    assert info["precompiled"]["setting"] == "auto" and info["precompiled"]["folder"].endswith("aoti")


def test_info_in_words_names_what_is_absent_and_why(capsys):
    status, out, _ = main(capsys, "info")
    assert status == 0 and "tpu     absent  torch_tpu is not installed" in out
    assert "on cpu: placement device" in out and "regional (the Tiny SD3" in out


@pytest.mark.slow
def test_generate_reports_new_graphs_then_warm(capsys, tmp_path):
    status, out, _ = main(capsys, "generate", "--prompt", "a red circle", "--json", "--mode", "compiled",
                          "--size", "64x64", "--size", "128x64", "--size", "64x64", "--out", str(tmp_path))
    rows = rows_of(out)
    assert status == 0 and [r["new_graphs"] > 0 for r in rows] == [True, True, False]
    assert [r["warm"] for r in rows] == [False, False, True]
    for row in rows:
        assert {"model", "hardware", "mode", "placement", "width", "height", "steps", "seed", "seconds",
                "new_graphs", "warm", "path"} <= row.keys()
        assert Image.open(row["path"]).size == (row["width"], row["height"])


def test_repeat_runs_each_size_k_times_with_one_seed(capsys, tmp_path):
    status, out, _ = main(capsys, "generate", "--prompt", "x", "--json", "--size", "64x64", "--size", "80x64",
                          "--repeat", "2", "--out", str(tmp_path))
    rows = rows_of(out)
    assert [(r["width"], r["warm"]) for r in rows] == [(64, False), (64, True), (80, False), (80, True)]
    assert len({r["seed"] for r in rows}) == 2  # no --seed: one drawn per size, kept for its repeats


def test_warmup_reports_each_shape(capsys):
    status, out, _ = main(capsys, "warmup", "--mode", "regional", "--size", "64x64", "--size", "96x64", "--json")
    rows = rows_of(out)
    assert [(r["shape"], r["state"]) for r in rows] == [("64x64", "ready"), ("96x64", "ready")]
    assert all(r["graphs"] > 0 for r in rows)


@pytest.mark.parametrize("args, says", [
    (["generate", "--prompt", "x", "--size", "100x64"],
     "error: width=100 is not accepted: tiny-flux2-klein needs a multiple of 16 from 64 to 512 — try 96"),
    (["generate", "--prompt", "x", "--hardware", "neuron"], "error: hardware 'neuron' is not available here: "
                                                            "torch_neuronx is not installed"),
    (["generate", "--prompt", "x", "--steps", "0"], "error: steps=0 is not accepted: a whole number from 1 to 100"),
    (["generate", "--prompt", "x", "--repeat", "0"], "error: repeat=0 is not accepted: a whole number of at least 1"),
    (["generate", "--prompt", "", "--size", "64x64"], "error: prompt='' is not accepted: a non-empty text"),
    (["warmup", "--model", "flux3"], "error: model='flux3' is not accepted: known values are flux1-schnell"),
    (["warmup", "--size", "64x70"], "error: height=70 is not accepted"),
    (["generate", "--prompt", "x", "--device", "cpu:7"], "error: device='cpu:7' is not accepted: one of cpu:0 here"),
    (["generate", "--prompt", "x", "--placement", "tp", "--tp", "3"],
     "error: tp_size=3 is not accepted: a divisor of the 4 transformer attention heads"),
    (["generate", "--prompt", "x", "--size", "0x64"], "error: width=0 is not accepted"),
    (["generate", "--prompt", "x", "--guidance", "nan"], "error: guidance=nan is not accepted"),
    (["generate", "--prompt", "x", "--seed", "-5"], "error: seed=-5 is not accepted"),
    (["generate", "--prompt", "x", "--mode", "compiled", "--placement", "offload"],
     "error: mode 'compiled' is not possible here: offload hooks cannot be traced"),
    (["generate", "--prompt", "x", "--model", "tiny-sd3", "--mode", "regional"], "has no repeated blocks"),
    (["generate", "--prompt", "x", "--mode", "eager-fused"], "cpu does not offer it; only tpu does"),
    (["generate", "--prompt", "x", "--hardware", "tpu"], "error: hardware 'tpu' is not available here: torch_tpu"),
])
def test_a_bad_request_is_one_clear_line_and_exit_2(capsys, args, says):
    status, out, err = main(capsys, *args)
    assert status == 2 and out == "" and "Traceback" not in err and "loading" not in err
    (line,) = err.strip().splitlines()
    assert says in line and line.startswith("error: "), line


@pytest.mark.parametrize("args, says", [(["generate"], "the following arguments are required: --prompt"),
                                        (["generate", "--prompt", "x", "--mode", "fast"], "invalid choice: 'fast'"),
                                        (["warmup", "--size", "big"], "'big' is not a size: write WIDTHxHEIGHT")])
def test_a_malformed_command_line_is_argparse_usage_and_exit_2(capsys, args, says):
    status, _, err = main(capsys, *args)
    assert status == 2 and says in err and "usage: python -m acceldemo" in err


def test_an_output_folder_that_cannot_be_written_is_refused_before_any_image_is_made(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    status, out, err = main(capsys, "generate", "--prompt", "a red circle", "--out", str(blocker / "images"))
    assert status == 2 and "Traceback" not in err and "loading" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith("error: out='/") and line.endswith(
        "is not accepted: a folder this user can create and write to (Not a directory)")
    assert out == ""


@pytest.mark.slow  # a real compile (or a real process) end to end: the full suite runs it
def test_the_real_command_exits_0_with_an_image_and_2_with_one_line_for_a_bad_request(tmp_path):
    done = cli("generate", "--prompt", "a red circle", "--size", "64x64", "--steps", "2", "--seed", "4", "--json",
               "--out", str(tmp_path))
    (row,) = json_lines(done)
    assert row["seed"] == 4 and Image.open(row["path"]).size == (64, 64)
    done = cli("generate", "--prompt", "x", "--size", "100x64")
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: width=100 is not accepted: tiny-flux2-klein needs a multiple of 16 from 64 to 512 — try 96"]


def _pixels(path):
    import numpy as np

    return np.asarray(Image.open(path), dtype=np.int16)


@pytest.mark.slow
@pytest.mark.inductor
def test_inductor_packages_compile_once_and_a_restart_loads_them(tmp_path):
    env = {"ACCELDEMO_CPU_COMPILE_BACKEND": "inductor", "ACCELDEMO_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "inductor")}
    args = ["generate", "--prompt", "a red circle", "--json", "--mode", "compiled", "--seed", "0"]
    rows = json_lines(cli(*args, "--out", str(tmp_path / "first"), "--size", "64x64", "--size", "128x64",
                          "--size", "64x64", env=env))
    assert [(r["new_graphs"], r["compile_cache_hits"], r["warm"]) for r in rows] == \
        [(1, 0, False), (1, 0, False), (0, 0, True)]
    packages = sorted((tmp_path / "cache" / "aoti" / "tiny-flux2-klein" / "cpu").glob("*.pt2"))
    assert len(packages) == 2
    about = json.loads(packages[0].with_suffix(".json").read_text())
    assert about["model"] == "tiny-flux2-klein" and about["toolchain"].startswith("torch 2.13")

    restarted = json_lines(cli(*args, "--out", str(tmp_path / "again"), "--size", "64x64", env=env))[0]
    # Loaded, not compiled: no graph, one persistent artifact reused, and the very same image.
    assert (restarted["new_graphs"], restarted["compile_cache_hits"], restarted["compile_seconds"]) == (0, 1, 0)
    assert (_pixels(restarted["path"]) == _pixels(rows[0]["path"])).all()

    for package in packages:  # cut short, as by a crash mid-copy: rebuilt, never a failed request
        package.write_bytes(package.read_bytes()[:1000])
    done = cli(*args, "--out", str(tmp_path / "mended"), "--size", "64x64", env=env)
    mended = json_lines(done)[0]
    assert "unusable" in done.stderr and (mended["new_graphs"], mended["compile_cache_hits"]) == (1, 0)
    assert (_pixels(mended["path"]) == _pixels(rows[0]["path"])).all()


@pytest.mark.slow
@pytest.mark.inductor
def test_with_precompile_off_a_restart_reuses_inductors_own_cache(tmp_path):
    env = {"ACCELDEMO_CPU_COMPILE_BACKEND": "inductor", "ACCELDEMO_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "inductor"), "ACCELDEMO_PRECOMPILE": "off"}
    args = ["generate", "--prompt", "a red circle", "--json", "--mode", "compiled", "--out", str(tmp_path)]
    first = json_lines(cli(*args, "--size", "64x64", env=env))[0]
    assert first["new_graphs"] > 0 and first["compile_cache_hits"] == 0
    restarted = json_lines(cli(*args, "--size", "64x64", env=env))[0]
    assert restarted["new_graphs"] > 0 and restarted["compile_cache_hits"] > 0
    assert not (tmp_path / "cache" / "aoti").exists()


def test_cache_lists_packages_and_prune_removes_another_toolchains(capsys, monkeypatch, tmp_path):
    from acceldemo.executors.artifacts import ArtifactStore

    store = ArtifactStore(tmp_path / "aoti")
    about = {"model": "tiny-flux2-klein", "hardware": "cpu", "shape": "64x64", "toolchain": "torch 1.0, cpu none"}
    path = store.path("tiny-flux2-klein", "cpu", about)
    store.save(path, lambda partial: Path(partial).write_bytes(b"package"), about)
    monkeypatch.setenv("ACCELDEMO_CACHE_DIR", str(tmp_path))
    listed = json.loads(main(capsys, "cache", "--json")[1])
    assert [(p["shape"], p["toolchain"]) for p in listed["packages"]] == [("64x64", "torch 1.0, cpu none")]
    assert listed["removed"] == []
    pruned = json.loads(main(capsys, "cache", "--prune", "--json")[1])
    assert pruned["removed"] == [str(path)] and pruned["packages"] == [] and not path.exists()
