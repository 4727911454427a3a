"""Hardware adapters: detection with reasons, never crashing the asker; caches pointed before torch loads."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from acceldemo.hardware import HARDWARE, detect_all, get_hardware
from acceldemo.hardware.base import Hardware, probe_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_adapter_declares_what_it_is():
    expected = {"cpu": ("cpu", "gloo", "inductor"), "cuda": ("cuda", "nccl", "inductor"),
                "neuron": ("neuron", "neuron", "neuron"), "tpu": ("tpu", "tpu_dist", "tpu")}
    for name, (device, dist, backend) in expected.items():
        hw = HARDWARE[name]
        assert (hw.device, hw.mesh_device_type, hw.dist_backend) == (device, device, dist)
        assert name == "cpu" or hw.compile_backend == backend
        assert hw.cache_env and hw.modes[-2:] == ("compiled", "regional")
    assert HARDWARE["tpu"].modes == ("eager", "eager-fused", "compiled", "regional")
    assert "eager-fused" not in HARDWARE["neuron"].modes


def test_absent_accelerators_are_listed_with_their_reason():
    found = detect_all()
    assert found["cpu"].available and found["cpu"].memory_bytes > 0
    assert not found["neuron"].available and "torch_neuronx is not installed" in found["neuron"].reason
    assert not found["tpu"].available and found["tpu"].reason == "torch_tpu is not installed"
    assert not found["cuda"].available and "CPU-only build" in found["cuda"].reason


def test_unknown_hardware_lists_the_known_ones():
    with pytest.raises(Exception, match="known values are cpu, cuda, neuron, tpu"):
        get_hardware("ipu")


def _fake_packages(tmp_path, names):
    """Importable stand-ins, so the checks past 'is it installed' run for real."""
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    return str(tmp_path)


def _tpu_detected_in_a_fresh_app(tmp_path, **env):
    """What a fresh `import acceldemo` makes of a host whose torch_tpu is an empty stand-in: detection, autoload."""
    path = _fake_packages(tmp_path, ["torch_tpu"])
    code = textwrap.dedent("""
        import json, os, acceldemo
        from acceldemo.hardware import get_hardware
        import torch
        found = get_hardware("tpu").detect()
        print(json.dumps([found.available, found.reason, os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD")]))
    """)
    clean = {k: v for k, v in os.environ.items() if k not in ("TPU_LIBRARY_PATH", "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**clean, "PYTHONPATH": f"{ROOT}:{path}", **env}, timeout=120)
    return json.loads(out.stdout.splitlines()[-1])


def test_tpu_without_libtpu_is_reported_and_torch_still_loads(tmp_path):
    # torch_tpu that cannot load libtpu aborts `import torch` through autoload; the app must switch it off first.
    assert _tpu_detected_in_a_fresh_app(tmp_path) == [
        False, "torch_tpu is installed but libtpu is missing: install libtpu, or set TPU_LIBRARY_PATH to a libtpu.so",
        "0"]


def test_tpu_library_path_stands_in_for_the_libtpu_package(tmp_path):
    library = tmp_path / "libtpu.so"
    library.write_bytes(b"")
    # Autoload stays on; the empty stand-in then starts no device.
    assert _tpu_detected_in_a_fresh_app(tmp_path, TPU_LIBRARY_PATH=str(library)) == [
        False, "torch_tpu is installed but finds no TPU chip", None]


def test_tpu_library_path_to_no_file_is_reported_and_torch_still_loads(tmp_path):
    assert _tpu_detected_in_a_fresh_app(tmp_path, TPU_LIBRARY_PATH="/nowhere/libtpu.so") == [
        False, "TPU_LIBRARY_PATH=/nowhere/libtpu.so is not a file (torch_tpu loads libtpu from it)", "0"]


def test_neuron_package_without_devices_says_so(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(_fake_packages(tmp_path, ["torch_neuronx"]))
    found = type(HARDWARE["neuron"])().detect()
    assert not found.available and found.reason == "no /dev/neuron* device"


class _Aborting(Hardware):
    name, device = "aborting", "cpu"
    probe_code = "import os; os.abort()"


class _Hanging(Hardware):
    name, device = "hanging", "cpu"
    probe_code = "import time; time.sleep(60)"


def test_a_probe_that_aborts_is_a_reason_not_a_crash():
    found = _Aborting().detect()
    assert not found.available and "probing aborting failed (exit -6)" in found.reason


def test_a_probe_that_hangs_times_out(monkeypatch):
    monkeypatch.setattr("acceldemo.hardware.base.PROBE_TIMEOUT_S", 1.0)
    found = _Hanging().detect()
    assert not found.available and "did not finish within 1 s" in found.reason


def test_a_probe_that_raises_gives_the_exception_as_reason():
    class Raising(Hardware):
        name, device = "raising", "cpu"
        probe_code = probe_script("raise RuntimeError('no chip today')")

    found = Raising().detect()
    assert found == type(found)(False, "RuntimeError: no chip today")


def test_detection_is_probed_once_and_cached():
    hw = type(HARDWARE["cuda"])()
    assert hw.detect() is hw.detect()


def test_compile_caches_point_into_the_app_cache_dir_and_operator_values_win(tmp_path):
    code = "import json, os, acceldemo; print(json.dumps({k: os.environ.get(k) for k in " \
           "['TORCHINDUCTOR_CACHE_DIR', 'TORCH_NEURONX_NEFF_CACHE_DIR', 'TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT', " \
           "'TRITON_CACHE_DIR']}))"
    ours = {v for hw in HARDWARE.values() for v in hw.cache_env}
    env = {k: v for k, v in os.environ.items() if k not in ours}
    env.update(ACCELDEMO_CACHE_DIR=str(tmp_path), TRITON_CACHE_DIR="/operator/triton")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert json.loads(out.stdout) == {
        "TORCHINDUCTOR_CACHE_DIR": f"{tmp_path}/inductor", "TORCH_NEURONX_NEFF_CACHE_DIR": f"{tmp_path}/neff",
        "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": f"{tmp_path}/tpu", "TRITON_CACHE_DIR": "/operator/triton"}


def test_neuron_rank_gets_its_core_unless_the_operator_chose(monkeypatch):
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES", raising=False)
    HARDWARE["neuron"].prepare_rank(3)
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "3"
    HARDWARE["neuron"].prepare_rank(5)
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "3"
