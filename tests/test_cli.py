"""`python -m acceldemo`: info, generate and warmup as a person runs them, in real processes."""
import json
import os
import subprocess
import sys

import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "acceldemo", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=timeout, stdin=subprocess.DEVNULL)


def json_lines(done):
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("command", [[], ["info"], ["generate"], ["warmup"], ["cache"]])
def test_help_everywhere(command):
    done = cli(*command, "--help")
    assert done.returncode == 0 and "usage: python -m acceldemo" in done.stdout


def test_info_lists_absent_hardware_with_reasons_and_models():
    info = json.loads(cli("info", "--json").stdout)
    assert info["hardware"]["cpu"]["available"]
    assert info["hardware"]["tpu"] == {**info["hardware"]["tpu"], "available": False,
                                       "reason": "torch_tpu is not installed"}
    assert info["models"]["flux2-dev"]["pipeline"] == "Flux2Pipeline"
    assert info["models"]["tiny-sd3"]["modes"]["cpu"]["regional"][0] is False
    assert info["precompiled"]["setting"] == "auto" and info["precompiled"]["folder"].endswith("aoti")


def test_generate_reports_new_graphs_then_warm(tmp_path):
    rows = json_lines(cli("generate", "--prompt", "a red circle", "--json", "--mode", "compiled", "--size", "64x64",
                          "--size", "128x64", "--size", "64x64", "--out", str(tmp_path)))
    assert [r["new_graphs"] > 0 for r in rows] == [True, True, False]
    assert [r["warm"] for r in rows] == [False, False, True]
    for row in rows:
        assert {"model", "hardware", "mode", "placement", "width", "height", "steps", "seed", "seconds",
                "new_graphs", "warm", "path"} <= row.keys()
        assert Image.open(row["path"]).size == (row["width"], row["height"])


def test_repeat_runs_each_size_k_times(tmp_path):
    rows = json_lines(cli("generate", "--prompt", "x", "--json", "--size", "64x64", "--size", "80x64",
                          "--repeat", "2", "--out", str(tmp_path)))
    assert [(r["width"], r["warm"]) for r in rows] == [(64, False), (64, True), (80, False), (80, True)]


def test_warmup_reports_each_shape(tmp_path):
    rows = json_lines(cli("warmup", "--mode", "regional", "--size", "64x64", "--size", "96x64", "--json"))
    assert [(r["shape"], r["state"]) for r in rows] == [("64x64", "ready"), ("96x64", "ready")]
    assert all(r["graphs"] > 0 for r in rows)


def test_a_bad_request_is_one_clear_line_and_exit_2():
    done = cli("generate", "--prompt", "x", "--size", "100x64")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "error: width=100 is not accepted: tiny-flux2-klein needs a multiple of 16 from 64 to 512 — try 96" \
        in done.stderr
    done = cli("generate", "--prompt", "x", "--hardware", "neuron")
    assert done.returncode == 2 and "torch_neuronx is not installed" in done.stderr


def test_an_output_folder_that_cannot_be_written_is_refused_before_any_image_is_made(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    done = cli("generate", "--prompt", "a red circle", "--out", str(blocker / "images"))
    assert done.returncode == 2 and "Traceback" not in done.stderr and "loading" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: out='/") and line.endswith(
        "is not accepted: a folder this user can create and write to (Not a directory)")
    assert done.stdout == ""


def _pixels(path):
    import numpy as np

    return np.asarray(Image.open(path), dtype=np.int16)


@pytest.mark.slow
@pytest.mark.inductor
def test_inductor_packages_compile_once_and_a_restart_loads_them(tmp_path):
    env = {"ACCELDEMO_CPU_COMPILE_BACKEND": "inductor", "ACCELDEMO_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "inductor")}
    args = ["generate", "--prompt", "a red circle", "--json", "--mode", "compiled"]
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


def test_cache_lists_packages_and_prune_removes_another_toolchains(tmp_path):
    from acceldemo.executors.artifacts import ArtifactStore

    store = ArtifactStore(tmp_path / "aoti")
    about = {"model": "tiny-flux2-klein", "hardware": "cpu", "shape": "64x64", "toolchain": "torch 1.0, cpu none"}
    path = store.path("tiny-flux2-klein", "cpu", about)
    store.save(path, lambda partial: open(partial, "wb").write(b"package"), about)
    env = {"ACCELDEMO_CACHE_DIR": str(tmp_path)}
    listed = json.loads(cli("cache", "--json", env=env).stdout)
    assert [(p["shape"], p["toolchain"]) for p in listed["packages"]] == [("64x64", "torch 1.0, cpu none")]
    assert listed["removed"] == []
    pruned = json.loads(cli("cache", "--prune", "--json", env=env).stdout)
    assert pruned["removed"] == [str(path)] and pruned["packages"] == [] and not path.exists()
