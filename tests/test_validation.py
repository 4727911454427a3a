"""Every invalid request gets a typed error naming the field and what is accepted."""
import pytest

from acceldemo.config import Settings
from acceldemo.engine import mode_options, propose_placement
from acceldemo.engine.validation import MAX_SEED, check_placement
from acceldemo.engine.validation import check_request as check_with
from acceldemo.errors import HardwareUnavailable, InvalidRequest, UnknownName, UnsupportedCombination
from acceldemo.hardware import Availability, HardwareRegistry
from acceldemo.hardware.base import GiB
from acceldemo.hardware.tpu import TpuHardware
from acceldemo.models.catalog import CATALOG
from acceldemo.records import GenerateParams, Mode, Placement, Request, Shape

SETTINGS = Settings.from_env()
HARDWARE = HardwareRegistry(SETTINGS)


def check_request(params: GenerateParams) -> Request:
    return check_with(params, SETTINGS, HARDWARE)


def req(**kw) -> GenerateParams:
    return GenerateParams(**{"prompt": "a red circle", "hardware": "cpu", **kw})


BAD = [
    ({"model": "flux3"}, UnknownName, "model='flux3' is not accepted: known values are flux1-schnell"),
    ({"hardware": "gpu"}, UnknownName, "hardware='gpu' is not accepted: known values are cpu, cuda, neuron, tpu"),
    ({"mode": "fast"}, UnknownName, "mode='fast' is not accepted: known values are compiled, eager"),
    ({"placement": "cloud"}, UnknownName, "placement='cloud' is not accepted"),
    ({"resolution": "65x64"}, InvalidRequest, "width=65 is not accepted: tiny-flux2-klein needs a multiple of 16 from 64 to 512 — try 64"),
    ({"resolution": "64x1000"}, InvalidRequest, "height=1000 is not accepted: a whole number from 64 to 512"),
    ({"resolution": "0x64"}, InvalidRequest, "width=0"),
    ({"resolution": "-64x64"}, InvalidRequest, "resolution='-64x64' is not accepted: WIDTHxHEIGHT"),
    ({"resolution": "widex64"}, InvalidRequest, "resolution='widex64' is not accepted: WIDTHxHEIGHT, e.g. 1024x1024"),
    ({"resolution": f"{10**30}x64"}, InvalidRequest, "a whole number from 64 to 512"),
    ({"resolution": True}, InvalidRequest, "resolution=True"),
    ({"resolution": Shape(64, 72)}, InvalidRequest, "height=72 is not accepted"),
    ({"steps": 0}, InvalidRequest, "steps=0 is not accepted: a whole number from 1 to 100"),
    ({"steps": -3}, InvalidRequest, "steps=-3"),
    ({"steps": 10**6}, InvalidRequest, "steps=1000000"),
    ({"steps": 2.5}, InvalidRequest, "steps=2.5"),
    ({"guidance": float("nan")}, InvalidRequest, "guidance=nan is not accepted: a number from 0 to 30"),
    ({"guidance": float("inf")}, InvalidRequest, "guidance=inf"),
    ({"guidance": -1}, InvalidRequest, "guidance=-1"),
    ({"guidance": "lots"}, InvalidRequest, "guidance='lots'"),
    ({"seed": -1}, InvalidRequest, "seed=-1 is not accepted: a whole number from 0 to"),
    ({"seed": 2**64}, InvalidRequest, "seed="),
    ({"seed": "abc"}, InvalidRequest, "seed='abc'"),
    ({"prompt": ""}, InvalidRequest, "prompt='' is not accepted: a non-empty text"),
    ({"prompt": "   \n "}, InvalidRequest, "a non-empty text"),
    ({"prompt": "x" * 100_000}, InvalidRequest, "at most 2000 characters (got 100000)"),
    ({"prompt": "bell\x07"}, InvalidRequest, "text without control characters"),
    ({"prompt": None}, InvalidRequest, "prompt=None"),
    ({"num_images": 0}, InvalidRequest, "num_images=0"),
    ({"num_images": 5}, InvalidRequest, "num_images=5 is not accepted: a whole number from 1 to 4"),
    ({"seed": MAX_SEED, "num_images": 2}, InvalidRequest, f"a whole number from 0 to {MAX_SEED - 1}"),
    ({"placement": Mode.EAGER}, UnknownName, "placement='eager' is not accepted: known values are cfg, cp, device, offload, tp"),
    ({"mode": ["eager"]}, UnknownName, "mode=['eager'] is not accepted"),
    ({"mode": "eager-fused"}, UnsupportedCombination, "cpu does not offer it; only tpu does"),
    ({"model": "tiny-sd3", "mode": "regional"}, UnsupportedCombination, "has no repeated blocks"),
    ({"mode": "compiled", "placement": "offload"}, UnsupportedCombination,
     "offload hooks cannot be traced: with offload only regional or eager"),
    ({"model": "tiny-sd3", "placement": "tp", "tp_size": 2}, UnsupportedCombination, "no tensor-parallel plan"),
    ({"placement": "tp", "tp_size": 3}, InvalidRequest, "a divisor of the 4 transformer attention heads and the 4 "
                                                        "text encoder attention heads"),
    ({"hardware": "neuron"}, HardwareUnavailable, "hardware 'neuron' is not available here: torch_neuronx is not installed"),
    ({"hardware": "tpu"}, HardwareUnavailable, "torch_tpu is not installed"),
]


@pytest.mark.parametrize("fields,error,message", BAD, ids=[str(b[0])[:40] for b in BAD])
def test_invalid_request_gets_a_typed_error_naming_the_field(fields, error, message):
    with pytest.raises(error) as raised:
        check_request(req(**fields))
    assert message in str(raised.value)


def test_defaults_come_from_the_model_the_host_and_the_engine():
    r = check_request(GenerateParams(prompt="  a cat  "))
    spec = CATALOG["tiny-flux2-klein"]
    assert (r.model, r.hardware, r.mode, r.placement, r.tp_size) == ("tiny-flux2-klein", "cpu", Mode.EAGER,
                                                                      Placement.DEVICE, 1)
    assert (r.shape, r.steps, r.guidance, r.prompt, r.num_images, r.devices) == (Shape(64, 64), spec.steps,
                                                                                 spec.guidance, "a cat", 1, None)
    assert 0 <= r.seed <= MAX_SEED and check_request(GenerateParams(prompt="a cat")).seed != r.seed  # drawn each time


def test_a_checked_request_is_fully_typed():
    r = check_request(req(resolution=" 128 x 64 ", steps="3", guidance="2.5", seed="42", mode="compiled",
                          placement="device", num_images=2.0))
    assert (r.shape, r.steps, r.guidance, r.seed, r.seeds, r.num_images) == (Shape(128, 64), 3, 2.5, 42, (42, 43), 2)
    assert type(r.steps) is int and type(r.guidance) is float and type(r.seed) is int
    assert r.mode is Mode.COMPILED and r.placement is Placement.DEVICE and r.model == "tiny-flux2-klein" \
        and r.graph == CATALOG["tiny-flux2-klein"].graph_rule
    with pytest.raises(AttributeError):
        r.steps = 5  # frozen


def test_sd3_offers_no_regional_mode_and_says_why():
    options = {o.name: o for o in mode_options(CATALOG["sd3.5-medium"], TpuHardware(SETTINGS), Placement.DEVICE)}
    assert options["eager-fused"].ok and options["compiled"].ok
    assert not options["regional"].ok and "no repeated blocks" in options["regional"].reason


@pytest.mark.parametrize("model,memory_gib,count,placement,tp", [
    ("flux2-klein-4b", 24, 64, "device", 1),   # fits one NeuronCore
    ("flux1-schnell", 32, 4, "offload", 1),    # does not fit one v6e chip, each component does
    ("sd3.5-medium", 32, 1, "device", 1),      # ~16 GB fits one v6e chip
    ("sd3.5-medium", 32, 4, "cfg", 1),         # and a second device takes the other guidance branch
    ("flux2-dev", 24, 64, "tp", 8),            # 64 + 47 GB sharded: 14 GB per 24 GiB core at 8, 28 GB at 4
    ("flux2-dev", 32, 8, "tp", 4),            # v6e chips
    ("flux2-dev", 96, 16, "offload", 1),      # a whole trn2 chip holds each component
])
def test_placement_is_proposed_from_weights_and_device_memory(model, memory_gib, count, placement, tp):
    proposal = propose_placement(CATALOG[model], Availability(True, "", count, memory_gib * GiB))
    assert (proposal.placement, proposal.tp_size) == (placement, tp)
    assert "GB" in proposal.reason


class _V6eHost(TpuHardware):
    """A TPU host of 8 v6e chips, as detection reports it."""

    def detect(self) -> Availability:
        return Availability(True, "8 x TPU v6e", 8, 32 * GiB, "TPU v6e")


def test_tp_size_the_tpu_launcher_cannot_start_is_refused_naming_the_sizes_that_work():
    with pytest.raises(InvalidRequest) as raised:
        check_placement(CATALOG["flux2-dev"], _V6eHost(SETTINGS), Placement.TP, 2)
    assert str(raised.value) == ("tp_size=2 is not accepted: TPU v6e runs tensor parallel on 1, 4 or 8 chips — "
                                 "2 is not one of them")
    assert [check_placement(CATALOG["flux2-dev"], _V6eHost(SETTINGS), Placement.TP, size) for size in (4, 8)] == [4, 8]


@pytest.mark.parametrize("sizes, tp", [(None, 2), ((1, 4, 8), 4), ((2, 4, 8), 2)])
def test_tensor_parallel_is_proposed_only_over_sizes_the_launcher_accepts(sizes, tp):
    # FLUX.2-dev's two components, sharded, fit two 64 GiB devices (56 GB each); its transformer alone does not fit one.
    proposal = propose_placement(CATALOG["flux2-dev"], Availability(True, "", 8, 64 * GiB), sizes)
    assert (proposal.placement, proposal.tp_size) == ("tp", tp)


@pytest.mark.parametrize("model, count, placement, replicas, says", [
    ("flux2-klein-4b", 8, "device", 8, "fit one of 8 device(s) (25.8 GB each): 8 replicas, one per device"),
    ("flux2-klein-4b", 1, "device", 1, "fit one of 1 device(s) (25.8 GB each)"),
    ("flux2-dev", 8, "tp", 2, "tensor parallel over 4 holds 27.9 GB per device: 2 replicas, 4 devices each"),
])
def test_the_proposal_says_how_many_replicas_the_host_holds(model, count, placement, replicas, says):
    memory = {"device": 24, "tp": 32}[placement] * GiB
    proposal = propose_placement(CATALOG[model], Availability(True, "", count, memory), (1, 4, 8))
    assert (proposal.placement, proposal.replicas) == (placement, replicas)
    assert proposal.reason.endswith(says), proposal.reason
