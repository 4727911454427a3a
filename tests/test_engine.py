"""The engine: shapes compile once, progress has phases, jobs never interleave, memory is bounded."""
import threading
import time

import numpy as np
import pytest

from acceldemo.errors import CapacityExceeded, GenerationFailed
from acceldemo.records import GenerateParams, Mode, Phase, Shape, ShapeState
from tests.engines import new_manager


def params(width: int | None = None, height: int | None = None, **kw) -> GenerateParams:
    """A raw request on cpu; a size given as width and height."""
    size = Shape(width or 64, height or 64) if width or height else None
    return GenerateParams(**{"prompt": "a red circle on a blue background", "hardware": "cpu", "seed": 0,
                             "resolution": size, **kw})


def compiled(**kw) -> GenerateParams:
    return params(**{"mode": "compiled", **kw})


def shapes_of(engine) -> dict:
    """Every compiled-shape record of the engine, by (pipeline key, shape)."""
    return {(p.key, s.shape): s for p in engine.snapshot().pipelines for s in p.shapes}


def pixels(result) -> np.ndarray:
    return np.asarray(result.image, dtype=np.int16)


def test_image_has_the_asked_size_and_is_not_constant(manager):
    result = manager.generate(params(128, 64, prompt="a cat"))
    assert result.image.size == (128, 64)
    assert pixels(result).std() > 1.0


def test_second_visit_to_a_shape_compiles_nothing(manager):
    first = manager.generate(compiled(width=96, height=96))
    second = manager.generate(compiled(width=96, height=96))
    assert first.new_graphs > 0 and not first.warm
    assert second.new_graphs == 0 and second.warm
    record = shapes_of(manager)[(second.key, Shape(96, 96))]
    assert record.state is ShapeState.READY and record.hits == 1 and record.graphs == first.new_graphs
    assert record.compile_seconds > 0 and record.last_latency is not None


def test_other_steps_prompt_and_seed_compile_nothing(manager):
    manager.generate(compiled(width=112, height=112))
    for change in ({"steps": 2}, {"steps": 6}, {"prompt": "a green square"}, {"seed": 1234}, {"guidance": 3.0}):
        assert manager.generate(compiled(width=112, height=112, **change)).new_graphs == 0, change


def test_transposed_shape_shares_the_graph_of_its_token_count(manager):
    manager.generate(compiled(width=160, height=64))
    assert manager.generate(compiled(width=64, height=160)).new_graphs == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["compiled", "regional"])
def test_twelve_shapes_then_revisits_never_fail_and_compile_nothing(fresh_manager, mode):
    m = fresh_manager(max_shapes_per_pipeline=16)
    # Twelve distinct token counts: each is a new graph for the FLUX transformer.
    shapes = [Shape(64 + 16 * i, 64) for i in range(12)]
    first = [m.generate(compiled(mode=mode, model="tiny-flux1", width=s.width, height=s.height)) for s in shapes]
    assert all(r.new_graphs > 0 for r in first)
    again = [m.generate(compiled(mode=mode, model="tiny-flux1", width=s.width, height=s.height, seed=7))
             for s in shapes]
    assert [r.new_graphs for r in again] == [0] * 12 and all(r.warm for r in again)


def test_progress_tells_load_compile_steps_and_decode_apart(fresh_manager):
    events = []
    fresh_manager().generate(compiled(width=64, height=144, steps=3), events.append)
    phases = [e.phase for e in events]
    assert (phases[0], events[0].message) == (Phase.QUEUE, "running on cpu:0") and phases[1] is Phase.LOAD
    assert phases.index(Phase.COMPILE) < phases.index(Phase.DENOISE) < phases.index(Phase.DECODE)
    assert [(e.step, e.total) for e in events if e.phase is Phase.DENOISE] == [(1, 3), (2, 3), (3, 3)]
    compiling = [e.message for e in events if e.phase is Phase.COMPILE]
    assert compiling[0].startswith("compiling 64x144 (first time for this shape) — ")  # then the estimate, if any


def test_a_compiled_shape_goes_straight_to_the_steps(manager):
    manager.generate(compiled(width=80, height=80))
    events = []
    manager.generate(compiled(width=80, height=80), events.append)
    assert Phase.COMPILE not in [e.phase for e in events] and Phase.LOAD not in [e.phase for e in events]


def test_warm_up_compiles_ahead_and_requests_then_are_warm(manager):
    base = compiled(model="tiny-flux2-klein", mode="regional")
    records = manager.warm_up(base, [Shape(176, 64), "192x64"])
    assert [r.state for r in records] == [ShapeState.READY] * 2 and all(r.graphs > 0 for r in records)
    assert manager.generate(compiled(mode="regional", width=192, height=64)).new_graphs == 0


def test_least_recently_used_pipeline_is_evicted_and_shown(fresh_manager):
    m = fresh_manager(max_resident_pipelines=1)
    m.generate(params(prompt="one", model="tiny-flux1"))
    m.generate(params(prompt="two", model="tiny-sd3"))
    resident = {p.key.model: p.resident for p in m.snapshot().pipelines}
    assert resident == {"tiny-flux1": False, "tiny-sd3": True}
    assert m.snapshot().counters.evictions == 1 and m.backend.residency.evictions[0][1].model == "tiny-flux1"
    again = m.generate(params(prompt="one", model="tiny-flux1"))
    assert again.load_seconds > 0 and m.snapshot().counters.loads == 3


def test_jobs_on_one_device_wait_their_turn_and_never_interleave(fresh_manager):
    m = fresh_manager(max_batch=1)  # every job a call of its own (drawn together, they would be one call)
    spans, events = [], []
    real_load = m.backend.executor.load

    def load(key, spec, on_progress):
        loaded = real_load(key, spec, on_progress)
        real_run = loaded.run

        def run(*args, **kwargs):
            start = time.perf_counter()
            out = real_run(*args, **kwargs)
            spans.append((start, time.perf_counter()))
            return out

        loaded.run = run
        return loaded

    m.backend.executor.load = load
    requests = [params(prompt=f"job {i}", steps=8, seed=i) for i in range(4)]
    threads = [threading.Thread(target=m.generate, args=(r, events.append)) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans.sort()
    assert len(spans) == 4
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    places = [e.message for e in events if e.phase is Phase.QUEUE and e.message.endswith("in line for cpu:0")]
    assert {"1st in line for cpu:0", "2nd in line for cpu:0"} <= set(places) and m.queue_depth() == 0


def test_shape_capacity_is_an_error_not_a_crash(fresh_manager):
    m = fresh_manager(max_shapes_per_pipeline=2)
    m.generate(params(64, 64, prompt="a"))
    m.generate(params(128, 64, prompt="a"))
    with pytest.raises(CapacityExceeded, match="already holds 2 shapes.*64x64, 128x64"):
        m.generate(params(128, 128, prompt="a"))
    assert m.generate(params(64, 64, prompt="a")).warm


def test_a_compile_failure_marks_only_that_shape_failed(fresh_manager, monkeypatch):
    import torch._dynamo

    name = "acceldemo_test_fails_at_48_tokens"
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        @torch._dynamo.register_backend(name=name)
        def fails_at_48_tokens(gm, example_inputs):
            if any(getattr(x, "dim", lambda: 0)() == 3 and x.shape[1] == 48 for x in example_inputs):
                raise RuntimeError("this compiler cannot do 48 tokens")
            return gm.forward

    m = fresh_manager(cpu_compile_backend=name)
    request = compiled(model="tiny-flux1")
    with pytest.raises(GenerationFailed, match="failed at 192x64.*cannot do 48 tokens"):
        m.generate(compiled(model="tiny-flux1", width=192, height=64))
    assert m.generate(request).image.size == (64, 64)
    states = {str(shape): (s.state, s.reason) for (_, shape), s in shapes_of(m).items()}
    assert states["192x64"][0] is ShapeState.FAILED and "48 tokens" in states["192x64"][1]
    assert states["64x64"] == (ShapeState.READY, "")


@pytest.mark.slow
def test_compiled_output_equals_eager_on_every_tiny_family():
    import torch
    import torch._dynamo

    from acceldemo.config import Settings
    from acceldemo.executors.recipe import apply_recipe, recompile_limits
    from acceldemo.hardware import HardwareRegistry
    from acceldemo.models.catalog import CATALOG
    from acceldemo.models.loading import load_pipeline
    from acceldemo.records import Placement

    settings = Settings.from_env()
    cpu = HardwareRegistry(settings).get("cpu")
    for name in ("tiny-flux2-klein", "tiny-flux1", "tiny-sd3", "tiny-flux2"):
        spec = CATALOG[name]
        pipe = load_pipeline(spec, settings)
        pipe.set_progress_bar_config(disable=True)

        def call():
            return pipe(prompt="a red circle", height=64, width=80, num_inference_steps=2,
                        guidance_scale=spec.guidance, max_sequence_length=spec.max_sequence_length,
                        generator=torch.Generator("cpu").manual_seed(3), output_type="np").images

        eager = call()
        apply_recipe(pipe, cpu, Mode.COMPILED, Placement.DEVICE, settings, spec)
        # Other tests compiled these transformers' code at other shapes already: the app's limits, as it runs them.
        with torch._dynamo.config.patch(**recompile_limits(settings)):
            assert np.abs(call() - eager).max() < 1e-4, name


def test_manager_serves_again_after_errors(manager):
    from acceldemo.errors import AcceldemoError

    for bad in (GenerateParams(prompt=""), GenerateParams(prompt="x", resolution="65x64"),
                GenerateParams(prompt="x", model="nope"), GenerateParams(prompt="x", hardware="tpu")):
        with pytest.raises(AcceldemoError):
            manager.generate(bad)
    assert manager.generate(GenerateParams(prompt="ok", hardware="cpu")).image.size == (64, 64)


def test_new_manager_instance_reuses_dynamo_graphs_of_the_process():
    # dynamo's cache is per code object, so a second manager (or a reload) compiles nothing new.
    m = new_manager()
    try:
        m.generate(compiled(width=208, height=64))
        assert m.generate(compiled(width=208, height=64)).new_graphs == 0
    finally:
        m.close()


def test_a_request_of_three_images_gives_each_seed_its_own_image_and_counts_once(fresh_manager):
    m = fresh_manager()
    three = m.generate(params(80, 64, seed=11, num_images=3, steps=2))
    alone = [m.generate(params(80, 64, seed=seed, steps=2)) for seed in (11, 12, 13)]
    assert [f["seed"] for f in map(three.facts, range(3))] == [11, 12, 13]
    # Its images are drawn in one call: each within one level of the image its seed gives alone.
    assert all(np.abs(np.asarray(image, dtype=np.int16) - pixels(one)).max() <= 1
               for image, one in zip(three.images, alone))
    assert three.facts(0)["batch"] == 3 and len({part.call for part in three.parts}) == 1
    assert three.facts(2)["num_images"] == 3 and len(three.parts) == 3
    assert m.snapshot().counters.requests["ok"] == 4  # the three-image request is one request


def test_a_request_whose_images_do_not_fit_the_line_is_refused_whole(fresh_manager):
    from acceldemo.errors import QueueFull
    from tests.engines import DeviceHolder

    m = fresh_manager(queue_size=2)
    holder = DeviceHolder(m)
    holder.start()
    try:
        with pytest.raises(QueueFull):
            m.submit(m.check(params(num_images=3, steps=1)))
        assert m.queue_depth() == 0  # none of its images was left waiting
        job = m.submit(m.check(params(num_images=2, steps=1)))
        assert m.queue_depth() == 2
    finally:
        holder.release()
    assert len(job.result(120).images) == 2
    assert m.snapshot().counters.requests["refused"] == 1
