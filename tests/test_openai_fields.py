"""The fields OpenAI clients send, through the official `openai` SDK against an app in this process: DALL-E 3 style
(quality, style) and gpt-image style (quality, background, moderation, output_format) requests are served, jpeg and
webp come back as jpeg and webp, what maps is honoured and the facts say what was ignored; unknown fields are still
refused by name; a stream with partial images yields OpenAI's typed events."""
import base64
import io

import openai
import pytest
from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent
from PIL import Image

from acceldemo.ui.openai_protocol import partial_steps
from acceldemo.ui.server import create_app
from tests.engines import serving


@pytest.fixture(scope="module")
def client():
    from tests.engines import new_manager

    engine = new_manager()
    try:
        with serving(create_app(engine)) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        engine.close()


def decoded(b64_json: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64_json)))


def test_a_dall_e_3_style_request_is_served_and_quality_picks_the_models_steps(client):
    answer = client.images.generate(model="tiny-flux2-klein", prompt="a red circle", size="64x64", quality="hd",
                                    style="vivid", response_format="b64_json", n=1, extra_body={"seed": 1})
    image = decoded(answer.data[0].b64_json)
    assert image.format == "PNG" and image.size == (64, 64)
    facts = answer.acceldemo[0]
    assert facts["steps"] == 8 and facts["quality"] == "hd"  # hd is the model's "high" preset
    assert facts["options"]["honoured"]["quality"] == "hd: 8 steps (tiny-flux2-klein's preset)"
    assert facts["options"]["ignored"]["style"] == "vivid: no model here has a style preset"
    low = client.images.generate(prompt="a red circle", size="64x64", quality="low", extra_body={"seed": 1})
    assert low.acceldemo[0]["steps"] == 2


def test_a_gpt_image_style_request_gets_jpeg_and_webp_of_that_format(client):
    for output_format, pil_format in (("jpeg", "JPEG"), ("webp", "WEBP")):
        answer = client.images.generate(model="tiny-flux2-klein", prompt="a blue square", size="128x64",
                                        quality="medium", background="opaque", moderation="low",
                                        output_format=output_format, output_compression=80, user="someone")
        image = decoded(answer.data[0].b64_json)
        assert (image.format, image.size) == (pil_format, (128, 64))
        assert answer.output_format == output_format and answer.quality == "medium"
        options = answer.acceldemo[0]["options"]
        assert options["honoured"]["output_compression"] == f"80: {output_format} quality"
        assert set(options["ignored"]) == {"moderation", "user"} and answer.acceldemo[0]["steps"] == 4


def test_a_quality_beside_explicit_steps_is_ignored_and_says_why(client):
    answer = client.images.generate(prompt="a red circle", size="64x64", quality="high",
                                    extra_body={"num_inference_steps": 3})
    assert answer.acceldemo[0]["steps"] == 3
    assert answer.acceldemo[0]["options"]["ignored"]["quality"] == "high: num_inference_steps=3 was given"


def test_what_cannot_be_drawn_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError, match="background='transparent' is not accepted: opaque or auto: "
                                                     "tiny-flux2-klein draws no alpha channel") as raised:
        client.images.generate(prompt="a red circle", background="transparent", output_format="png")
    assert raised.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError, match="output_format='gif' is not accepted: png, jpeg or webp"):
        client.images.generate(prompt="a red circle", output_format="gif")
    with pytest.raises(openai.BadRequestError, match="quality='ultra' is not accepted: known values are auto"):
        client.images.generate(prompt="a red circle", extra_body={"quality": "ultra"})
    with pytest.raises(openai.BadRequestError, match="num_inference_step=4 is not accepted: unknown field"):
        client.images.generate(prompt="a red circle", extra_body={"num_inference_step": 4})


def test_a_stream_with_partial_images_yields_openais_typed_events(client):
    events = list(client.images.generate(model="tiny-flux2-klein", prompt="a red circle", size="128x64",
                                         stream=True, partial_images=2, output_format="png", extra_body={"seed": 4}))
    partials = [e for e in events if e.type == "image_generation.partial_image"]
    assert partials and all(isinstance(e, ImageGenPartialImageEvent) for e in partials)
    assert [e.partial_image_index for e in partials] == list(range(len(partials))) and len(partials) <= 2
    assert all(decoded(e.b64_json).size == (128, 64) and e.size == "128x64" for e in partials)
    last = events[-1]
    assert isinstance(last, ImageGenCompletedEvent) and last.type == "image_generation.completed"
    assert decoded(last.b64_json).size == (128, 64) and last.output_format == "png"
    ours = [e for e in events if e.type == "acceldemo.progress"]
    assert [e.message for e in ours if e.phase == "denoise"] == [f"step {i}/4" for i in range(1, 5)]


def test_partial_images_spread_over_the_steps_before_the_last():
    assert partial_steps(4, 1) == [2] and partial_steps(4, 2) == [2, 3] and partial_steps(4, 3) == [1, 2, 3]
    assert partial_steps(28, 3) == [7, 14, 21] and partial_steps(1, 3) == [1] and partial_steps(4, 0) == []
