"""Hardware adapters: detection with reasons, never crashing the asker; caches pointed before torch loads."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from acceldemo.config import Settings
from acceldemo.hardware import ADAPTERS, Availability, HardwareRegistry
from acceldemo.hardware.base import GiB, Hardware, probe_script
from acceldemo.records import DeviceSet, Mode
from tests.engines import settings_with

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = Settings.from_env()
HARDWARE = HardwareRegistry(SETTINGS)


def fresh(name: str) -> Hardware:
    """A new adapter of that hardware (nothing detected yet)."""
    return ADAPTERS[name](SETTINGS)


def test_every_adapter_declares_what_it_is():
    expected = {"cpu": ("cpu", "gloo", "inductor"), "cuda": ("cuda", "nccl", "inductor"),
                "neuron": ("neuron", "neuron", "neuron"), "tpu": ("tpu", "tpu_dist", "tpu")}
    for name, (device, dist, backend) in expected.items():
        hw = HARDWARE.get(name)
        assert (hw.device, hw.mesh_device_type, hw.dist_backend) == (device, device, dist)
        assert name == "cpu" or hw.compile_backend == backend
        assert hw.cache_env and hw.modes[-2:] == (Mode.COMPILED, Mode.REGIONAL)
    assert HARDWARE.get("tpu").modes == (Mode.EAGER, Mode.EAGER_FUSED, Mode.COMPILED, Mode.REGIONAL)
    assert Mode.EAGER_FUSED not in HARDWARE.get("neuron").modes


def test_the_cpu_compile_backend_is_the_settings_own():
    assert HardwareRegistry(settings_with(cpu_compile_backend="inductor")).get("cpu").compile_backend == "inductor"
    assert HardwareRegistry(settings_with(cpu_compile_backend="eager")).get("cpu").compile_backend == "eager"


def test_absent_accelerators_are_listed_with_their_reason():
    found = HARDWARE.detect_all()
    assert found["cpu"].available and found["cpu"].memory_bytes > 0
    assert not found["neuron"].available and "torch_neuronx is not installed" in found["neuron"].reason
    assert not found["tpu"].available and found["tpu"].reason == "torch_tpu is not installed"
    assert not found["cuda"].available and "CPU-only build" in found["cuda"].reason


def test_unknown_hardware_lists_the_known_ones():
    with pytest.raises(Exception, match="known values are cpu, cuda, neuron, tpu"):
        HARDWARE.get("ipu")


def _fake_packages(tmp_path, names):
    """Importable stand-ins, so the checks past 'is it installed' run for real."""
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    return str(tmp_path)


def _tpu_detected_in_a_fresh_app(tmp_path, **env):
    """What a fresh app process (its entry point preparing the process) makes of a host whose torch_tpu is an empty
    stand-in: detection, autoload."""
    path = _fake_packages(tmp_path, ["torch_tpu"])
    code = textwrap.dedent("""
        import json, os
        from acceldemo.config import Settings
        from acceldemo.hardware import HardwareRegistry, prepare_process
        prepare_process(Settings.from_env())
        import torch
        found = HardwareRegistry(Settings.from_env()).get("tpu").detect()
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
    found = fresh("neuron").detect()
    assert not found.available and found.reason == "no /dev/neuron* device"


class _Aborting(Hardware):
    name, device = "aborting", "cpu"
    probe_code = "import os; os.abort()"


class _Hanging(Hardware):
    name, device = "hanging", "cpu"
    probe_code = "import time; time.sleep(60)"


def test_a_probe_that_aborts_is_a_reason_not_a_crash():
    found = _Aborting(SETTINGS).detect()
    assert not found.available and "probing aborting failed (exit -6)" in found.reason


def test_a_probe_that_hangs_times_out():
    found = _Hanging(settings_with(probe_timeout_s=1.0)).detect()
    assert not found.available and "did not finish within 1 s (ACCELDEMO_PROBE_TIMEOUT_S)" in found.reason


def test_a_probe_that_raises_gives_the_exception_as_reason():
    class Raising(Hardware):
        name, device = "raising", "cpu"
        probe_code = probe_script("raise RuntimeError('no chip today')")

    found = Raising(SETTINGS).detect()
    assert found == type(found)(False, "RuntimeError: no chip today")


def test_detection_is_probed_once_and_cached():
    hw = fresh("cuda")
    assert hw.detect() is hw.detect()
    assert HARDWARE.best_available() == "cpu" and HARDWARE.best_available() is HARDWARE.best_available()


def test_compile_caches_point_into_the_app_cache_dir_and_operator_values_win(tmp_path):
    code = "import json, os; from acceldemo.config import Settings; from acceldemo.hardware import " \
           "prepare_process; prepare_process(Settings.from_env()); print(json.dumps({k: os.environ.get(k) for k in " \
           "['TORCHINDUCTOR_CACHE_DIR', 'TORCH_NEURONX_NEFF_CACHE_DIR', 'TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT', " \
           "'TRITON_CACHE_DIR']}))"
    ours = {v for adapter in ADAPTERS.values() for v in adapter.cache_env}
    env = {k: v for k, v in os.environ.items() if k not in ours}
    env.update(ACCELDEMO_CACHE_DIR=str(tmp_path), TRITON_CACHE_DIR="/operator/triton")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert json.loads(out.stdout) == {
        "TORCHINDUCTOR_CACHE_DIR": f"{tmp_path}/inductor", "TORCH_NEURONX_NEFF_CACHE_DIR": f"{tmp_path}/neff",
        "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": f"{tmp_path}/tpu", "TRITON_CACHE_DIR": "/operator/triton"}


def test_device_sets_are_written_as_hardware_index():
    assert [str(DeviceSet.parse(t)) for t in ("cpu:0", "cuda:3", "neuron:0-1", "neuron:4,5,6,7", "cuda:0,2")] == \
        ["cpu:0", "cuda:3", "neuron:0-1", "neuron:4-7", "cuda:0,2"]
    assert [DeviceSet.parse(t) for t in ("cuda", "cuda:", "cuda:-1", "cuda:1,1", "CUDA:1", "cuda:a")] == [None] * 6
    assert DeviceSet.parse("neuron:0-3").overlaps(DeviceSet.parse("neuron:3"))
    assert not DeviceSet.parse("neuron:0-3").overlaps(DeviceSet.parse("cuda:0"))


def test_each_adapter_pins_a_process_to_a_device_set_with_its_own_variable():
    group = DeviceSet("x", (4, 5))
    assert HARDWARE.get("cuda").pin_env(group) == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert HARDWARE.get("neuron").pin_env(group) == {"NEURON_RT_VISIBLE_CORES": "4-5"}
    assert HARDWARE.get("tpu").pin_env(group) == {"TPU_VISIBLE_DEVICES": "4,5"}


def test_a_cpu_pool_gets_a_thread_per_core_or_the_persons_omp_num_threads_if_fewer(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert HARDWARE.get("cpu").pin_env(DeviceSet("cpu", (0,))) == {"OMP_NUM_THREADS": str(cores)}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert HARDWARE.get("cpu").pin_env(DeviceSet("cpu", (0,))) == {"OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    assert HARDWARE.get("cpu").pin_env(DeviceSet("cpu", (0,))) == {"OMP_NUM_THREADS": str(cores)}


def test_a_neuron_rank_owns_its_core_of_the_pools_group(monkeypatch):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-7")  # what the pool's pinning gave every rank
    HARDWARE.get("neuron").prepare_rank(1, DeviceSet("neuron", (4, 5, 6, 7)))
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "5"


def test_a_cpu_rank_shares_its_devices_cores_without_oversubscribing_them(monkeypatch):
    import torch

    threads, cores = torch.get_num_threads(), os.sched_getaffinity(0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        HARDWARE.get("cpu").prepare_rank(0, DeviceSet("cpu", (0,)))
        assert os.sched_getaffinity(0) == cores and torch.get_num_threads() == max(1, len(cores) // 2)
    finally:
        torch.set_num_threads(threads)


def test_the_cpu_is_one_device_of_all_its_cores_and_tensor_parallel_ranks_share_it():
    cpu = HARDWARE.get("cpu")
    (device,) = cpu.devices()
    assert str(device) == "cpu:0" and device.detail.startswith("cores ") and device.memory_bytes > 0
    assert cpu.device_sets(1) == cpu.device_sets(4) == [DeviceSet("cpu", (0,))]
    assert cpu.in_process(DeviceSet("cpu", (0,))) and cpu.torch_device(DeviceSet("cpu", (0,))) == "cpu"


def test_an_accelerator_lists_its_devices_and_groups_them_for_tensor_parallelism():
    neuron = fresh("neuron")
    neuron._detected = Availability(True, "8 NeuronCores", 8, 24 * GiB)
    assert [str(d) for d in neuron.devices()] == [f"neuron:{i}" for i in range(8)]
    assert [str(s) for s in neuron.device_sets(4)] == ["neuron:0-3", "neuron:4-7"]
    assert neuron.device_sets(16) == []
    # The process drives only its own first device; others get a worker pinned to them.
    assert neuron.in_process(DeviceSet("neuron", (0,))) and not neuron.in_process(DeviceSet("neuron", (1,)))
    assert neuron.torch_device(DeviceSet("neuron", (0,))) == "neuron"
    cuda = fresh("cuda")
    cuda._detected = Availability(True, "2 x H200", 2, 141 * GiB)
    assert cuda.in_process(DeviceSet("cuda", (1,))) and cuda.torch_device(DeviceSet("cuda", (1,))) == "cuda:1"


def test_a_tpu_host_has_one_tensor_parallel_group_from_chip_0():
    # In a torchrun rank torch-tpu sets TPU_VISIBLE_DEVICES to the local rank itself (checked against the real wheel
    # in test_torch_tpu_conformance.py): a pool on chips 4-7 would run on chips 0-3.
    tpu = fresh("tpu")
    tpu._detected = Availability(True, "8 x TPU v6e", 8, 32 * GiB, "TPU v6e")
    assert [str(s) for s in tpu.device_sets(4)] == ["tpu:0-3"]
    assert [str(s) for s in tpu.device_sets(1)] == [f"tpu:{i}" for i in range(8)]
