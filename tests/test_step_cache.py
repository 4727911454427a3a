"""Step caches as a choice: every cache on every embedded family served or refused by name (the refusals being what
diffusers really does), no state from one call in the next, compiled graphs untouched, batched only with equal
settings, and with styles, edits, previews and auto."""
import numpy as np
import pytest

from acceldemo.errors import UnknownName, UnsupportedCombination
from acceldemo.models.caches import FAMILY_REFUSALS
from acceldemo.models.catalog import CATALOG, cache_refusal, get_model
from acceldemo.models.families import PipelineFamily
from acceldemo.records import GenerateParams, StepCache
from tests.test_batching import drawn_while_held

TINY = ("tiny-shapes", "tiny-flux2-klein", "tiny-flux1", "tiny-sd3", "tiny-flux2")
PROMPT = "a red circle on a blue background, top left"


def pixels(result) -> np.ndarray:
    return np.asarray(result.image, dtype=np.int16)


def ask(**kw) -> GenerateParams:
    return GenerateParams(**{"prompt": PROMPT, "model": "tiny-shapes", "hardware": "cpu", "resolution": "64x64",
                             "steps": 8, "seed": 5, **kw})


@pytest.mark.heavy
@pytest.mark.parametrize("model", TINY)
def test_every_cache_on_every_family_is_served_or_refused_by_name(manager, model):
    spec = get_model(model)
    plain = manager.generate(ask(model=model))
    for cache in StepCache:
        refusal = cache_refusal(spec, cache)
        if refusal:
            with pytest.raises(UnsupportedCombination) as refused:
                manager.check(ask(model=model, step_cache=str(cache)))
            assert f"step_cache '{cache}' is not possible here: {refusal}" == str(refused.value)
            continue
        result = manager.generate(ask(model=model, step_cache=str(cache)))
        facts = result.facts()["step_cache"]
        assert (facts["ran"], facts["calls"]) == (str(cache), 8), facts
        assert result.image.size == (64, 64) and pixels(result).std() > 1  # an image, not a flat colour
        if cache is StepCache.TAYLORSEER:  # computes steps 0, 1, 3, 6: the others come from the series
            assert facts["skipped"] == 4
            assert np.abs(pixels(result) - pixels(plain)).mean() < 8  # close to the image without the cache


def _diffusers_call(pipe, spec, config=None) -> np.ndarray:
    import torch

    if config is not None:
        pipe.transformer.enable_cache(config)
    try:
        return pipe(prompt=PROMPT, height=64, width=64, num_inference_steps=8, guidance_scale=spec.guidance,
                    max_sequence_length=spec.max_sequence_length, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images
    finally:
        if config is not None:
            pipe.transformer.disable_cache()


@pytest.mark.heavy
def test_each_family_refusal_is_what_diffusers_does():
    """The table of refusals holds against diffusers itself: the block caches raise on the families they are refused
    for, SeaCache changes nothing there, and SD3's transformer has no enable_cache."""
    import diffusers
    from diffusers.hooks import SeaCacheConfig

    from acceldemo.config import Settings
    from acceldemo.models.loading import load_pipeline

    settings = Settings.from_env()
    for model in ("tiny-shapes", "tiny-flux1", "tiny-sd3", "tiny-flux2"):
        spec = get_model(model)
        pipe = load_pipeline(spec, settings)
        pipe.set_progress_bar_config(disable=True)
        refused = {cache for (family, cache) in FAMILY_REFUSALS if family == spec.family}
        if spec.family is PipelineFamily.SD3:
            assert not hasattr(pipe.transformer, "enable_cache") and refused == {c for c in StepCache
                                                                                  if not c.decides_per_call}
            continue
        plain = _diffusers_call(pipe, spec)
        for cache in refused:
            if cache is StepCache.SEA:
                assert np.array_equal(_diffusers_call(pipe, spec, SeaCacheConfig()), plain)
            elif cache is StepCache.FIRST_BLOCK:
                no_context = spec.family is PipelineFamily.FLUX2
                with pytest.raises(ValueError if no_context else TypeError,
                                   match="cache context" if no_context else "list"):
                    _diffusers_call(pipe, spec, diffusers.FirstBlockCacheConfig(threshold=0.2))
            elif cache is StepCache.FASTER:
                with pytest.raises((TypeError, IndexError)):
                    _diffusers_call(pipe, spec, diffusers.FasterCacheConfig(
                        current_timestep_callback=lambda: pipe.current_timestep, is_guidance_distilled=True,
                        spatial_attention_timestep_skip_range=(-1, 1001)))


def test_unknown_and_refused_caches_are_named_before_any_work(manager):
    with pytest.raises(UnknownName) as unknown:
        manager.check(ask(step_cache="teacache"))
    assert "step_cache" in str(unknown.value) and "taylorseer" in str(unknown.value) and "auto" in str(unknown.value)
    with pytest.raises(UnsupportedCombination) as compiled:
        manager.check(ask(step_cache="pab", mode="compiled"))
    assert "fullgraph compile cannot trace" in str(compiled.value)
    with pytest.raises(UnsupportedCombination) as tp:
        manager.check(ask(model="tiny-flux1", step_cache="first-block", placement="tp", tp_size=2))
    assert "only taylorseer" in str(tp.value)
    assert manager.check(ask(model="tiny-flux1", step_cache="taylorseer", placement="tp", tp_size=2)).step_cache \
        is StepCache.TAYLORSEER


def test_auto_is_the_models_advice_for_its_steps(manager):
    long = manager.check(ask(step_cache="auto", steps=12))
    short = manager.check(ask(step_cache="auto", steps=4))
    assert long.step_cache is StepCache.TAYLORSEER and short.step_cache is None
    assert "from 8 steps" in short.step_cache_why
    assert manager.check(ask(step_cache="none")).step_cache is None
    for spec in CATALOG.values():  # every model's advice is a cache it offers
        assert spec.cache_advice.cache is None or spec.cache_advice.cache in spec.step_caches


@pytest.mark.parametrize("mode", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
def test_the_same_request_three_times_gives_the_same_image(manager, mode):
    from acceldemo.errors import Cancelled

    first = manager.generate(ask(step_cache="taylorseer", mode=mode, steps=10))
    other = manager.generate(ask(step_cache="taylorseer", mode=mode, steps=10, prompt="a green square", seed=9))
    held = []  # a call stopped at its 4th step, its series half made
    held.append(manager.submit(manager.check(ask(step_cache="taylorseer", mode=mode, steps=10, seed=7)),
                               lambda event: held[0].cancel() if event.step == 4 else None))
    with pytest.raises(Cancelled, match="after 4 of 10 steps"):
        held[0].result(60)
    again = [manager.generate(ask(step_cache="taylorseer", mode=mode, steps=10)) for _ in range(2)]
    assert not np.array_equal(pixels(first), pixels(other))
    assert all(np.array_equal(pixels(first), pixels(r)) for r in again)
    assert [r.facts()["step_cache"]["skipped"] for r in (first, *again)] == [5, 5, 5]


@pytest.mark.slow  # a real compile (or a real process) end to end: the full suite runs it
@pytest.mark.parametrize("mode", ["compiled", "regional"])
def test_a_compiled_pipeline_with_a_cache_compiles_nothing_on_the_second_call(manager, mode):
    first = manager.generate(ask(step_cache="taylorseer", mode=mode, resolution="128x64"))
    second = manager.generate(ask(step_cache="taylorseer", mode=mode, resolution="128x64", seed=6))
    plain = manager.generate(ask(mode=mode, resolution="128x64", seed=6))
    assert first.facts()["step_cache"]["skipped"] == 4
    assert second.new_graphs == 0 and second.warm and plain.new_graphs == 0


def test_cached_requests_are_drawn_together_only_with_equal_settings(fresh_manager):
    m = fresh_manager()
    jobs = drawn_while_held(m, [ask(step_cache="taylorseer", seed=1, steps=2),
                                ask(step_cache="taylorseer", seed=2, steps=2),
                                ask(seed=3, steps=2), ask(seed=4, steps=2, step_cache="pab")])
    results = [job.result(120) for job in jobs]
    assert [r.batch for r in results] == [2, 2, 1, 1]
    assert results[0].call == results[1].call and len({r.call for r in results}) == 3
    assert [r.facts()["step_cache"]["ran"] for r in results] == ["taylorseer", "taylorseer", "none", "pab"]
    alone = m.generate(ask(step_cache="taylorseer", seed=2, steps=2))
    assert np.abs(pixels(alone) - pixels(results[1])).max() <= 1  # its image, drawn with another


def test_a_cache_holds_with_a_style_an_edit_and_previews(fresh_manager):
    import io

    m = fresh_manager(default_model="tiny-shapes")
    plain = m.generate(ask(step_cache="taylorseer", steps=10))
    styled = m.generate(ask(step_cache="taylorseer", steps=10, lora="outline"))
    assert np.abs(pixels(plain) - pixels(styled)).mean() > 2 and styled.facts()["step_cache"]["skipped"] == 5
    picture = io.BytesIO()
    plain.image.save(picture, format="PNG")
    edited = m.generate(ask(step_cache="taylorseer", steps=10, image=picture.getvalue(), strength=0.6,
                            prompt="a green circle on a blue background, top left"))
    assert (edited.facts()["step_cache"]["calls"], edited.facts()["step_cache"]["skipped"]) == (6, 3)
    previews = []
    m.generate(ask(step_cache="taylorseer", steps=10, previews=True),
               lambda event: previews.append(event.preview) if event.preview else None)
    assert len(previews) >= 3


def test_status_counts_calls_each_cache_answered(fresh_manager):
    from acceldemo.engine import as_json

    m = fresh_manager()
    m.generate(ask(step_cache="taylorseer", steps=10))
    m.generate(ask(steps=4))
    caches = as_json(m.snapshot())["counters"]["step_caches"]
    assert caches["taylorseer"] == {"calls": 10, "skipped": 5} and caches["none"] == {"calls": 4, "skipped": 0}
