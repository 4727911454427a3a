"""Previews of the image as it forms, decoded from the latents through the model's latent→RGB map; and the compile
estimate a second process reads from the first one's record."""
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from acceldemo.engine.compile_times import CompileClock, CompileTimes, Estimate
from acceldemo.models.catalog import CATALOG, get_model
from acceldemo.models.latent_rgb import LAYOUTS, map_for, shipped_maps, vae_fingerprint
from acceldemo.records import GenerateParams, Phase, Progress

ROOT = Path(__file__).resolve().parents[1]


def previews_of(engine, **params):
    events = []
    result = engine.generate(GenerateParams(**{"prompt": "a red circle on a blue background, top left",
                                               "seed": 3, **params}), events.append)
    return [e.preview for e in events if e.preview is not None], result, events


def test_each_step_brings_a_preview_that_forms_into_the_image(manager):
    previews, result, _ = previews_of(manager, model="tiny-shapes", resolution="64x64", steps=4, previews=True)
    assert [p.step for p in previews] == [1, 2, 3, 4] and all(p.total == 4 for p in previews)
    # tiny-shapes' VAE downsamples 4x: the latents hold a 16x16 picture, shown at the image's size.
    assert previews[0].pixels.shape == (16, 16, 3) and previews[-1].image().size == (64, 64)
    final = np.asarray(result.image, dtype=int)
    distance = [np.abs(np.asarray(p.image(), dtype=int) - final).mean() for p in previews]
    assert distance[-1] < 25 and distance[-1] < distance[0] - 30  # noise first, then close to the image
    assert len({p.pixels.tobytes() for p in previews}) == 4


def test_a_request_that_asks_for_no_previews_gets_none(manager):
    previews, _, events = previews_of(manager, model="tiny-flux2-klein", resolution="64x64")
    assert previews == [] and [e.step for e in events if e.phase is Phase.DENOISE] == [1, 2, 3, 4]


def test_every_embedded_model_ships_a_map_from_its_own_vae(manager):
    shipped = shipped_maps()
    for name, spec in CATALOG.items():
        if spec.bundled or spec.tiny_family:
            assert spec.family in LAYOUTS and name in shipped
            previews, _, _ = previews_of(manager, model=name, resolution=str(spec.default_shape), steps=2,
                                         previews=True)
            assert [p.step for p in previews] == [1, 2], name
            assert previews[-1].pixels.std() > 1.0, name
            # The shipped map is this model's, wherever its files are kept (a fresh clone, another host): it is used,
            # never fitted again into the cache folder.
            assert not (manager.settings.cache_dir / "latent_rgb" / f"{name}.json").exists(), name


def test_a_model_without_a_shipped_map_fits_one_at_first_use_and_keeps_it(manager, tmp_path):
    from acceldemo.models.loading import load_pipeline

    vae = load_pipeline(get_model("tiny-flux1"), manager.settings).vae
    stranger = dataclasses.replace(get_model("tiny-flux1"), name="not-shipped")
    fitted = map_for(stranger, vae, tmp_path)
    kept = json.loads((tmp_path / "latent_rgb" / "not-shipped.json").read_text())
    assert kept["vae"] == vae_fingerprint(vae) == fitted.vae and len(fitted.weights) == 3
    assert fitted.error < 30  # of 255, against the VAE's own decode
    assert map_for(stranger, vae, tmp_path) == fitted


def test_a_compile_says_what_it_should_take_and_ticks_toward_it(tmp_path):
    times = CompileTimes(tmp_path)
    seen, lock = [], threading.Lock()

    def record(event):
        with lock:
            seen.append(event)

    first = CompileClock(record, lambda: times.estimate("kind"))
    first(Progress(Phase.COMPILE, "compiling 64x64 (first time for this shape)"))
    first(Progress(Phase.DENOISE, "step 1/4", 1, 4))
    first.stop()
    assert seen[0].message.endswith("— no estimate yet: the first compile of this kind on this host")
    assert seen[0].expected is None and first.measured is not None
    for seconds in (40.0, 36.0, 38.0):
        times.record("kind", seconds)
    assert times.estimate("kind") == Estimate(38.0, 38.0) and times.estimate("other") is None
    seen.clear()
    second = CompileClock(record, lambda: times.estimate("kind"))
    second(Progress(Phase.COMPILE, "compiling 128x128 (first time for this shape)"))
    time.sleep(2.3)
    second(Progress(Phase.DENOISE, "step 1/4", 1, 4))
    second.stop()
    compiling = [e for e in seen if e.phase is Phase.COMPILE]
    assert compiling[0].message == "compiling 128x128 (first time for this shape) — about 38 s (38 s last time on " \
                                   "this host)"
    assert len(compiling) >= 3 and all(e.expected == 38.0 for e in compiling)
    assert compiling[-1].elapsed >= 1.9 and 0.04 < compiling[-1].fraction < 0.1  # elapsed ÷ expected


@pytest.mark.slow
def test_a_second_process_compiling_the_same_kind_of_shape_shows_the_recorded_duration(tmp_path):
    env = {**os.environ, "ACCELDEMO_CACHE_DIR": str(tmp_path / "cache"), "ACCELDEMO_PRECOMPILE": "off",
           "ACCELDEMO_CPU_COMPILE_BACKEND": "aot_eager", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def generate(size: str) -> str:
        done = subprocess.run([sys.executable, "-m", "acceldemo", "generate", "--prompt", "a red circle", "--model",
                               "tiny-flux2-klein", "--mode", "compiled", "--size", size, "--seed", "0", "--out",
                               str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stderr

    first = generate("128x64")
    assert "compiling 128x64 (first time for this shape) — no estimate yet" in first
    recorded = json.loads((tmp_path / "cache" / "compile_times.json").read_text())
    (kind, [seconds]), = recorded.items()
    assert kind.startswith("tiny-flux2-klein|cpu:") and kind.endswith("|compiled|device|32x1x64") and seconds > 0
    second = generate("64x128")  # the same image token count: the same graph, the same kind of compile
    shown = f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    assert f"compiling 64x128 (first time for this shape) — about {shown} ({shown} last time on this host)" \
        in second
