"""Requests drawn together: those waiting for a device that share a call's settings run as one pipeline call, each
with its own image (the one it gets alone), progress, cancel and outcome; compiled modes build each batch bucket
once."""
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from acceldemo.config import Settings
from acceldemo.engine.batching import BatchPolicy
from acceldemo.engine.ledger import ShapeLedger
from acceldemo.errors import Cancelled
from acceldemo.hardware.base import Availability, GiB
from acceldemo.hardware.neuron import NeuronHardware
from acceldemo.models.catalog import get_model
from acceldemo.records import Batch, DeviceSet, GenerateParams, Mode, Phase, Placement, Request, RunOutput, Shape
from tests.engines import DeviceHolder

PROMPTS = ("a red circle on a blue background", "a green square, top left", "blue triangle, lower right",
           "a white disc on black")


def params(i: int, **kw) -> GenerateParams:
    return GenerateParams(**{"prompt": PROMPTS[i % 4], "hardware": "cpu", "seed": 100 + i, "steps": 2, **kw})


def pixels(result) -> np.ndarray:
    return np.asarray(result.image, dtype=np.int16)


@pytest.fixture
def calls(monkeypatch):
    """Every diffusers pipeline call of this test: the prompts it drew (one per image)."""
    from diffusers import Flux2KleinPipeline

    seen: list[list[str]] = []
    real = Flux2KleinPipeline.__call__

    def counted(pipe, *args, **kwargs):
        prompt = kwargs["prompt"]
        seen.append(list(prompt) if isinstance(prompt, list) else [prompt] * kwargs["num_images_per_prompt"])
        return real(pipe, *args, **kwargs)

    monkeypatch.setattr(Flux2KleinPipeline, "__call__", counted)
    return seen


def drawn_while_held(engine, requests: list[GenerateParams], on_progress=None) -> list:
    """Submit the requests while the device is busy, then free it: they are all waiting when it frees. The jobs."""
    holder = DeviceHolder(engine)
    holder.start()
    try:
        jobs = [engine.submit(engine.check(r), on_progress[i] if on_progress else lambda event: None)
                for i, r in enumerate(requests)]
        assert engine.queue_depth() == len(requests)
    finally:
        holder.release()
    return jobs


def test_four_waiting_requests_are_one_call_and_each_image_is_its_image_alone(fresh_manager, calls):
    from acceldemo.ui.page import describe_result

    m = fresh_manager()
    events = [[] for _ in range(4)]
    jobs = drawn_while_held(m, [params(i) for i in range(4)], [e.append for e in events])
    together = [job.result(120) for job in jobs]
    assert [len(c) for c in calls] == [1, 4] and sorted(calls[1]) == sorted(PROMPTS)  # the holder's, then one call
    assert [r.batch for r in together] == [4] * 4 and len({r.call for r in together}) == 1
    assert all(r.facts()["batch"] == 4 for r in together)
    assert "drawn together with 3 other requests" in describe_result(together[0])
    assert "running on cpu:0, drawn together with 3 other requests" in [e.message for e in events[2]]
    # Each request keeps its own place in line, steps and times.
    assert "3rd in line for cpu:0" in [e.message for e in events[2]]
    assert all([(e.step, e.total) for e in mine if e.phase is Phase.DENOISE] == [(1, 2), (2, 2)] for mine in events)
    assert all(r.queue_wait > 0 and r.seconds > r.queue_wait for r in together)
    assert m.snapshot().counters.requests["ok"] == 5
    alone = [m.generate(params(i)) for i in range(4)]
    assert [len(c) for c in calls[2:]] == [1, 1, 1, 1] and all(r.batch == 1 for r in alone)
    for one, solo in zip(together, alone):
        assert one.image.size == (64, 64) and pixels(solo).std() > 1.0
        assert np.abs(pixels(one) - pixels(solo)).max() <= 1
    counters = m.snapshot().counters
    assert counters.requests["ok"] == 9 and (counters.calls, counters.drawn) == (6, 9)


def test_other_steps_or_size_are_not_drawn_together_and_a_cap_of_two_splits_four(fresh_manager, calls):
    m = fresh_manager(max_batch=2)
    same = [params(i) for i in range(4)]
    other_steps, other_size = params(4, steps=3), params(5, resolution="80x64")
    jobs = drawn_while_held(m, [*same[:2], other_steps, *same[2:], other_size])
    results = [job.result(120) for job in jobs]
    assert sorted(len(c) for c in calls[1:]) == [1, 1, 2, 2]
    assert [r.batch for r in results] == [2, 2, 1, 2, 2, 1]
    first, second = {results[0].call, results[1].call}, {results[3].call, results[4].call}
    assert len(first) == 1 and len(second) == 1 and first != second
    assert results[2].request.steps == 3 and results[5].image.size == (80, 64)
    assert m.snapshot().counters.requests["ok"] == 7


def test_a_stopped_member_of_a_running_call_loses_its_image_and_the_others_finish(fresh_manager):
    m = fresh_manager()
    stop = threading.Event()
    events = [[] for _ in range(3)]

    def stop_at_first_step(event) -> None:
        events[1].append(event)
        if event.phase is Phase.DENOISE:
            stop.set()

    holder = DeviceHolder(m)
    holder.start()
    try:
        jobs = [m.submit(m.check(params(0, steps=4)), events[0].append),
                m.submit(m.check(params(1, steps=4)), stop_at_first_step, stop.is_set),
                m.submit(m.check(params(2, steps=4)), events[2].append)]
    finally:
        holder.release()
    with pytest.raises(Cancelled, match="dropped from a call drawn together with 2 other requests"):
        jobs[1].result(120)
    finished = [jobs[0].result(120), jobs[2].result(120)]
    assert [r.batch for r in finished] == [3, 3] and all(r.image.size == (64, 64) for r in finished)
    # The call ran its every step for the others.
    assert [e.step for e in events[2] if e.phase is Phase.DENOISE] == [1, 2, 3, 4]
    assert m.snapshot().counters.requests["cancelled"] == 1 and m.snapshot().counters.requests["ok"] == 3


@pytest.mark.slow  # a real compile (or a real process) end to end: the full suite runs it
def test_compiled_buckets_compile_once_each_and_revisits_compile_nothing(fresh_manager, calls):
    m = fresh_manager()
    shape = "224x64"  # a token count no other test compiles: this test's graphs are its own
    records = m.warm_up(params(0, mode="compiled"), [shape], batches=(1, 2, 4))
    assert [(r.batch, r.state) for r in records] == [(1, "ready"), (2, "ready"), (4, "ready")]
    assert all(r.graphs > 0 for r in records)
    graphs = m.snapshot().counters.graphs
    again = m.warm_up(params(0, mode="compiled"), [shape], batches=(4, 2, 1))
    assert [r.graphs for r in again] == [r.graphs for r in records] and m.snapshot().counters.graphs == graphs
    del calls[:]
    four = [job.result(120) for job in drawn_while_held(m, [params(i, mode="compiled", resolution=shape)
                                                            for i in range(4)])]
    three = [job.result(120) for job in drawn_while_held(m, [params(i, mode="compiled", resolution=shape)
                                                             for i in range(3)])]
    two = [job.result(120) for job in drawn_while_held(m, [params(i, mode="compiled", resolution=shape)
                                                           for i in range(2)])]
    # A call of three runs at bucket 4, padded with the first request's prompt; its extra image is dropped.
    assert [len(c) for c in calls] == [1, 4, 1, 4, 1, 2]
    assert calls[3] == [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]] and len(three) == 3
    assert all(r.new_graphs == 0 and r.warm for r in four + three + two)
    alone = [m.generate(params(i, mode="compiled", resolution=shape)) for i in range(4)]
    assert all(r.new_graphs == 0 for r in alone)
    for batched, solo in zip(four, alone):
        assert np.abs(pixels(batched) - pixels(solo)).max() <= 1
    assert all(np.abs(pixels(b) - pixels(s)).max() <= 1 for b, s in zip(three, alone))
    compiled = next(p for p in m.snapshot().pipelines if p.key.mode is Mode.COMPILED)
    rows = {(str(s.shape), s.batch): s for s in compiled.shapes}
    assert rows[(shape, 4)].hits == 3 and rows[(shape, 2)].hits == 2 and rows[(shape, 1)].graphs > 0


def test_where_every_shape_compiles_a_call_draws_one_request_unless_warm_up_compiled_buckets():
    settings = Settings.from_env()
    neuron = NeuronHardware(settings, Availability(True, "2 NeuronCores", 2, 24 * GiB))
    ledger = ShapeLedger(8)
    policy = BatchPolicy(settings, SimpleNamespace(get=lambda name: neuron), ledger)
    devices = DeviceSet("neuron", (0,))
    for mode in (Mode.EAGER, Mode.COMPILED):
        request = Request("a red circle", "tiny-flux2-klein", "neuron", mode, Placement.DEVICE, 1,
                          Shape(64, 64), 4, 1.0, 0, get_model("tiny-flux2-klein").graph_rule)
        assert policy.sizes(request, devices) == [1] and policy.take(request, devices, 4) == 1
        visit = ledger.begin(request.key(devices), Batch((request,), 4))  # as a warm-up of bucket 4 records it
        ledger.finished(visit, RunOutput([], 1.0, 1, 1.0), warm_up=True)
        assert policy.sizes(request, devices) == [1, 4]
        assert policy.take(request, devices, 3) == 3 and policy.size(request, devices, 3) == 4


def test_max_batch_and_batch_wait_are_checked_settings():
    assert Settings.from_env({"ACCELDEMO_MAX_BATCH": "1"}).max_batch == 1
    assert Settings.from_env({}).max_batch is None and Settings.from_env({}).batch_wait_ms == 0
    with pytest.raises(ValueError, match="ACCELDEMO_MAX_BATCH='0' is not accepted: a whole number from 1 to 16"):
        Settings.from_env({"ACCELDEMO_MAX_BATCH": "0"})
    with pytest.raises(ValueError, match="ACCELDEMO_BATCH_WAIT_MS='-5' is not accepted: a number from 0 to 10000"):
        Settings.from_env({"ACCELDEMO_BATCH_WAIT_MS": "-5"})


def test_a_batch_wait_holds_a_free_device_open_for_requests_that_arrive_meanwhile(fresh_manager, calls):
    m = fresh_manager(batch_wait_ms=1500)
    m.generate(params(0, steps=1))  # loaded
    del calls[:]
    jobs = [m.submit(m.check(params(0)))]
    jobs.append(m.submit(m.check(params(1))))
    assert [job.result(120).batch for job in jobs] == [2, 2] and [len(c) for c in calls] == [2]


def test_the_placement_proposal_caps_a_call_at_what_fits_beside_the_weights():
    from acceldemo.engine.validation import batch_fit, propose_placement

    klein, dev = get_model("flux2-klein-4b"), get_model("flux2-dev")
    core = Availability(True, "8 NeuronCores", 8, 24 * GiB)
    assert propose_placement(klein, core).batch == 3  # 16 GB of weights leave room for 3 images at 1024x1024
    assert batch_fit(klein, 24 * GiB, Placement.DEVICE, 1, Shape(512, 512)) == 4  # the model's own cap
    assert propose_placement(klein, Availability(True, "1 x H200", 1, 141 * GiB)).batch == 4
    assert propose_placement(dev, Availability(True, "8 x H200", 8, 141 * GiB)).batch == 1
    assert propose_placement(klein, core, max_batch=2).batch == 2
