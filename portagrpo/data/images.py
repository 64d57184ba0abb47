"""Images of vision-language rows: read once, checked once, kept as their encoded bytes.

A row's images (the `data.image_key` column, `images` as in verl's geo3k files) is a list whose entries are
what the Hugging Face `Image` feature stores, `{"bytes": ..., "path": ...}`: Parquet holds the bytes as
binary; JSONL holds them as base64 text, or names a file by `path` (relative to the data file's folder).
Each image is decoded here exactly once, to prove it decodes and to read its size, and then dropped: a
`PromptRecord` carries the encoded bytes, and only the processor decodes them again, when it needs pixels.
The prompt marks where each image goes with one `<image>` placeholder, so their counts must agree.
"""
from __future__ import annotations

import base64
import binascii
import io
import warnings
from pathlib import Path
from typing import Any

IMAGE_PLACEHOLDER = "<image>"
# Qwen2.5-VL's processor caps an image at 16384 patches of 28x28 pixels (12,845,056 pixels) and resizes a
# larger one down; portagrpo refuses such rows instead, so the picture a row names is the picture trained on
# (and one huge file cannot exhaust memory). data.max_image_pixels raises or lowers the limit.
DEFAULT_MAX_IMAGE_PIXELS = 16384 * 28 * 28


class ImageProblem(ValueError):
    """One image of a row is missing, not decodable or too large; the message is the end of a sentence."""


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


def check_image(data: bytes, max_pixels: int) -> tuple[int, int]:
    """(width, height) of an encoded image, after proving that it decodes in full and is within `max_pixels`."""
    try:
        from PIL import Image
    except ImportError:
        raise ImageProblem("cannot be checked: Pillow is not installed (pip install pillow)") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                width, height = img.size
                if width * height > max_pixels:
                    raise ImageProblem(f"is {width}x{height} = {width * height} pixels, over data.max_image_pixels="
                                       f"{max_pixels}")
                img.load()
    except ImageProblem:
        raise
    except Image.DecompressionBombError:
        raise ImageProblem(f"is far over data.max_image_pixels={max_pixels} (a decompression bomb)") from None
    except Exception as err:  # noqa: BLE001 - Pillow raises several types for bad data
        raise ImageProblem(f"is not a decodable image ({type(err).__name__}: {str(err)[:80]})") from None
    return width, height


def row_images(entries: Any, prompt: Any, base: Path, max_pixels: int) -> tuple[bytes, ...]:
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
            check_image(data, max_pixels)
        except ImageProblem as err:
            raise ImageProblem(f"image {i + 1} {err}") from None
        out.append(data)
    return tuple(out)
