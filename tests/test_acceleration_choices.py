"""Quantized weights, the exact-result cache and the comparison of two configurations, through the engine, the /v1
route (the official openai SDK), the page's API (gradio_client) and the CLI."""
import json

import numpy as np
import openai
import pytest

from acceldemo.config import Settings
from acceldemo.engine import as_json
from acceldemo.engine.validation import propose_placement
from acceldemo.errors import InvalidRequest, UnknownName, UnsupportedCombination
from acceldemo.hardware.base import Availability, GiB
from acceldemo.hardware.cpu import CpuHardware
from acceldemo.hardware.cuda import CudaHardware
from acceldemo.models.catalog import get_model
from acceldemo.records import GenerateParams, Placement, Quantization
from acceldemo.ui.server import create_app, parse_warmup
from tests.engines import serving
from tests.test_cli import main

PROMPT = "a red circle on a blue background, top left"


def ask(**kw) -> GenerateParams:
    return GenerateParams(**{"prompt": PROMPT, "model": "tiny-shapes", "hardware": "cpu", "resolution": "64x64",
                             "seed": 5, **kw})


def pixels(result) -> np.ndarray:
    return np.asarray(result.image, dtype=np.int16)


# --- quantized weights ---------------------------------------------------------------------------------------------

def test_int8_is_a_pipeline_of_its_own_holding_under_half_the_bytes(fresh_manager):
    m = fresh_manager()
    plain = m.generate(ask())
    int8 = m.generate(ask(quantization="int8"))
    assert int8.key != plain.key and int8.key.quantization is Quantization.INT8 and "int8" in str(int8.key)
    assert m.snapshot().counters.loads == 2
    assert int8.facts()["quantization"] == "int8" and 0 < int8.weight_bytes <= 0.55 * plain.weight_bytes
    assert int8.image.size == (64, 64) and np.abs(pixels(int8) - pixels(plain)).mean() < 4


@pytest.mark.slow  # two quantized compiles: outside the quick tier, run in CI
def test_int8_compiles_once_per_shape_and_keeps_its_style_slot(fresh_manager):
    m = fresh_manager()
    first = m.generate(ask(quantization="int8", mode="compiled"))
    again = m.generate(ask(quantization="int8", mode="compiled", seed=6))
    styled = m.generate(ask(quantization="int8", mode="compiled", seed=6, lora="outline"))
    assert first.new_graphs >= 1 and again.new_graphs == 0 and styled.new_graphs == 0
    assert first.compile_cache_hits == 0  # not an AOTInductor package: those hold plain tensors only
    assert np.abs(pixels(styled) - pixels(again)).mean() > 2


def test_fp8_and_sharded_quantized_weights_are_refused_by_name(manager):
    with pytest.raises(UnsupportedCombination, match="cpu has no fp8 matmul torchao drives") as fp8:
        manager.check(ask(quantization="fp8"))
    assert fp8.value.field == "quantization"
    with pytest.raises(UnsupportedCombination, match="sharded loading refuses quantized weights"):
        manager.check(ask(model="tiny-flux2-klein", quantization="int8", placement="tp", tp_size=2))
    with pytest.raises(UnknownName, match="known values are fp8, int8, none"):
        manager.check(ask(quantization="int4"))


def test_fp8_needs_an_ada_or_hopper_gpu():
    settings = Settings.from_env()
    ampere = CudaHardware(settings, Availability(True, "1 x A100", 1, 80 * GiB, "sm_80"))
    hopper = CudaHardware(settings, Availability(True, "1 x H100", 1, 80 * GiB, "sm_90"))
    assert "sm_80: fp8 matmuls need sm_89 or newer" in ampere.quantization_refusal(Quantization.FP8)
    assert hopper.quantization_refusal(Quantization.FP8) is None
    assert ampere.quantization_refusal(Quantization.INT8) is None
    assert CpuHardware(settings).quantization_refusal(Quantization.INT8) is None


def test_the_placement_proposal_weighs_the_quantized_bytes():
    schnell = get_model("flux1-schnell")  # 33.7 GB in bf16; its transformer 23.8 GB
    one_gpu = Availability(True, "1 x V100", 1, 32 * GiB)
    assert propose_placement(schnell, one_gpu).placement is Placement.OFFLOAD
    int8 = propose_placement(schnell, one_gpu, quantization=Quantization.INT8)
    assert int8.placement is Placement.DEVICE and int8.reason.startswith("int8 weights: 16.9 GB of weights fit one")


# --- the exact-result cache ----------------------------------------------------------------------------------------

def test_an_identical_request_is_answered_from_the_result_cache(fresh_manager):
    m = fresh_manager(result_cache=4)
    drawn = m.generate(ask(step_cache="taylorseer", steps=8))
    again = m.generate(ask(step_cache="taylorseer", steps=8))
    assert again.from_cache and again.facts()["from_cache"] and not drawn.from_cache
    assert np.array_equal(pixels(drawn), pixels(again)) and again.seconds < 0.05 < drawn.seconds
    for other in (ask(step_cache="taylorseer", steps=8, seed=6), ask(steps=8), ask(step_cache="taylorseer", steps=9),
                  ask(step_cache="taylorseer", steps=8, quantization="int8"), ask(step_cache="taylorseer", steps=8,
                                                                                  prompt="a green square")):
        assert not m.generate(other).from_cache
    assert not m.generate(ask(seed=None)).from_cache  # no seed: a new picture each time
    counters = m.snapshot().counters
    assert counters.result_cache_hits == 1 and counters.requests["ok"] == 8


def test_the_result_cache_is_off_by_default_and_on_in_a_space():
    assert Settings.from_env({}).result_cache == 0
    assert Settings.from_env({"SPACE_ID": "someone/acceldemo"}).result_cache == 32
    assert Settings.from_env({"SPACE_ID": "x", "ACCELDEMO_RESULT_CACHE": "0"}).result_cache == 0
    with pytest.raises(ValueError, match="ACCELDEMO_RESULT_CACHE"):
        Settings.from_env({"ACCELDEMO_RESULT_CACHE": "-1"})


def test_a_repeat_without_the_cache_is_drawn_again(manager):
    assert not manager.generate(ask()).from_cache and not manager.generate(ask()).from_cache


# --- comparing two configurations ----------------------------------------------------------------------------------

@pytest.mark.slow  # a compiled side at a shape of its own: outside the quick tier, run in CI
def test_a_comparison_draws_one_prompt_and_seed_twice_and_measures_the_difference(fresh_manager):
    m = fresh_manager()
    # 128x128: a shape no test before tests/test_edits.py compiles (dynamo's graphs live as long as the process).
    comparison = m.submit_comparison(ask(seed=None, steps=12, resolution="128x128"),
                                     ask(step_cache="taylorseer", mode="compiled", steps=12, prompt="ignored",
                                         seed=99)).result(300)
    a, b = comparison.first.request, comparison.second.request
    assert (b.prompt, b.seed, b.shape) == (a.prompt, a.seed, a.shape) and b.mode.value == "compiled"
    facts = comparison.facts()
    assert [s["step_cache"]["ran"] for s in facts["sides"]] == ["none", "taylorseer"]
    assert facts["sides"][1]["step_cache"]["skipped"] == 7 and facts["speedup"] > 0
    assert 0 < facts["mean_abs_difference"] < 8 and facts["psnr_db"] > 20 and not facts["identical"]
    same = m.submit_comparison(ask(), ask()).result(300).facts()
    assert same["identical"] and same["psnr_db"] is None and same["mean_abs_difference"] == 0
    assert m.snapshot().counters.requests["ok"] == 4  # each side is a request like any other


def test_a_comparison_is_refused_before_any_work(manager):
    with pytest.raises(UnsupportedCombination, match="step_cache 'pab'"):
        manager.submit_comparison(ask(), ask(mode="compiled", step_cache="pab"))
    with pytest.raises(InvalidRequest, match="a comparison draws one image per side"):
        manager.submit_comparison(ask(num_images=2), ask())


@pytest.mark.slow
def test_the_cli_compares_two_configurations(capsys, tmp_path):
    status, out, err = main(capsys, "compare", "--prompt", PROMPT, "--model", "tiny-shapes", "--seed", "3",
                            "--steps", "12", "--a", "mode=eager", "--b", "mode=eager,step-cache=taylorseer",
                            "--out", str(tmp_path), "--json")
    assert status == 0, err
    facts = json.loads(out)
    assert facts["seed"] == 3 and [s["step_cache"]["ran"] for s in facts["sides"]] == ["none", "taylorseer"]
    assert len(facts["paths"]) == 2 and all(p.endswith(".png") for p in facts["paths"])
    status, out, _ = main(capsys, "compare", "--prompt", PROMPT, "--model", "tiny-shapes", "--seed", "3",
                          "--steps", "12", "--b", "step_cache=taylorseer", "--out", str(tmp_path))
    assert status == 0 and "B's speed ÷ A's:" in out and "mean |A-B|" in out and "7 skipped" in out
    status, _, err = main(capsys, "compare", "--prompt", PROMPT, "--b", "warp=9", "--out", str(tmp_path))
    assert status == 2 and "error: b='warp=9' is not accepted: KEY=VALUE with KEY one of hardware" in err


# --- the front ends' fields ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_v1_route_takes_step_cache_and_quantization(fresh_manager):
    with serving(create_app(fresh_manager(default_model="tiny-shapes", result_cache=4))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        asked = dict(model="tiny-shapes", prompt=PROMPT, size="64x64")
        first = client.images.generate(**asked, extra_body={"seed": 3, "num_inference_steps": 10,
                                                            "step_cache": "taylorseer", "quantization": "int8"})
        facts = first.acceldemo[0]
        assert facts["step_cache"]["skipped"] == 5 and facts["quantization"] == "int8" and not facts["from_cache"]
        again = client.images.generate(**asked, extra_body={"seed": 3, "num_inference_steps": 10,
                                                            "step_cache": "taylorseer", "quantization": "int8"})
        assert again.acceldemo[0]["from_cache"] and again.data[0].b64_json == first.data[0].b64_json
        for field, value, message in (("step_cache", "mag", "no calibrated magnitude ratios"),
                                      ("quantization", "fp8", "no fp8 matmul")):
            with pytest.raises(openai.BadRequestError) as refused:
                client.images.generate(**asked, extra_body={field: value})
            assert refused.value.body["param"] == field and message in refused.value.body["message"]
        models = {m.id: m for m in client.models.list()}
        caches = {c["name"]: c for c in models["tiny-shapes"].step_caches}
        assert caches["taylorseer"]["refused"] is None and caches["pab"]["eager_only"]
        assert "FirstBlockCache" in caches["first-block"]["refused"]
        status = json.loads(__import__("urllib.request").request.urlopen(url + "/status").read())
        assert status["counters"]["step_caches"]["taylorseer"]["skipped"] == 5
        assert status["counters"]["result_cache_hits"] == 1


def test_a_warm_up_spec_takes_quantization_and_step_cache():
    mode, shapes, batches, options = parse_warmup("compiled:64x64,128x64@1,2:quantization=int8,step_cache=auto")
    assert (mode, [str(s) for s in shapes], batches) == ("compiled", ["64x64", "128x64"], (1, 2))
    assert options == {"quantization": "int8", "step_cache": "auto"}
    assert parse_warmup("eager:64x64")[3] == {}
    with pytest.raises(InvalidRequest, match="warp is not one of quantization, step_cache"):
        parse_warmup("eager:64x64:warp=1")


@pytest.mark.slow  # a real compile (or a real process) end to end: the full suite runs it
def test_an_int8_warm_up_compiles_the_int8_pipeline(fresh_manager):
    m = fresh_manager()
    m.start_warm_up("compiled", [get_model("tiny-shapes").default_shape], model="tiny-shapes",
                    quantization="int8")
    deadline = __import__("time").time() + 300
    while not m.startup.ready:
        assert __import__("time").time() < deadline
        __import__("time").sleep(0.2)
    assert m.startup.state.value == "done", m.startup.shown
    pipelines = as_json(m.snapshot())["pipelines"]
    assert [p["key"] for p in pipelines] == ["tiny-shapes · cpu:0 · compiled · device · int8"]
    assert m.generate(ask(quantization="int8", mode="compiled")).new_graphs == 0
