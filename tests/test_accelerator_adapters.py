"""The neuron and tpu adapters make the recipe's exact calls, through the real engine.

Each accelerator runs in a child process where it is a fake torch device (tests/fakes), its
package is a stand-in that records what it saw, and its compile backend, under the real
name, records every graph. The only app code patched is `detect()`: this host has no
Trainium or TPU to find. Everything between a GenerateParams and the pipeline call is the
app's own: validation, the engine, LocalExecutor, apply_recipe, run_pipeline.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from acceldemo.hardware import ADAPTERS
from tests.fakes.fake_process import run_in_fake_device_process
from tests.fakes.standin_packages import SIMULATED_TPUS, python_path, write_torch_neuronx, write_torch_tpu

pytestmark = pytest.mark.heavy  # outside the quick tier (scripts/test.sh --fast); run in CI

# The variables the app's entry point points into its cache dir. Each child gets its own cache dir,
# so it must not inherit the values this test process already set.
CACHE_VARIABLES = sorted({variable for adapter in ADAPTERS.values() for variable in adapter.cache_env})
RECIPE_COMPILE_ARGUMENTS = {"fullgraph": True, "dynamic": False}
# Float32 tiny pipelines on the fake device match CPU within 1e-4 (tests/test_fakes.py), so the
# 8-bit images may differ by a rounding step.
PIXEL_TOLERANCE = 2

# Shared by both children: the app loaded, one helper that runs a request and reports what it did.
_APP_UNDER_TEST = """
import os, sys

for variable in CACHE_VARIABLES:
    os.environ.pop(variable, None)
os.environ.pop("NEURON_RT_VISIBLE_CORES", None)
from acceldemo.config import Settings
from acceldemo.hardware import Availability, prepare_process

prepare_process(Settings.from_env())  # first, as app.py does: it points the compile caches at ACCELDEMO_CACHE_DIR

import diffusers
import numpy as np

from acceldemo.errors import AcceldemoError
from acceldemo.records import GenerateParams, Shape
from tests.engines import new_manager
from tests.fakes.recipe_spies import spy_on_recipe_calls
from tests.fakes.recording_backend import register_recording_backend

manager = new_manager()


def graphs():
    # The backend exists once the app has imported the package (it registers it, as the real one does).
    return register_recording_backend(HARDWARE_NAME) if PACKAGE in sys.modules else []


def visit(name, **fields):
    # One request through the session manager; what it did goes into `visits[name]`.
    request = GenerateParams(**{"prompt": "a red fox in the snow", "steps": 2, "resolution": "64x64", "seed": 0,
                                **fields})
    before = {key: len(value) for key, value in calls.items()}
    graphs_before = len(graphs())
    try:
        result = manager.generate(request)
    except AcceldemoError as error:
        visits[name] = {"error": type(error).__name__, "message": str(error),
                        "calls": {key: value[before[key]:] for key, value in calls.items()}}
        return None
    recorded = graphs()[graphs_before:]
    visits[name] = {
        "calls": {key: value[before[key]:] for key, value in calls.items()},
        "new_graphs": result.new_graphs, "warm": result.warm, "placement": str(result.key.placement),
        "recorded_graphs": len(recorded),
        "graph_input_devices": sorted({d for g in recorded for d in g.input_device_types}),
        "image_size": list(result.image.size),
    }
    return np.asarray(result.image, dtype=np.int16)


visits = {}
"""

NEURON_CHILD = _APP_UNDER_TEST + """
from acceldemo.hardware.neuron import NeuronHardware

# The one patch of app code: this host has no /dev/neuron* to find.
NeuronHardware.detect = lambda self: Availability(True, "1 fake NeuronCore", 1, 24 * 2**30)
calls = spy_on_recipe_calls((diffusers.Flux2Transformer2DModel, diffusers.FluxTransformer2DModel))
imported_before_first_request = PACKAGE in sys.modules

klein = dict(hardware="neuron", model="tiny-flux2-klein")
visit("compiled first", mode="compiled", **klein)
visit("compiled again", mode="compiled", **klein)
visit("compiled new shape", mode="compiled", resolution="128x128", **klein)
visit("regional", mode="regional", **klein)
flux1 = dict(hardware="neuron", model="tiny-flux1", placement="offload")
visit("offload eager", mode="eager", **flux1)
visit("offload regional", mode="regional", **flux1)
loads_before_refusal = manager.snapshot().counters.loads
visit("offload compiled", mode="compiled", **flux1)

from acceldemo.records import DeviceSet
manager.hardware.get("neuron").prepare_rank(3, DeviceSet("neuron", tuple(range(8, 16))))
result = {
    "visits": visits,
    "imported_before_first_request": imported_before_first_request,
    "neff_cache_dir_at_import": sys.modules[PACKAGE].NEFF_CACHE_DIR_AT_IMPORT,
    "loads_for_refused_request": manager.snapshot().counters.loads - loads_before_refusal,
    "visible_cores_of_rank_3": os.environ.get("NEURON_RT_VISIBLE_CORES"),
}
"""

TPU_CHILD = _APP_UNDER_TEST + """
import torch.distributed

from acceldemo.hardware.tpu import TpuHardware

# The one patch of app code: this host has no TPU chip to find.
TpuHardware.detect = lambda self: Availability(True, "1 fake TPU chip", 1, 32 * 2**30)
calls = spy_on_recipe_calls(
    (diffusers.Flux2Transformer2DModel,),
    eager_mode=lambda: sys.modules[PACKAGE].active_eager_mode() if PACKAGE in sys.modules else None)
imported_before_first_request = PACKAGE in sys.modules

size = dict(model="tiny-flux2-klein", resolution="96x64")
on_cpu = visit("cpu eager", hardware="cpu", mode="eager", **size)
difference = {}
for mode in ("eager", "eager-fused", "compiled"):
    on_tpu = visit(mode, hardware="tpu", mode=mode, **size)
    difference[mode] = None if on_tpu is None or on_cpu is None else int(np.abs(on_tpu - on_cpu).max())

result = {
    "visits": visits,
    "difference_to_cpu": difference,
    "imported_before_first_request": imported_before_first_request,
    "compilation_cache_root": sys.modules[PACKAGE].COMPILATION_CACHE_ROOT,
    "tpu_dist_registered": "tpu_dist" in torch.distributed.Backend.backend_list,
}
"""


def _run_child(device: str, package: str, code: str, tmp: Path, write_standin, **host: str) -> dict[str, Any]:
    cache = tmp / "cache"
    prelude = f"CACHE_VARIABLES = {CACHE_VARIABLES!r}\nHARDWARE_NAME = {device!r}\nPACKAGE = {package!r}\n"
    env = {"ACCELDEMO_CACHE_DIR": str(cache), "PYTHONPATH": python_path(write_standin(tmp / "site")),
           "OMP_NUM_THREADS": "1", **host}
    found = run_in_fake_device_process(device, prelude + code, env=env, timeout_s=300)
    return {**found, "cache_dir": str(cache)}


@pytest.fixture(scope="module")
def children(tmp_path_factory) -> dict[str, Future]:
    """Both fake-device processes, started together: each takes one core for its ~15 s."""
    with ThreadPoolExecutor(2) as pool:
        yield {
            "neuron": pool.submit(_run_child, "neuron", "torch_neuronx", NEURON_CHILD,
                                  tmp_path_factory.mktemp("neuron"), write_torch_neuronx),
            # One simulated chip, as the fake device has one.
            "tpu": pool.submit(_run_child, "tpu", "torch_tpu", TPU_CHILD, tmp_path_factory.mktemp("tpu"),
                               write_torch_tpu, **{SIMULATED_TPUS: "v6e:1"}),
        }


@pytest.fixture(scope="module")
def on_neuron(children) -> dict[str, Any]:
    return children["neuron"].result()


@pytest.fixture(scope="module")
def on_tpu(children) -> dict[str, Any]:
    return children["tpu"].result()


def ran(child: dict[str, Any], name: str) -> dict[str, Any]:
    """What the child's visit `name` did; it must have produced an image."""
    visit = child["visits"][name]
    assert "error" not in visit, visit["message"]
    return visit


def by_app(visit: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """The calls of one kind the app made itself (not diffusers re-arming offload or compiling blocks)."""
    return [{k: v for k, v in c.items() if k != "caller"} for c in visit["calls"][kind]
            if c["caller"].startswith("acceldemo.")]


def compile_call(module: str, backend: str) -> dict[str, Any]:
    return {"module": module, "args": [], "kwargs": {"backend": backend, **RECIPE_COMPILE_ARGUMENTS}}


MOVE_TO = {"neuron": {"args": ["neuron"], "kwargs": {}}, "tpu": {"args": ["tpu"], "kwargs": {}}}
OFFLOAD_FINDING_THE_DEVICE = {"args": [], "kwargs": {}, "device": "neuron:0"}


# --- Trainium (neuron) ---------------------------------------------------------------------------


def test_neuron_package_is_imported_by_the_app_with_the_neff_cache_in_the_app_cache_dir(on_neuron):
    # Autoload is off in the child, so only the app's own Hardware.activate() can have imported it.
    assert not on_neuron["imported_before_first_request"]
    assert on_neuron["neff_cache_dir_at_import"] == f"{on_neuron['cache_dir']}/neff"


def test_neuron_whole_pipeline_is_moved_to_the_neuron_device(on_neuron):
    first = ran(on_neuron, "compiled first")
    assert first["placement"] == "device"
    assert by_app(first, "pipeline_to") == [MOVE_TO["neuron"]]
    assert first["calls"]["offload"] == []
    transformer_calls = first["calls"]["transformer_calls"]
    assert len(transformer_calls) == 2  # one per step
    assert {(c["weights"], c["hidden_states"]) for c in transformer_calls} == {("neuron", "neuron")}


def test_neuron_compiled_mode_compiles_the_transformer_with_the_recipe_arguments(on_neuron):
    first = ran(on_neuron, "compiled first")
    assert by_app(first, "compile") == [compile_call("Flux2Transformer2DModel", "neuron")]
    assert len(first["calls"]["compile"]) == 1 and first["calls"]["compile_repeated_blocks"] == []
    assert first["recorded_graphs"] == 1 and first["new_graphs"] == 1
    assert first["graph_input_devices"] == ["neuron"]


def test_neuron_second_visit_to_a_shape_compiles_nothing_and_a_new_shape_compiles_once(on_neuron):
    again, new_shape = ran(on_neuron, "compiled again"), ran(on_neuron, "compiled new shape")
    assert again["recorded_graphs"] == 0 and again["new_graphs"] == 0 and again["warm"]
    assert again["calls"]["compile"] == [] and again["calls"]["pipeline_to"] == []
    assert new_shape["recorded_graphs"] == 1 and new_shape["new_graphs"] == 1 and not new_shape["warm"]
    assert new_shape["calls"]["compile"] == []
    assert new_shape["graph_input_devices"] == ["neuron"]
    assert new_shape["image_size"] == [128, 128]


def test_neuron_regional_mode_compiles_the_repeated_blocks_with_the_recipe_arguments(on_neuron):
    regional = ran(on_neuron, "regional")
    assert by_app(regional, "pipeline_to") == [MOVE_TO["neuron"]]
    assert by_app(regional, "compile_repeated_blocks") == [compile_call("Flux2Transformer2DModel", "neuron")]
    assert by_app(regional, "compile") == []
    # diffusers hands the same arguments to each repeated block's own compile; the transformer stays eager.
    blocks = regional["calls"]["compile"]
    assert {c["module"] for c in blocks} == {"Flux2TransformerBlock", "Flux2SingleTransformerBlock"}
    assert all(c["kwargs"] == compile_call("", "neuron")["kwargs"] for c in blocks)
    assert regional["recorded_graphs"] >= 2 and regional["new_graphs"] == regional["recorded_graphs"]
    assert regional["graph_input_devices"] == ["neuron"]


def test_neuron_offload_lets_diffusers_find_the_device(on_neuron):
    eager = ran(on_neuron, "offload eager")
    assert eager["placement"] == "offload"
    # No device argument (that is CPU's workaround): diffusers finds the neuron device itself.
    assert by_app(eager, "offload") == [OFFLOAD_FINDING_THE_DEVICE]
    assert by_app(eager, "pipeline_to") == []
    assert {c["hidden_states"] for c in eager["calls"]["transformer_calls"]} == {"neuron"}
    assert eager["image_size"] == [64, 64]


def test_neuron_regional_mode_works_with_offload(on_neuron):
    regional = ran(on_neuron, "offload regional")
    assert by_app(regional, "offload") == [OFFLOAD_FINDING_THE_DEVICE]
    assert by_app(regional, "compile_repeated_blocks") == [compile_call("FluxTransformer2DModel", "neuron")]
    assert by_app(regional, "compile") == []
    # The offload hook moves the weights onto the device before the blocks' graphs run.
    assert regional["recorded_graphs"] >= 2 and regional["new_graphs"] == regional["recorded_graphs"]
    assert regional["graph_input_devices"] == ["neuron"]
    assert regional["image_size"] == [64, 64]


def test_neuron_compiled_mode_with_offload_is_refused_before_anything_loads(on_neuron):
    refused = on_neuron["visits"]["offload compiled"]
    assert refused["error"] == "UnsupportedCombination"
    assert refused["message"] == ("mode 'compiled' is not possible here: offload hooks cannot be traced: "
                                  "with offload only regional or eager")
    assert on_neuron["loads_for_refused_request"] == 0
    assert refused["calls"]["compile"] == [] and refused["calls"]["offload"] == []


def test_neuron_rank_owns_the_core_of_its_local_rank_in_its_pools_group(on_neuron):
    assert on_neuron["visible_cores_of_rank_3"] == "11"  # local rank 3 of a pool on neuron:8-15


# --- TPU -----------------------------------------------------------------------------------------


def test_tpu_device_is_started_by_the_app_through_the_package_loader_with_autoload_off(on_tpu):
    # Importing torch_tpu starts no device; the app ran the package's torch.backends entry point itself.
    assert not on_tpu["imported_before_first_request"]
    assert on_tpu["tpu_dist_registered"]


def test_tpu_compilation_cache_the_package_reads_at_its_first_compile_is_in_the_app_cache_dir(on_tpu):
    assert on_tpu["compilation_cache_root"] == f"{on_tpu['cache_dir']}/tpu"


@pytest.mark.parametrize("mode, eager_mode", [("eager", "DEFER_NEVER"), ("eager-fused", "DEFER_AND_FUSE")])
def test_tpu_eager_modes_run_every_transformer_call_in_their_eager_mode(on_tpu, mode, eager_mode):
    visit = ran(on_tpu, mode)
    assert by_app(visit, "pipeline_to") == [MOVE_TO["tpu"]]
    assert visit["calls"]["compile"] == [] and visit["recorded_graphs"] == 0
    transformer_calls = visit["calls"]["transformer_calls"]
    assert len(transformer_calls) == 2  # one per step
    assert {(c["eager_mode"], c["weights"], c["hidden_states"]) for c in transformer_calls} == {
        (eager_mode, "tpu", "tpu")}


def test_tpu_compiled_mode_compiles_the_transformer_with_the_recipe_arguments(on_tpu):
    compiled = ran(on_tpu, "compiled")
    assert by_app(compiled, "pipeline_to") == [MOVE_TO["tpu"]]
    assert by_app(compiled, "compile") == [compile_call("Flux2Transformer2DModel", "tpu")]
    assert compiled["recorded_graphs"] == 1 and compiled["new_graphs"] == 1
    assert compiled["graph_input_devices"] == ["tpu"]


@pytest.mark.parametrize("mode", ["eager", "eager-fused", "compiled"])
def test_tpu_images_have_the_asked_size_and_paint_what_cpu_paints(on_tpu, mode):
    assert ran(on_tpu, "cpu eager")["image_size"] == [96, 64]
    assert ran(on_tpu, mode)["image_size"] == [96, 64]
    assert on_tpu["difference_to_cpu"][mode] <= PIXEL_TOLERANCE
