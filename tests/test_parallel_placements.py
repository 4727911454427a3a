"""More devices per image without sharding weights: CFG parallel (one guidance branch per rank) and context parallel
(diffusers' Ulysses attention: the tokens spread over the ranks) on real torchrun pools with a gloo process group.
The same seed draws the same image as on one device; compile, previews, batching, styles, edits, step caches and
stopping hold; wrong degrees are refused before any work; the proposal learns them."""
import dataclasses
import io
import os
import signal

import numpy as np
import pytest

from acceldemo.config import Settings
from acceldemo.engine.planning import described_host, plan
from acceldemo.errors import Cancelled, GenerationFailed, InvalidRequest, UnsupportedCombination
from acceldemo.models.catalog import CATALOG
from acceldemo.records import GenerateParams, Phase, Placement, Shape, placement_label
from tests.engines import DeviceHolder, new_manager
from tests.test_cli import main as cli_main

PROMPT = "a red circle on a blue background, top left"


def ask(**kw) -> GenerateParams:
    return GenerateParams(**{"prompt": PROMPT, "hardware": "cpu", "resolution": "128x128", "steps": 6, "seed": 2,
                             **kw})


def pixels(result) -> np.ndarray:
    return np.asarray(result.image, dtype=np.int16)


def close_to(a, b, levels: float = 2) -> bool:
    """The same image within `levels` of 255 at every pixel."""
    return int(np.abs(pixels(a) - pixels(b)).max()) <= levels


@pytest.fixture(scope="module")
def engine():
    m = new_manager()
    yield m
    m.close()


# --- refusals: checked before anything starts ------------------------------------------------------------------------

def test_cfg_and_cp_are_refused_by_name_where_they_cannot_work(manager):
    with pytest.raises(UnsupportedCombination, match="guidance-distilled: no unconditional branch to split off"):
        manager.check(ask(model="tiny-flux1", placement="cfg"))
    with pytest.raises(InvalidRequest, match="above 1 with placement 'cfg': at 1 tiny-sd3 runs one branch"):
        manager.check(ask(model="tiny-sd3", placement="cfg", guidance=1.0))
    with pytest.raises(UnsupportedCombination, match="has no context-parallel plan in diffusers 0.42.1"):
        manager.check(ask(model="tiny-sd3", placement="cp"))
    with pytest.raises(InvalidRequest) as degree:
        manager.check(ask(model="tiny-shapes", placement="cp", cp_size=3))
    assert str(degree.value).startswith("cp_size=3 is not accepted: a degree that divides the 4 attention heads, "
                                        "the 64 image tokens at 128x128 and the 64 text tokens")
    assert "cpu devices here: 2, 4 (Ulysses attention" in str(degree.value)
    with pytest.raises(UnsupportedCombination, match="with placement cp only taylorseer"):
        manager.check(ask(model="tiny-flux1", placement="cp", step_cache="pab"))
    checked = manager.check(ask(model="tiny-shapes", placement="cp", cp_size=4, lora="outline"))
    assert (checked.world_size, checked.cp_size, str(checked.key(None))) == (4, 4, "tiny-shapes · cpu · eager · cp4")


def test_the_cli_refuses_a_wrong_degree_before_any_work_naming_those_that_work(capsys):
    status, _, err = cli_main(capsys, "generate", "--prompt", "x", "--model", "tiny-flux2-klein", "--placement", "cp",
                              "--cp", "8", "--size", "64x64")
    assert status == 2 and "error: cp_size=8 is not accepted: a degree that divides the 4 attention heads" in err
    assert "with that many cpu devices here: 2, 4" in err and "loading" not in err


# --- the same image, on real pools -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("model, placement", [("tiny-sd3", "cfg"), ("tiny-flux2-klein", "cp"), ("tiny-shapes", "cp")])
def test_the_same_seed_draws_the_same_image_as_on_one_device(engine, model, placement):
    alone = engine.generate(ask(model=model))
    split = engine.generate(ask(model=model, placement=placement))
    assert split.key.placement is Placement(placement) and split.facts()["world_size"] == 2
    assert split.image.size == (128, 128) and pixels(split).std() > 5
    assert close_to(split, alone), np.abs(pixels(split) - pixels(alone)).max()


@pytest.mark.slow
@pytest.mark.parametrize("model, placement", [("tiny-sd3", "cfg"), ("tiny-flux2-klein", "cp")])
def test_compiled_on_a_pool_compiles_each_shape_once_per_rank(engine, model, placement):
    first = engine.generate(ask(model=model, placement=placement, mode="compiled", resolution="64x64"))
    again = engine.generate(ask(model=model, placement=placement, mode="compiled", resolution="64x64", seed=3))
    assert first.new_graphs >= 1 and again.new_graphs == 0 and again.warm
    assert close_to(again, engine.generate(ask(model=model, mode="compiled", resolution="64x64", seed=3)))
    assert f"{placement}2" in str(again.key)  # its own pipeline: the graph key includes the placement


@pytest.mark.slow
def test_previews_step_caches_styles_and_edits_hold_on_cfg_and_cp_pools(engine):
    previews = []
    shown = engine.generate(ask(model="tiny-shapes", placement="cp", previews=True),
                            lambda event: previews.append(event) if event.preview is not None else None)
    assert len(previews) >= 2 and previews[-1].preview.shape.width == 128  # from rank 0
    cached = engine.generate(ask(model="tiny-sd3", placement="cfg", step_cache="taylorseer", steps=10))
    assert cached.facts()["step_cache"]["skipped"] == 5  # both ranks skip the same calls
    assert close_to(cached, engine.generate(ask(model="tiny-sd3", step_cache="taylorseer", steps=10)))
    styled = engine.generate(ask(model="tiny-shapes", placement="cp", lora="outline"))
    assert close_to(styled, engine.generate(ask(model="tiny-shapes", lora="outline")))
    assert np.abs(pixels(styled) - pixels(shown)).max() > 40  # the outline: 22 px across, at 128x128
    picture = io.BytesIO()
    shown.image.save(picture, format="PNG")
    edited = engine.generate(ask(model="tiny-sd3", placement="cfg", image=picture.getvalue(), strength=0.5))
    assert close_to(edited, engine.generate(ask(model="tiny-sd3", image=picture.getvalue(), strength=0.5)))


@pytest.mark.slow
def test_requests_waiting_for_a_cp_pool_are_drawn_in_one_call_and_one_can_be_stopped(engine):
    engine.generate(ask(model="tiny-shapes", placement="cp", steps=2))  # the pool is up
    holder = DeviceHolder(engine)
    holder.start()
    try:
        jobs = [engine.submit(engine.check(ask(model="tiny-shapes", placement="cp", steps=2, seed=seed)))
                for seed in (5, 6)]
    finally:
        holder.release()
    together = [job.result(120) for job in jobs]
    assert [r.batch for r in together] == [2, 2] and together[0].call == together[1].call
    assert close_to(together[1], engine.generate(ask(model="tiny-shapes", placement="cp", steps=2, seed=6)))
    job = []
    job.append(engine.submit(engine.check(ask(model="tiny-sd3", placement="cfg", steps=10)),
                             lambda event: job[0].cancel() if event.step == 2 else None))
    # Stop reaches rank 0 over the app's channel while the ranks step on: it ends the call at the next step it sees.
    with pytest.raises(Cancelled, match=r"after [2-5] of 10 steps"):
        job[0].result(120)


@pytest.mark.slow
def test_a_rank_killed_mid_call_fails_the_call_clearly_and_the_group_restarts(fresh_manager):
    manager = fresh_manager()
    request = ask(model="tiny-shapes", placement="cp", steps=40)
    first = manager.generate(request)
    executor = manager.backend.executor.executor_for(first.key)
    victim = executor.health()[0].ranks[1].pid

    def kill_at_step_2(event):
        if event.phase is Phase.DENOISE and event.step == 2:
            os.kill(victim, signal.SIGKILL)

    with pytest.raises(GenerationFailed, match=r"lost a rank during the request: rank 1 \(pid \d+\) was killed by "
                                               r"SIGKILL; the pool restarts on the next request"):
        manager.generate(request, kill_at_step_2)
    again = manager.generate(request)
    assert np.array_equal(pixels(again), pixels(first))
    assert executor.health()[0].ranks[1].pid != victim


# --- the proposal -----------------------------------------------------------------------------------------------------

# What the proposal gives each real model on 1, 2, 4 and 8 devices, as the README's table shows it: placement and
# degree, and the replicas the host then holds (`tp4 (needs 4)`: more devices than the host has).
PROPOSALS = {
    ("cuda", "80GB"): {"flux2-klein-4b": ["device x1", "device x2", "device x4", "device x8"],
                       "flux1-schnell": ["device x1", "device x2", "device x4", "device x8"],
                       "sd3.5-medium": ["device x1", "cfg2 x1", "cfg2 x2", "cfg2 x4"],
                       "flux2-dev": ["offload x1", "offload x2", "offload x4", "offload x8"]},
    ("neuron", "24GiB"): {"flux2-klein-4b": ["device x1", "device x2", "device x4", "device x8"],
                          "flux1-schnell": ["tp4 (needs 4)", "tp4 (needs 4)", "tp4 x1", "tp4 x2"],
                          "sd3.5-medium": ["device x1", "cfg2 x1", "cfg2 x2", "cfg2 x4"],
                          "flux2-dev": ["tp8 (needs 8)", "tp8 (needs 8)", "tp8 (needs 8)", "tp8 x1"]},
}


def proposal_cell(name: str, hardware: str, devices: int, memory: str) -> str:
    planned = plan(CATALOG[name], described_host(hardware, devices, memory), Settings.from_env())
    proposal = planned.proposal
    label = placement_label(proposal.placement, proposal.tp_size, proposal.cp_size)
    world = proposal.world_size
    return f"{label} (needs {world})" if world > devices else f"{label} x{proposal.replicas}"


@pytest.mark.parametrize("host", list(PROPOSALS))
def test_the_proposal_for_the_real_models_on_1_2_4_and_8_devices(host):
    hardware, memory = host
    found = {name: [proposal_cell(name, hardware, n, memory) for n in (1, 2, 4, 8)] for name in PROPOSALS[host]}
    assert found == PROPOSALS[host]


def test_large_shapes_on_a_multi_device_host_propose_context_parallel():
    host = described_host("cuda", 8, "80GB")
    wide = plan(CATALOG["flux1-schnell"], host, Settings.from_env(), shape=Shape(2048, 2048))
    assert (wide.proposal.placement, wide.degrees) == (Placement.CP, {"tp": 1, "cfg": 1, "cp": 8})
    assert "16384 image tokens" in wide.proposal.reason and wide.cp_sizes == (2, 4, 8)
    sd3 = plan(CATALOG["sd3.5-medium"], host, Settings.from_env())
    assert sd3.degrees["cfg"] == 2 and "one per device halves the step (CFG parallel)" in sd3.proposal.reason


def test_a_fleet_replica_of_a_cfg_group_is_one_actor_with_two_devices():
    from acceldemo.fleet.ray_fleet import plan_fleet

    fleet = plan_fleet(dataclasses.replace(Settings.from_env(), default_model="sd3.5-medium"),
                       {"CPU": 32.0, "GPU": 8.0})
    assert (fleet.devices_per_replica, fleet.replicas) == (2, 4) and fleet.actor_options["num_gpus"] == 2
    assert "CFG parallel" in fleet.reason


def test_cfg_and_cp_are_refused_where_the_whole_pipeline_does_not_fit_one_device():
    from acceldemo.engine.validation import check_request
    from acceldemo.hardware import HardwareRegistry

    settings = dataclasses.replace(Settings.from_env(), device_memory_gb={"cpu": 2.0})
    with pytest.raises(UnsupportedCombination, match=r"placement 'cp' holds the whole pipeline on every rank, and "
                                                     r"its 33\.7 GB of weights exceed one cpu device \(2\.1 GB\)"):
        check_request(GenerateParams(prompt="x", model="flux1-schnell", hardware="cpu", placement="cp"), settings,
                      HardwareRegistry(settings))
