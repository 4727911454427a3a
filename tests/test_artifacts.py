"""The store of precompiled (AOTInductor) packages: keys, atomic writes, the hit rate it reports.

Building and loading real packages is tested end to end in test_cli.py (restart) and here on FLUX.1, whose
pipeline passes an empty joint_attention_kwargs dict that a package must be traced without.
"""
import json
from pathlib import Path

import numpy as np
import pytest

from acceldemo.executors.artifacts import ArtifactStore


def test_a_package_path_depends_on_every_part_of_its_key(tmp_path):
    store = ArtifactStore(tmp_path)
    key = {"model": "m", "toolchain": "torch 2.13.0+cpu, cpu AVX2", "inputs": "[[64, 32]]"}
    paths = {store.path("m", "cpu", key), store.path("m", "cpu", {**key, "toolchain": "torch 2.14.0"}),
             store.path("m", "cpu", {**key, "inputs": "[[128, 32]]"}), store.path("m", "cuda", key)}
    assert len(paths) == 4 and store.path("m", "cpu", dict(reversed(key.items()))) in paths
    assert all(p.suffix == ".pt2" and p.is_relative_to(tmp_path) for p in paths)


def test_a_failed_build_leaves_no_package_behind(tmp_path):
    store = ArtifactStore(tmp_path)
    target = store.path("m", "cpu", {"inputs": "x"})

    def crashing_build(partial: str):
        Path(partial).write_bytes(b"half a package")
        raise RuntimeError("compiler died")

    with pytest.raises(RuntimeError, match="compiler died"):
        store.save(target, crashing_build, {"model": "m"})
    assert list(tmp_path.rglob("*")) == [target.parent.parent, target.parent]

    store.save(target, lambda partial: Path(partial).write_bytes(b"package"), {"model": "m", "shape": "64x64"})
    assert target.read_bytes() == b"package" and json.loads(target.with_suffix(".json").read_text())["shape"] == \
        "64x64"
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name, target.with_suffix(".json").name])


def test_the_report_counts_packages_and_the_hit_rate(tmp_path):
    store = ArtifactStore(tmp_path)
    assert store.report("auto")["packages"] == 0
    store.save(store.path("m", "cpu", {"i": 1}), lambda p: Path(p).write_bytes(b"x" * 2**20), {})
    store.record({"built": 1})
    store.record({"loaded": 3, "ignored": 9})
    summary = store.report("auto")
    assert (summary["packages"], summary["megabytes"], summary["built"], summary["loaded"], summary["hit_rate"]) == \
        (1, 1.0, 1, 3, 0.75)
    assert set(ArtifactStore(tmp_path).counts().values()) == {0}  # counts are the owner's


def test_the_engine_reports_the_store(fresh_manager):
    precompiled = fresh_manager(precompile="off").snapshot().precompiled
    assert precompiled["setting"] == "off" and precompiled["folder"].endswith("aoti")


@pytest.mark.slow
@pytest.mark.inductor
def test_flux1_served_from_a_package_matches_eager_and_a_second_pipeline_loads_it(tmp_path):
    import torch

    from acceldemo.config import Settings
    from acceldemo.executors.recipe import apply_recipe
    from acceldemo.hardware import HardwareRegistry
    from acceldemo.models.catalog import CATALOG
    from acceldemo.models.loading import load_pipeline
    from acceldemo.records import Mode, Placement

    settings = Settings.from_env()
    spec, cpu, store = CATALOG["tiny-flux1"], HardwareRegistry(settings).get("cpu"), ArtifactStore(tmp_path)

    def pipeline_and_call():
        pipe = load_pipeline(spec, settings)
        pipe.set_progress_bar_config(disable=True)
        return pipe, lambda: pipe(prompt="a red circle", height=64, width=80, num_inference_steps=2,
                                  max_sequence_length=spec.max_sequence_length, output_type="np",
                                  generator=torch.Generator("cpu").manual_seed(3)).images

    pipe, call = pipeline_and_call()
    eager = call()
    apply_recipe(pipe, cpu, Mode.COMPILED, Placement.DEVICE, settings, spec, store)
    assert np.abs(call() - eager).max() < 1e-4
    assert pipe.transformer.forward.events["built"] == 1
    again, call_again = pipeline_and_call()
    apply_recipe(again, cpu, Mode.COMPILED, Placement.DEVICE, settings, spec, store)
    assert np.abs(call_again() - eager).max() < 1e-4
    assert (again.transformer.forward.events["built"], again.transformer.forward.events["loaded"]) == (0, 1)


def test_the_page_says_what_the_store_holds():
    from acceldemo.ui.page import describe_packages

    store = {"setting": "auto", "packages": 3, "megabytes": 6.6, "built": 1, "loaded": 3, "hit_rate": 0.75}
    assert describe_packages(store) == ("Precompiled packages: 3 on disk (6.6 MB); since start 1 built, 3 loaded, "
                                        "75% of first visits loaded one")
    assert describe_packages({**store, "built": 0, "loaded": 0, "hit_rate": None}).endswith("0 built, 0 loaded")
    assert describe_packages({**store, "setting": "off"}) == "Precompiled packages: off (ACCELDEMO_PRECOMPILE=off)"


def test_a_call_with_extra_attention_arguments_runs_eagerly_and_builds_nothing(tmp_path):
    import torch

    from acceldemo.config import Settings
    from acceldemo.executors.artifacts import PrecompiledTransformer
    from acceldemo.hardware import HardwareRegistry
    from acceldemo.models.catalog import CATALOG
    from acceldemo.models.loading import load_pipeline

    pipe = load_pipeline(CATALOG["tiny-flux2-klein"], Settings.from_env())
    pipe.set_progress_bar_config(disable=True)
    seen = {}

    def capture(**inputs):
        seen.update(inputs)
        raise StopIteration

    pipe.transformer.forward = capture
    with pytest.raises(StopIteration):
        pipe(prompt="a red circle", height=64, width=64, num_inference_steps=1)
    del pipe.transformer.forward
    expected = pipe.transformer(**seen)[0]
    cpu = HardwareRegistry(Settings.from_env()).get("cpu")
    stand_in = PrecompiledTransformer.install(pipe, ArtifactStore(tmp_path), "tiny-flux2-klein", cpu)
    with torch.no_grad():
        got = pipe.transformer(**{**seen, "joint_attention_kwargs": {"note": "not in a package"}})[0]
    assert torch.equal(got, expected) and stand_in.warned_eager
    assert stand_in.events["built"] == 0 and not list(tmp_path.rglob("*.pt2"))


def _fake_package(store: ArtifactStore, toolchain: str | None, inputs: str, hardware: str = "cpu"):
    about = {"model": "m", "hardware": hardware, "shape": "64x64", "toolchain": toolchain}
    path = store.path("m", hardware, {**about, "inputs": inputs})
    store.save(path, lambda partial: Path(partial).write_bytes(b"package"), about)
    if toolchain is None:
        path.with_suffix(".json").unlink()
    return path


def test_prune_removes_only_what_this_host_cannot_load(tmp_path):
    store = ArtifactStore(tmp_path)
    kept = _fake_package(store, "torch 2.13.0+cpu, cpu AVX2", "a")
    elsewhere = _fake_package(store, "torch 2.13.0, cpu AVX2, cuda 12.8 sm_90", "b", hardware="cuda")
    old = _fake_package(store, "torch 2.12.0+cpu, cpu AVX2", "c")
    orphan = _fake_package(store, None, "d")
    leftover = kept.with_name(".partial-123-x.pt2")
    leftover.write_bytes(b"half")
    assert len(store.packages()) == 4

    removed = store.prune({"cpu": "torch 2.13.0+cpu, cpu AVX2"}.get)  # no CUDA here: its package is kept
    assert sorted(removed) == sorted(map(str, (old, orphan, leftover)))
    assert sorted(e["path"] for e in store.packages()) == sorted(map(str, (kept, elsewhere)))
    assert not old.with_suffix(".json").exists() and kept.with_suffix(".json").exists()
