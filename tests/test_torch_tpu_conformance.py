"""The TPU adapter and the torch_tpu stand-in against torch-tpu 0.2.0, the real wheel from PyPI.

The wheel and libtpu go into an environment of their own (tests/tpu_wheel/environment.py, built once per machine).
Every Python process of that environment, whether these tests or the adapter start it (probes, launch-env children),
runs on a simulated host: ACCELDEMO_TEST_SIMULATED_TPUS ("v6e:4") gives torch_tpu's own PCI scan a bus with those
chips (tests/tpu_wheel/site). Everything else is the real package. With no chip to claim, nothing here starts the
TPU runtime, except the tests that say so: there the runtime sets up its environment and then aborts, and the
environment it set up is what they read. Leave the group out with -m "not tpu_wheel".
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from acceldemo.hardware.base import GiB
from acceldemo.hardware.tpu import TENSOR_PARALLEL_SIZES
from tests.fakes.fake_process import REPO_ROOT
from tests.fakes.standin_packages import SIMULATED_TPUS, python_path, write_torch_tpu
from tests.tpu_wheel import environment

pytestmark = pytest.mark.tpu_wheel

_RESULT = "CONFORMANCE-RESULT:"
_BOOTSTRAP = f"""
import json, sys
namespace = {{"__name__": "__conformance__"}}
exec(compile(sys.stdin.read(), "<conformance-code>", "exec"), namespace)
print({_RESULT!r} + json.dumps(namespace.get("result")), flush=True)
"""

# Detection through the adapter, as the app does it: the entry point prepares the process first, then the probe in a
# child process.
DETECTED = """
import os, sys
from acceldemo.config import Settings
from acceldemo.hardware import HardwareRegistry, prepare_process
prepare_process(Settings.from_env())
from acceldemo.errors import AcceldemoError

tpu = HardwareRegistry(Settings.from_env()).get("tpu")
found = tpu.detect()
result = {"detected": [found.available, found.reason, found.device_count, found.memory_bytes, found.generation],
          "tensor_parallel_sizes": tpu.tensor_parallel_sizes()}
"""

# What a process sees of torch_tpu after `import torch` (and `import torch_tpu` with backend autoload off), and after
# the adapter's activate(): the same code runs against the real package and the stand-in.
FACTS = """
import importlib.metadata, os, warnings
import torch
if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "1":
    import torch_tpu
import torch._dynamo
import torch.distributed
from acceldemo.config import Settings
from acceldemo.errors import AcceldemoError
from acceldemo.hardware import HardwareRegistry


def registered():
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return {"compile backend tpu": "tpu" in torch._dynamo.list_backends(exclude_tags=()),
            "process-group backend tpu_dist": "tpu_dist" in torch.distributed.Backend.backend_list,
            "accelerator": accelerator and accelerator.type}


facts = {"after import": registered()}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    block = torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)
    with block:
        inside = torch.tpu.eager_mode.name
facts["eager modes"] = [mode.name for mode in torch.tpu.EagerMode]
facts["set_eager_mode block"] = {"a context manager": hasattr(block, "__enter__") and hasattr(block, "__exit__"),
                                 "inside": inside, "after": torch.tpu.eager_mode.name}
facts["experimental warning"] = any("experimental" in str(w.message) for w in caught)
facts["torch.backends entry points"] = [e.name for e in importlib.metadata.entry_points(group="torch.backends")]
try:
    HardwareRegistry(Settings.from_env()).get("tpu").activate()
    facts["activate refused"] = None
except AcceldemoError as error:
    facts["activate refused"] = str(error)
facts["after activate"] = registered()
result = {**globals().get("result", {}), "facts": facts}
"""

# The adapter's eager modes; the compilation cache variable in the process's C environment after the app prepared it
# and torch, and the torch_tpu libraries that name it. Its runtime reads it once, when the cache is first used, which
# needs a chip: the value the runtime would find, and that it looks for this name, is what can be seen here.
MODES_AND_CACHE = """
import ctypes, glob
from pathlib import Path

entered = {}
for mode in tpu.modes:
    with tpu.mode_context(mode):
        entered[mode] = torch.tpu.eager_mode.name
cache = "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
package = os.path.dirname(sys.modules["torch_tpu"].__file__)
glue = "glue_" + torch.__version__.split("+")[0].replace(".", "_")
readers = [os.path.relpath(library, package) for library in glob.glob(f"{package}/csrc/**/{glue}/*.so", recursive=True)
           if cache.encode() in Path(library).read_bytes()]
result.update(eager_mode_in=entered, eager_mode_after=torch.tpu.eager_mode.name,
              cache_root=libc.getenv(cache.encode()).decode(), cache_root_readers=readers)
"""

NO_LAUNCH_ENV = """
try:
    tpu.launcher_env(4)
except AcceldemoError as error:
    result["launcher_env(4)"] = str(error)
"""

# Every tp_size a person can ask for, through validation and, where it passes, the adapter's launch env; what the
# placement proposal picks; and what torch-tpu's launcher itself accepts and its generation tables say.
SIZES = """
from acceldemo.config import Settings
from acceldemo.engine.validation import check_placement, check_request, propose_placement, tensor_parallel_options
from acceldemo.hardware import HardwareRegistry
from acceldemo.models.catalog import CATALOG
from acceldemo.records import GenerateParams, Placement

launch_env, refused = {}, {}
for size in range(2, 65):  # what the page's number field and the CLI's --tp can send
    try:
        check_placement(CATALOG["flux2-dev"], tpu, Placement.TP, size)
    except AcceldemoError as error:
        refused[size] = str(error)
    else:
        launch_env[size] = tpu.launcher_env(size)
offered = tensor_parallel_options(CATALOG["flux2-dev"], tpu)  # the page's choices
proposed = {name: [str(p.placement), p.tp_size] for name, spec in CATALOG.items()
            for p in [propose_placement(spec, found, tpu.tensor_parallel_sizes())]}
try:
    check_request(GenerateParams(prompt="a red fox", hardware="tpu", model="flux2-dev", placement="tp", tp_size=2),
                  Settings.from_env(), HardwareRegistry(Settings.from_env()))
except AcceldemoError as error:
    request_refused = f"{type(error).__name__}: {error}"

import torch.tpu.distributed
from torch_tpu._internal import env_utils
from torch_tpu._internal.utils import hardware

launcher = {}
for size in range(1, 17):
    saved = dict(os.environ)
    try:
        torch.tpu.distributed.set_tpu_launch_env(nproc_per_node=size)
        launcher[size] = os.environ["TORCH_TPU_TOPOLOGY"]
    except Exception as error:
        launcher[size] = f"{type(error).__name__}: {error}"
    finally:
        os.environ.clear()
        os.environ.update(saved)
        env_utils._resolved_values.clear()  # else set_tpu_launch_env hands back the first size's values
result.update(launch_env=launch_env, refused=refused, offered=offered, proposed=proposed,
              request_refused=request_refused,
              launcher=launcher,
              topology_tables={hardware._PCI_DEVICE_ID_TO_NAME[device]: dict(table)
                               for device, table in hardware._TOPOLOGY_BY_TPU_PCI_DEVICE_ID.items()})
"""

DETECTED_THEN_TORCH = DETECTED + """
result["autoload"] = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD")
import torch  # survives: the process is still here to report
"""

# Which chips a process uses: a rank as torchrun starts it for a 4-chip pool on chips 4-7 (its launch env from the
# adapter), and a lone process pinned the same way. Each starts the TPU runtime, which sets its variables, finds no
# chip and aborts; RECORDER, where a C compiler built it, logs every setenv() the process makes.
RUNTIME = """
import subprocess
rank = {**launch_env[4], "LOCAL_RANK": "3", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "localhost", "MASTER_PORT": "29555"}
starts_the_runtime = "import torch; print('COUNT', torch.accelerator.device_count(), flush=True); torch.zeros(1, device='tpu')"
runtime = {}
alone_in_a_pool = {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "localhost", "MASTER_PORT": "29556"}
for name, extra in (("rank 3 of 4", rank), ("a lone process", {}), ("the rank of a one-rank pool", alone_in_a_pool)):
    # TPU_SKIP_MDS_QUERY: the runtime would ask the cloud metadata server for what the host does not say, for minutes.
    env = {**os.environ, **extra, "TPU_VISIBLE_DEVICES": "4,5,6,7", "TPU_SKIP_MDS_QUERY": "1",
           **({"LD_PRELOAD": RECORDER} if RECORDER else {})}
    done = subprocess.run([sys.executable, "-c", starts_the_runtime], env=env, capture_output=True, text=True,
                          timeout=300)
    runtime[name] = {"exit": done.returncode,
                     "device count": [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("COUNT ")],
                     "setenv": [line.split(" ", 1)[1] for line in done.stderr.splitlines() if line.startswith("SETENV ")]}
result["runtime"] = runtime
"""

_SETENV_RECORDER = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
int setenv(const char *name, const char *value, int overwrite) {
  static int (*real)(const char *, const char *, int);
  if (!real) real = (int (*)(const char *, const char *, int))dlsym(RTLD_NEXT, "setenv");
  fprintf(stderr, "SETENV %s=%s\n", name, value);
  return real(name, value, overwrite);
}
"""


def _no_core_dumps() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _run(python: Path | str, code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-c", _BOOTSTRAP], input=textwrap.dedent(code), capture_output=True,
                          text=True, timeout=600, cwd=REPO_ROOT, env=env, preexec_fn=_no_core_dumps)


def _result(done: subprocess.CompletedProcess) -> dict[str, Any]:
    for line in reversed(done.stdout.splitlines()):
        if done.returncode == 0 and line.startswith(_RESULT):
            return json.loads(line[len(_RESULT):])
    raise AssertionError(f"exit {done.returncode}\n--- stdout ---\n{done.stdout[-4000:]}\n"
                         f"--- stderr ---\n{done.stderr[-4000:]}")


def _real_env(host: str, cache: Path, **extra: str) -> dict[str, str]:
    """A process of the wheel's environment on `host`, with nothing of this test process's settings."""
    kept = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    return {**kept, "PYTHONPATH": f"{environment.SIMULATION}:{REPO_ROOT}", SIMULATED_TPUS: host,
            "ACCELDEMO_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", **extra}


AUTOLOAD_OFF = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
# The four hosts the stand-in is compared on: with chips or none, backend autoload on or off.
SCENARIOS = {"v6e:4, autoload on": ("v6e:4", {}), "v6e:4, autoload off": ("v6e:4", AUTOLOAD_OFF),
             "no chip, autoload on": ("v6e:0", {}), "no chip, autoload off": ("v6e:0", AUTOLOAD_OFF)}


@pytest.fixture(scope="module")
def wheel_python() -> Path:
    return environment.ensure()


@pytest.fixture(scope="module")
def setenv_recorder(tmp_path_factory) -> Path | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    folder = tmp_path_factory.mktemp("recorder")
    (folder / "recorder.c").write_text(_SETENV_RECORDER)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(folder / "recorder.so"), str(folder / "recorder.c"),
                    "-ldl"], check=True)
    return folder / "recorder.so"


@pytest.fixture(scope="module")
def runs(wheel_python, setenv_recorder, tmp_path_factory) -> dict[str, Future]:
    """Every process of the group, started at once and run two at a time; a test waits for the ones it reads."""
    def real(code: str, host: str, extra: dict[str, str]) -> dict[str, Any]:
        return _result(_run(wheel_python, code, _real_env(host, tmp_path_factory.mktemp("cache"), **extra)))

    def standin(host: str, extra: dict[str, str]) -> dict[str, Any]:
        folder = tmp_path_factory.mktemp("standin")
        library = folder / "libtpu.so"  # keeps prepare_process from turning autoload off: libtpu is "there"
        library.write_bytes(b"")
        env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
        env.update(PYTHONPATH=python_path(write_torch_tpu(folder / "site")), TPU_LIBRARY_PATH=str(library),
                   ACCELDEMO_CACHE_DIR=str(folder / "cache"), **{SIMULATED_TPUS: host}, **extra)
        return _result(_run(sys.executable, FACTS, env))

    without_package = {"ACCELDEMO_TEST_WITHOUT_LIBTPU_PACKAGE": "1"}
    library = str(next(environment.location().glob("lib/python*/site-packages/libtpu/libtpu.so")))
    recorder = f"RECORDER = {setenv_recorder and str(setenv_recorder)!r}\n"
    # Few processes, each asking much: every one imports torch with torch_tpu (seconds), and so does each probe.
    scenario_code = {"v6e:4, autoload on": DETECTED + FACTS + MODES_AND_CACHE + SIZES, "v6e:4, autoload off":
                    DETECTED + FACTS, "no chip, autoload on": DETECTED + FACTS + NO_LAUNCH_ENV, "no chip, autoload off": FACTS}
    jobs = {  # the longest first, so that the others run beside it
        "v6e:8": (recorder + DETECTED + SIZES + RUNTIME, "v6e:8", {}),
        **{name: (code, *SCENARIOS[name]) for name, code in scenario_code.items()},
        "libtpu at TPU_LIBRARY_PATH": (DETECTED_THEN_TORCH, "v6e:4", {**without_package, "TPU_LIBRARY_PATH": library}),
        "no libtpu": (DETECTED_THEN_TORCH, "v6e:4", without_package),
        "TPU_LIBRARY_PATH to no file": (DETECTED_THEN_TORCH, "v6e:4", {"TPU_LIBRARY_PATH": "/nowhere/libtpu.so"}),
    }
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(real, code, host, extra) for name, (code, host, extra) in jobs.items()}
        futures.update({f"stand-in, {name}": pool.submit(standin, host, extra)
                        for name, (host, extra) in SCENARIOS.items()})
        yield futures


def ran(runs: dict[str, Future], name: str) -> dict[str, Any]:
    return runs[name].result()


def by_size(mapping: dict[str, Any]) -> dict[int, Any]:
    return {int(size): value for size, value in mapping.items()}


# --- the simulated host and detection ----------------------------------------------------------------------------


@pytest.mark.parametrize("run, chips", [("v6e:4, autoload on", 4), ("v6e:4, autoload off", 4), ("v6e:8", 8)])
def test_a_v6e_host_is_detected_with_its_chips_memory_and_generation(runs, run, chips):
    assert ran(runs, run)["detected"] == [True, f"{chips} x TPU v6e", chips, 32 * GiB, "TPU v6e"]
    assert ran(runs, run)["tensor_parallel_sizes"] == [1, 4, 8]


def test_a_host_without_chips_is_reported_with_the_reason(runs):
    assert ran(runs, "no chip, autoload on")["detected"] == [False, "torch_tpu is installed but finds no TPU chip", 0, 0, ""]
    assert ran(runs, "no chip, autoload on")["tensor_parallel_sizes"] is None


# --- what importing torch_tpu and its loader register ------------------------------------------------------------


def test_the_compile_backend_is_registered_at_import_and_tpu_dist_only_where_the_loader_finds_a_chip(runs):
    assert ran(runs, "v6e:4, autoload on")["facts"]["after import"] == {
        "compile backend tpu": True, "process-group backend tpu_dist": True, "accelerator": "tpu"}
    assert ran(runs, "no chip, autoload on")["facts"]["after import"] == {
        "compile backend tpu": True, "process-group backend tpu_dist": False, "accelerator": None}


def test_with_autoload_off_importing_torch_tpu_starts_nothing_and_the_adapter_runs_its_loader(runs):
    facts = ran(runs, "v6e:4, autoload off")["facts"]
    assert facts["after import"] == {
        "compile backend tpu": True, "process-group backend tpu_dist": False, "accelerator": None}
    assert facts["activate refused"] is None
    assert facts["after activate"] == {
        "compile backend tpu": True, "process-group backend tpu_dist": True, "accelerator": "tpu"}


def test_with_autoload_off_on_a_host_without_chips_activate_says_why(runs):
    facts = ran(runs, "no chip, autoload off")["facts"]
    assert facts["activate refused"] == ("hardware 'tpu' is not available here: torch_tpu's loader (its "
                                         "torch.backends entry point) found no TPU chip")
    assert facts["after activate"]["accelerator"] is None


def test_eager_mode_has_four_members_set_eager_mode_is_a_block_and_both_warn_they_are_experimental(runs):
    facts = ran(runs, "no chip, autoload on")["facts"]
    assert facts["eager modes"] == ["DEFER_AND_FUSE", "DEFER_NEVER", "DEFER_NEVER_AND_LAUNCH_BLOCKING",
                                    "_INTERNAL_COMPILE_FX_GRAPH"]
    assert facts["set_eager_mode block"] == {"a context manager": True, "inside": "DEFER_AND_FUSE",
                                             "after": "DEFER_NEVER"}
    assert facts["experimental warning"]


def test_each_mode_runs_in_its_eager_mode_and_leaves_the_default_after(runs):
    chip = ran(runs, "v6e:4, autoload on")
    assert chip["eager_mode_in"] == {"eager": "DEFER_NEVER", "eager-fused": "DEFER_AND_FUSE",
                                     "compiled": "DEFER_NEVER", "regional": "DEFER_NEVER"}
    assert chip["eager_mode_after"] == "DEFER_NEVER"


def test_the_compilation_cache_is_in_the_app_cache_dir_under_the_name_torch_tpus_runtime_reads(runs):
    chip = ran(runs, "v6e:4, autoload on")
    # prepare_process set it before torch loaded torch_tpu; the runtime reads it at its first compile.
    assert Path(chip["cache_root"]).name == "tpu" and Path(chip["cache_root"]).parent.name.startswith("cache")
    assert chip["cache_root_readers"] == ["csrc/common/glue_2_13_0/libpywrap_2_13_0_common.so"]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_standin_registers_and_starts_what_the_real_package_does(runs, scenario):
    assert ran(runs, f"stand-in, {scenario}")["facts"] == ran(runs, scenario)["facts"]


# --- tensor parallel: sizes and launch environment ---------------------------------------------------------------


def test_the_adapters_tensor_parallel_sizes_are_torch_tpus_topology_tables(runs):
    tables = ran(runs, "v6e:8")["topology_tables"]
    assert {name: tuple(sorted(map(int, table))) for name, table in tables.items()} == TENSOR_PARALLEL_SIZES


def test_torch_tpus_launcher_accepts_exactly_the_sizes_of_the_generation(runs):
    launcher = by_size(ran(runs, "v6e:8")["launcher"])
    assert {size for size, topology in launcher.items() if "Error" not in topology} == {1, 4, 8}
    assert launcher[2] == "RuntimeError: No TPU topology found for count: 2"
    # It checks the table only, not the chips: 8 processes pass on a 4-chip host (validation refuses them).
    assert by_size(ran(runs, "v6e:4, autoload on")["launcher"])[8] == "2,4,1"


@pytest.mark.parametrize("run, accepted", [("v6e:8", {4, 8}), ("v6e:4, autoload on", {4})])
def test_every_size_validation_accepts_gets_its_launch_env_from_set_tpu_launch_env(runs, run, accepted):
    found = ran(runs, run)
    tables = found["topology_tables"]["TPU v6e"]
    launch_env = by_size(found["launch_env"])
    assert set(launch_env) == accepted
    for size, env in launch_env.items():
        assert set(env) == {"TORCH_TPU_TOPOLOGY", "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_XPROF_SESSION_ID"}
        assert env["TORCH_TPU_TOPOLOGY"] == tables[str(size)]
        addresses = env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
        assert len(addresses) == size and all(a.startswith("localhost:") for a in addresses)
        assert env["TORCH_TPU_XPROF_SESSION_ID"].isdigit()


def test_sizes_the_launcher_refuses_are_refused_by_validation_naming_the_sizes_that_work(runs):
    refused = by_size(ran(runs, "v6e:8")["refused"])
    assert set(refused) == set(range(2, 65)) - {4, 8}
    assert refused[2] == "tp_size=2 is not accepted: TPU v6e runs tensor parallel on 1, 4 or 8 chips — 2 is not one of them"
    # FLUX.2-dev shards heads of 48, 32 and 8: the sizes the launcher refuses beyond 2 fail on the heads first.
    assert refused[16] == ("tp_size=16 is not accepted: a divisor of the 8 text encoder key/value heads (each rank "
                           "holds a whole share of every sharded component's heads)")
    assert ran(runs, "v6e:8")["request_refused"] == f"InvalidRequest: {refused[2]}"
    assert by_size(ran(runs, "v6e:4, autoload on")["refused"])[8] == "tp_size=8 is not accepted: at most the 4 tpu devices here"


def test_the_page_offers_exactly_the_sizes_the_launcher_accepts_on_the_host(runs):
    assert ran(runs, "v6e:8")["offered"] == [4, 8] and ran(runs, "v6e:4, autoload on")["offered"] == [4]


@pytest.mark.parametrize("run", ["v6e:8", "v6e:4, autoload on"])
def test_the_placement_proposal_picks_only_sizes_the_launcher_accepts(runs, run):
    found = ran(runs, run)
    proposed = {name: size for name, (placement, size) in found["proposed"].items() if placement == "tp"}
    assert proposed == {"flux2-dev": 4}
    assert set(proposed.values()) <= set(by_size(found["launch_env"]))


def test_a_host_without_chips_has_no_launch_env(runs):
    assert ran(runs, "no chip, autoload on")["launcher_env(4)"] == (
        "torch.tpu.distributed.set_tpu_launch_env(nproc_per_node=4) failed: "
        "ValueError: set_tpu_launch_env(): expected TPU devices, got none")


def test_the_module_prints_shell_assignments_that_the_readme_recipe_exports(wheel_python, tmp_path):
    env = _real_env("v6e:4", tmp_path)
    script = (f'out="$({wheel_python} -m torch.tpu.distributed 2>/dev/null)"; printf "%s\\n" "$out"; '
              f'set -a; eval "$out"; set +a; {wheel_python} -S -c "import json, os; '
              f'print(json.dumps({{k: os.environ.get(k) for k in (\'TORCH_TPU_TOPOLOGY\', \'WORLD_SIZE\')}}))"')
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=300)
    printed, exported = done.stdout.strip().splitlines()[:-1], json.loads(done.stdout.strip().splitlines()[-1])
    assert [line.split("=", 1)[0] for line in printed] == [
        "TORCH_TPU_TOPOLOGY", "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_XPROF_SESSION_ID", "WORLD_SIZE",
        "NODE_RANK"]
    assert printed[0] == 'TORCH_TPU_TOPOLOGY="2,2,1"' and printed[3] == "WORLD_SIZE=4"
    assert exported == {"TORCH_TPU_TOPOLOGY": "2,2,1", "WORLD_SIZE": "4"}


# --- libtpu ------------------------------------------------------------------------------------------------------


def test_without_libtpu_autoload_aborts_import_torch_uncatchably(wheel_python, tmp_path):
    env = _real_env("v6e:4", tmp_path, ACCELDEMO_TEST_WITHOUT_LIBTPU_PACKAGE="1")
    done = _run(wheel_python, "try:\n    import torch\nexcept BaseException as error:\n    result = repr(error)\n", env)
    assert done.returncode != 0 and _RESULT not in done.stdout
    assert "Environment variable TPU_LIBRARY_PATH is not set. Can't load PJRT plugin TPU." in done.stderr


def test_without_libtpu_the_app_turns_autoload_off_and_says_what_is_missing(runs):
    assert ran(runs, "no libtpu")["detected"][:2] == [
        False, "torch_tpu is installed but libtpu is missing: install libtpu, or set TPU_LIBRARY_PATH to a libtpu.so"]
    assert ran(runs, "no libtpu")["autoload"] == "0"


def test_tpu_library_path_serves_for_the_libtpu_package(runs):
    assert ran(runs, "libtpu at TPU_LIBRARY_PATH")["detected"][:3] == [True, "4 x TPU v6e", 4]
    assert ran(runs, "libtpu at TPU_LIBRARY_PATH")["autoload"] is None


def test_tpu_library_path_to_no_file_is_reported_and_torch_still_loads(runs):
    assert ran(runs, "TPU_LIBRARY_PATH to no file")["detected"][:2] == [
        False, "TPU_LIBRARY_PATH=/nowhere/libtpu.so is not a file (torch_tpu loads libtpu from it)"]
    assert ran(runs, "TPU_LIBRARY_PATH to no file")["autoload"] == "0"


# --- which chips a process sees ------------------------------------------------------------------------------------


def test_the_chip_count_before_the_runtime_starts_ignores_tpu_visible_devices(runs):
    # torch.accelerator counts what the PCI scan finds until the runtime starts; only then is the pin applied.
    runtime = ran(runs, "v6e:8")["runtime"]
    assert runtime["a lone process"]["device count"] == [8] and runtime["rank 3 of 4"]["device count"] == [8]
    assert runtime["a lone process"]["exit"] != 0  # no chip for the runtime to start on


def _visible(setenv: list[str]) -> dict[str, str]:
    """The last value the process gave each chip-selecting variable."""
    return {name: value for name, _, value in (line.partition("=") for line in setenv)
            if name in ("TPU_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS")}


@pytest.fixture
def recorded(setenv_recorder):
    if setenv_recorder is None:
        pytest.skip("recording the runtime's setenv() calls needs a C compiler (cc)")


def test_in_a_launched_rank_the_runtime_sets_tpu_visible_devices_to_the_local_rank(runs, recorded):
    # The pool's TPU_VISIBLE_DEVICES=4,5,6,7 does not survive: local rank 3 takes chip 3, whatever was pinned.
    assert _visible(ran(runs, "v6e:8")["runtime"]["rank 3 of 4"]["setenv"]) == {
        "TPU_VISIBLE_DEVICES": "3", "TPU_VISIBLE_CHIPS": "3"}


def test_in_a_lone_process_the_runtime_leaves_tpu_visible_devices_to_libtpu(runs, recorded):
    assert _visible(ran(runs, "v6e:8")["runtime"]["a lone process"]["setenv"]) == {}


def test_a_one_rank_pool_without_the_launch_env_keeps_its_pinned_chips(runs, recorded):
    # A replica on one chip is a one-rank pool: started without torch-tpu's launch env, its pin survives.
    assert _visible(ran(runs, "v6e:8")["runtime"]["the rank of a one-rank pool"]["setenv"]) == {}
