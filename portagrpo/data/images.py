"""Images of vision-language rows: read once, checked once, kept as their encoded bytes.

A row's images (the `data.image_key` column, `images` as in verl's geo3k files) is a list whose entries are
what the Hugging Face `Image` feature stores, `{"bytes": ..., "path": ...}`: Parquet holds the bytes as
binary; JSONL holds them as base64 text, or names a file by `path` (relative to the data file's folder).
Each image is decoded here exactly once, to prove it decodes and to read its size, and then dropped: a
`PromptRecord` carries the encoded bytes, and only the processor decodes them again, when it needs pixels.
The prompt marks where each image goes with one `<image>` placeholder, so their counts must agree.

Every entry point (`portagrpo data geo3k`, a run's loader, `portagrpo eval`) refuses here, in one sentence naming
the row, an image the processor could not take: the Qwen2-VL family's aspect-ratio limit always, and, where the
policy's processor is known (`image_limits`), that processor's own resize rule and its pixel limit. An image the
processor would shrink is refused unless `data.max_image_pixels` allows it (`ImageLimits.allow_shrink`); then the
run says once how many it shrinks (`shrink_notice`).
"""
from __future__ import annotations

import base64
import binascii
import importlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

IMAGE_PLACEHOLDER = "<image>"
# Qwen2.5-VL's processor caps an image at 16384 patches of 28x28 pixels (12,845,056 pixels) and resizes a
# larger one down; portagrpo refuses such rows instead, so the picture a row names is the picture trained on
# (and one huge file cannot exhaust memory). The limit where no processor is known (`portagrpo data`).
DEFAULT_MAX_IMAGE_PIXELS = 16384 * 28 * 28
# transformers' smart_resize (the Qwen2-VL family's image and video processors) raises ValueError for an image whose
# longer side is more than 200 times its shorter one.
MAX_ASPECT_RATIO = 200


class ImageProblem(ValueError):
    """One image of a row is missing, not decodable, too large or of a shape the processor cannot take; the message
    is the end of a sentence."""


def count_placeholders(prompt: Any) -> int:
    """`<image>` placeholders in a prompt (a string, or chat messages whose content is a string or a list of
    parts, where a `{"type": "image"}` part counts as one)."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    total = 0
    for message in prompt if isinstance(prompt, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += content.count(IMAGE_PLACEHOLDER)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    total += 1
                elif isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += part["text"].count(IMAGE_PLACEHOLDER)
    return total


def encoded_bytes(entry: Any, base: Path) -> bytes:
    """The encoded image of one entry: `{"bytes", "path"}` (bytes win; base64 text in JSON), raw bytes, or a
    path string. Raises ImageProblem when there is no image to read."""
    if isinstance(entry, (bytes, bytearray)):
        data: Any = bytes(entry)
        path = None
    elif isinstance(entry, str):
        data, path = None, entry
    elif isinstance(entry, dict):
        data, path = entry.get("bytes"), entry.get("path")
    elif entry is None:
        raise ImageProblem("is missing (null)")
    else:
        raise ImageProblem(f"is a {type(entry).__name__}, not {{'bytes': ..., 'path': ...}}, bytes or a file path")
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ImageProblem("has 'bytes' text that is not base64") from None
    if isinstance(data, (bytes, bytearray)) and data:
        return bytes(data)
    if isinstance(path, str) and path:
        file = Path(path) if Path(path).is_absolute() else base / path
        if not file.is_file():
            raise ImageProblem(f"is missing: it has no bytes and its path {str(file)!r} is not a file")
        try:
            return file.read_bytes()
        except OSError as err:
            raise ImageProblem(f"cannot be read from {str(file)!r} ({err.strerror or err})") from None
    raise ImageProblem("is missing: it has neither bytes nor a path")


def max_pixels_problem(value: int | None, name: str = "data.max_image_pixels") -> str | None:
    """Why a pixel limit cannot be used, in one sentence; None if it can (None itself: the model's own limit)."""
    if value is None or (isinstance(value, int) and value >= 1):
        return None
    return (f"{name}={value} must be at least 1, or null for the model's own limit (its processor's max_pixels; "
            f"{DEFAULT_MAX_IMAGE_PIXELS}, Qwen2.5-VL's cap, where no processor is known).")


@dataclass(frozen=True)
class ProcessorRule:
    """How a Qwen2-VL-family image processor sizes an image: its sides rounded to multiples of `factor` (patch x
    merge), scaled into [min_pixels, max_pixels]; `resize` is transformers' own smart_resize of the processor's module
    (None where it has none), which raises ValueError for an image the processor cannot take."""

    factor: int
    min_pixels: int
    max_pixels: int  # the model's pixel limit: a larger image is shrunk by the processor
    resize: Callable[..., tuple[int, int]] | None = None

    def problem(self, width: int, height: int) -> str | None:
        if self.resize is None:
            return None
        try:
            self.resize(height, width, factor=self.factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        except ValueError as err:
            return " ".join(str(err).split())[:160]
        return None

    def shrinks(self, width: int, height: int) -> bool:
        """Whether the processor scales the image down (smart_resize's own test, on the sides rounded to `factor`)."""
        return round(height / self.factor) * round(width / self.factor) * self.factor ** 2 > self.max_pixels


@dataclass(frozen=True)
class ImageLimits:
    """What an image must be to enter: at most `max_pixels` pixels (`name` says whose limit that is), within the
    family's aspect ratio, and taken by the policy's processor (`rule`) without being shrunk, unless `allow_shrink`
    (data.max_image_pixels set: the user lets in images up to it, and the processor shrinks those over its own)."""

    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    name: str = f"Qwen2.5-VL's cap of {DEFAULT_MAX_IMAGE_PIXELS} pixels"
    rule: ProcessorRule | None = None
    allow_shrink: bool = True
    field: str = "data.max_image_pixels"  # the setting a refusal names (`portagrpo eval`: --max-image-pixels)


def processor_rule(processor) -> ProcessorRule | None:
    """The sizing rule of a Qwen2-VL-family processor (its image processor's patch, merge and pixel bounds, as
    transformers 5 (`size`) or 4 (`min_pixels`/`max_pixels`) keeps them); None for any other processor."""
    image = getattr(processor, "image_processor", None)
    size = getattr(image, "size", None) or {}
    get = size.get if hasattr(size, "get") else (lambda key: getattr(size, key, None))
    top = get("longest_edge") or getattr(image, "max_pixels", None)
    low = get("shortest_edge") or getattr(image, "min_pixels", None) or 0
    patch, merge = getattr(image, "patch_size", None), getattr(image, "merge_size", None)
    if not (isinstance(top, int) and isinstance(patch, int) and isinstance(merge, int)):
        return None
    resize = getattr(importlib.import_module(type(image).__module__), "smart_resize", None)
    return ProcessorRule(patch * merge, int(low), top, resize if callable(resize) else None)


def image_limits(max_image_pixels: int | None = None, processor=None,
                 field: str = "data.max_image_pixels") -> ImageLimits:
    """The limits of data.max_image_pixels (`field`; None: the model's own limit) and the policy's processor (None:
    not known, as in `portagrpo data`)."""
    problem = max_pixels_problem(max_image_pixels, field)
    if problem is not None:
        raise ImageProblem(problem)
    rule = processor_rule(processor) if processor is not None else None
    if max_image_pixels is not None:
        return ImageLimits(max_image_pixels, f"{field}={max_image_pixels}", rule, allow_shrink=True, field=field)
    return ImageLimits(rule=rule, allow_shrink=False, field=field)


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from an image's header (no pixels decoded)."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(io.BytesIO(data)) as img:
            return img.size


def shape_problem(width: int, height: int, limits: ImageLimits) -> str | None:
    """Why the processor cannot take (or, unless allowed, would shrink) an image of this size; None if it takes it."""
    if min(width, height) < 1 or max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        return f"is {width}x{height}, an aspect ratio over the {MAX_ASPECT_RATIO}:1 Qwen2-VL-family processors take"
    if width * height > limits.max_pixels:
        return f"is {width}x{height} = {width * height} pixels, over {limits.name}"
    rule = limits.rule
    if rule is None:
        return None
    reason = rule.problem(width, height)
    if reason is not None:
        return f"is {width}x{height}, which the model's processor cannot take ({reason})"
    if rule.shrinks(width, height) and not limits.allow_shrink:
        return (f"is {width}x{height} = {width * height} pixels, over the model's limit of {rule.max_pixels} (its "
                f"processor's max_pixels, which would shrink it; {limits.field}={width * height} or more lets it)")
    return None


def check_image(data: bytes, limits: ImageLimits) -> tuple[int, int]:
    """(width, height) of an encoded image, after proving that it decodes in full and is within `limits`."""
    try:
        from PIL import Image
    except ImportError:
        raise ImageProblem("cannot be checked: Pillow is not installed (pip install pillow)") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                width, height = img.size
                problem = shape_problem(width, height, limits)
                if problem is not None:
                    raise ImageProblem(problem)
                img.load()
    except ImageProblem:
        raise
    except Image.DecompressionBombError:
        raise ImageProblem(f"is far over {limits.name} (a decompression bomb)") from None
    except Exception as err:  # noqa: BLE001 - Pillow raises several types for bad data
        raise ImageProblem(f"is not a decodable image ({type(err).__name__}: {str(err)[:80]})") from None
    return width, height


def shrink_notice(records, limits: ImageLimits) -> str | None:
    """One line saying how many of the records' images the processor shrinks (those data.max_image_pixels lets
    through over the model's limit); None when it shrinks none."""
    rule = limits.rule
    if rule is None:
        return None
    sizes = [image_size(data) for record in records for data in record.images]
    shrunk = sum(rule.shrinks(w, h) for w, h in sizes)
    if not shrunk:
        return None
    return (f"the processor shrinks {shrunk} of {len(sizes)} images, those over the model's limit of {rule.max_pixels} "
            f"pixels (its max_pixels), to within it ({limits.name} lets them in)")


def row_images(entries: Any, prompt: Any, base: Path, limits: ImageLimits) -> tuple[bytes, ...]:
    """A row's checked images as encoded bytes. Raises ImageProblem, its message a clause about the row."""
    if hasattr(entries, "tolist"):
        entries = entries.tolist()
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise ImageProblem(f"has images of type {type(entries).__name__}, not a list")
    wanted = count_placeholders(prompt)
    if wanted != len(entries):
        raise ImageProblem(f"has {wanted} {IMAGE_PLACEHOLDER} placeholder(s) in its prompt but {len(entries)} "
                           f"image(s)")
    out = []
    for i, entry in enumerate(entries):
        try:
            data = encoded_bytes(entry, base)
            check_image(data, limits)
        except ImageProblem as err:
            raise ImageProblem(f"image {i + 1} {err}") from None
        out.append(data)
    return tuple(out)
