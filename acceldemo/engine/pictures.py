"""An edit's pictures checked: decoded within stated limits, in a format people upload, fitted to a size the model
takes; and the mask (OpenAI's: transparent where the picture may change) turned into the region that changes."""
from __future__ import annotations

import io
import warnings

from ..errors import InvalidRequest, UnsupportedCombination
from ..models.catalog import ModelSpec
from ..records import STRENGTH_METHODS, EditInput, EditMethod, Shape

# What an upload may be: the Images API's formats, and limits stated to whoever sends more.
FORMATS = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 4096 * 4096
# What an edit changes when it names no strength (image-to-image models).
DEFAULT_STRENGTH = 0.8
_ACCEPTED = (f"a PNG, JPEG or WebP picture of at most {MAX_IMAGE_BYTES // (1024 * 1024)} MB and "
             f"{MAX_IMAGE_PIXELS // 1_000_000} megapixels")


def _as_list(value: object) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def decode(field: str, data: object):
    """An uploaded picture (encoded bytes, or a PIL image a front end already holds) as a PIL image; a clear error
    for anything else: not a picture, too large, a format people do not upload."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(data, Image.Image):
        picture, kind = data, data.format or "PNG"
    elif isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        if len(data) > MAX_IMAGE_BYTES:
            raise InvalidRequest(field, f"{len(data)} bytes", _ACCEPTED)
        if not data:
            raise InvalidRequest(field, "an empty file", _ACCEPTED)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                picture = Image.open(io.BytesIO(data))
                picture.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise InvalidRequest(field, "a picture of too many pixels", _ACCEPTED) from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
            raise InvalidRequest(field, "a file that is not a picture", _ACCEPTED) from None
        kind = picture.format or ""
    else:
        raise InvalidRequest(field, type(data).__name__, _ACCEPTED)
    if kind not in FORMATS:
        raise InvalidRequest(field, f"a {kind or 'unknown'} file", _ACCEPTED)
    if picture.width * picture.height > MAX_IMAGE_PIXELS:
        raise InvalidRequest(field, f"a {picture.width}x{picture.height} picture", _ACCEPTED)
    picture.format = kind
    return picture


def nearest_size(spec: ModelSpec, picture) -> Shape:
    """The size an edit that names none is drawn at: the picture's own where the model offers it, else the model's
    preset of the nearest proportions (its default first, then the closest in area)."""
    own = Shape(picture.width, picture.height)
    if own in spec.presets:
        return own
    ratio, area = picture.width / picture.height, picture.width * picture.height
    return min(spec.presets, key=lambda s: (round(abs(s.width / s.height - ratio), 6), s != spec.default_shape,
                                            abs(s.width * s.height - area)))


def _fit(picture, shape: Shape, resample=None):
    """The picture scaled to cover the size and cut to it, centred (proportions kept)."""
    from PIL import Image, ImageOps

    return ImageOps.fit(picture, (shape.width, shape.height), method=resample or Image.Resampling.LANCZOS)


def _png(picture) -> bytes:
    out = io.BytesIO()
    picture.save(out, "PNG")
    return out.getvalue()


def check_strength(strength: object) -> float:
    """A strength of (0, 1]: any of them denoises at least one step (diffusers' rule keeps the last)."""
    accepted = "a number greater than 0 and at most 1"
    try:
        value = float(strength) if not isinstance(strength, bool) and len(str(strength)) < 40 else float("nan")
    except (TypeError, ValueError):
        raise InvalidRequest("strength", strength, accepted) from None
    if not 0 < value <= 1:
        raise InvalidRequest("strength", strength, accepted)
    return value


def check_edit(spec: ModelSpec, images: object, mask: object, strength: object,
               shape: Shape | None) -> tuple[EditInput, Shape]:
    """The edit's pictures at the request's size (or the model's preset nearest their proportions when it names
    none), and the size; or the first thing wrong with them. With a mask the edit inpaints: one picture, repainted
    where the mask is transparent, at the strength."""
    pictures = [decode("image", data) for data in _as_list(images)]
    if not pictures:
        raise InvalidRequest("image", "no picture", _ACCEPTED)
    masked = mask is not None and mask != b"" and mask != ""
    if masked and not spec.inpaints:
        raise UnsupportedCombination("mask", f"mask: {spec.name} cannot inpaint (it edits the whole picture "
                                             + ("with reference images" if spec.edits == EditMethod.REFERENCE else
                                                "by image-to-image") + "); send the edit without a mask")
    allowed = spec.max_references if spec.edits == EditMethod.REFERENCE and not masked else 1
    if len(pictures) > allowed:
        how = "it repaints one picture where the mask is transparent" if masked else \
            "it edits with reference images" if spec.edits == EditMethod.REFERENCE else "it edits one picture at a time"
        raise InvalidRequest("image", f"{len(pictures)} pictures", f"at most {allowed} for {spec.name} ({how})")
    size = shape or nearest_size(spec, pictures[0])
    region = _region(decode("mask", mask), pictures[0], size) if masked else None
    method = EditMethod.INPAINT if masked else spec.edits
    value = check_strength(DEFAULT_STRENGTH if strength is None or strength == "" else strength) \
        if method in STRENGTH_METHODS else 1.0
    source = ", ".join(f"{p.format} {p.width}x{p.height}" for p in pictures)
    fitted = tuple(_png(_fit(p.convert("RGB"), size)) for p in pictures)
    return EditInput(fitted, method, value, region, source), size


def _region(mask, picture, shape: Shape) -> bytes:
    """OpenAI's mask (a picture of the first image's size whose transparent pixels mark what may change) as a grey
    mask at the request's size, white where the picture changes."""
    from PIL import Image

    accepted = "a PNG with an alpha channel, of the first image's size, transparent where the picture may change"
    if mask.format != "PNG" or "A" not in mask.getbands() and "transparency" not in mask.info:
        raise InvalidRequest("mask", f"a {mask.format} {mask.mode} picture without transparency", accepted)
    if mask.size != picture.size:
        raise InvalidRequest("mask", f"a {mask.width}x{mask.height} mask for a {picture.width}x{picture.height} "
                                     "image", accepted)
    changes = mask.convert("RGBA").getchannel("A").point(lambda a: 255 if a < 128 else 0)
    if not changes.getbbox():
        raise InvalidRequest("mask", "a mask with no transparent pixel (nothing may change)", accepted)
    return _png(_fit(changes, shape, Image.Resampling.NEAREST))
