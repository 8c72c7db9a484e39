"""Images in chat messages: OpenAI's `image_url` content parts, decoded with Pillow within the server's limits.

A part's `url` is a `data:` URL (`data:image/png;base64,...`), or, only when the server was started
with `--fetch-images`, an `http(s)` URL it fetches itself (bounded in time and bytes). Every refusal
is a 400 naming the image, the value and the limit.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import urllib.error
import urllib.request

import numpy as np

from dew.serve.protocol import APIError

_FETCH_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """What one request may send: `max_images` images, each at most `max_pixels` pixels (width times
    height) and `max_bytes` encoded bytes; `fetch` allows `http(s)` URLs, which the server then fetches."""

    max_images: int = 4
    max_pixels: int = 4096 * 4096
    max_bytes: int = 16 * 2**20
    fetch: bool = False

    def __post_init__(self):
        for flag, value in (("--max-images", self.max_images), ("--max-image-pixels", self.max_pixels),
                            ("--max-image-bytes", self.max_bytes)):
            if value < 1:
                raise ValueError(f"{flag} is {value}; it must be at least 1")


def decode_image(url, index: int, limits: ImageLimits) -> np.ndarray:
    """Image `index` of a request (its `image_url.url`) as uint8 RGB pixels `[H, W, 3]`."""
    if not isinstance(url, str):
        raise APIError(400, f"image {index}'s image_url.url is {type(url).__name__}; it is a data: URL string",
                       param="messages")
    if url.startswith("data:"):
        encoded = _data_url(url, index, limits)
    elif url.startswith(("http://", "https://")):
        if not limits.fetch:
            raise APIError(400, f"image {index} is an {url.split(':')[0]} URL, and this server does not fetch images: "
                           "send it inline as a data:image/...;base64 URL, or start dew serve with --fetch-images",
                           param="messages")
        encoded = _fetched(url, index, limits)
    else:
        raise APIError(400, f"image {index}'s URL starts {url[:16]!r}; it is a data:image/...;base64 URL"
                       + (" or an http(s) URL" if limits.fetch else ""), param="messages")
    from PIL import Image  # Pillow loads with the first image, not as a server that may never see one starts

    try:
        with Image.open(io.BytesIO(encoded)) as image:
            _check_size(index, *image.size, limits)
            return np.asarray(image.convert("RGB"), np.uint8)
    except APIError:
        raise
    except Image.DecompressionBombError as error:  # Pillow refuses to open one past twice its own bound
        size = _claimed_size(encoded)
        if size is not None:
            _check_size(index, *size, limits)
        raise APIError(400, f"image {index} is {_size(*size) + ', ' if size else ''}past the most pixels Pillow opens "
                       f"({error}), whatever this server's --max-image-pixels {limits.max_pixels:,}: send a smaller "
                       "image", param="messages") from None
    except (OSError, ValueError) as error:
        raise APIError(400, f"image {index} is not an image Pillow reads ({error}): send a PNG, JPEG, GIF or WebP",
                       param="messages") from None


def _check_size(index: int, width: int, height: int, limits: ImageLimits) -> None:
    if width * height > limits.max_pixels:
        raise APIError(400, f"image {index} is {_size(width, height)}, past this server's --max-image-pixels "
                       f"{limits.max_pixels:,}: send a smaller image", param="messages")


def _size(width: int, height: int) -> str:
    return f"{width}x{height}, {width * height:,} pixels"


def _claimed_size(encoded: bytes) -> tuple[int, int] | None:
    """The width and height the header of a PNG, JPEG, GIF or WebP image claims, read by Pillow's own reader of
    that format without the decompression bomb check `Image.open` makes (nothing is decoded); None for another."""
    from PIL import GifImagePlugin, JpegImagePlugin, PngImagePlugin, WebPImagePlugin

    for reader in (PngImagePlugin.PngImageFile, JpegImagePlugin.JpegImageFile, GifImagePlugin.GifImageFile,
                   WebPImagePlugin.WebPImageFile):
        try:
            with reader(io.BytesIO(encoded)) as image:
                return image.size
        except Exception:  # noqa: BLE001 - not this format (each reader refuses another's bytes in its own way)
            continue
    return None


def _data_url(url: str, index: int, limits: ImageLimits) -> bytes:
    head, _, payload = url.partition(",")
    if not head.endswith(";base64") or not head.startswith("data:image/"):
        raise APIError(400, f"image {index}'s data URL starts {head[:40]!r}; it is data:image/<type>;base64,<data>",
                       param="messages")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise APIError(400, f"image {index} holds about {len(payload) * 3 // 4:,} bytes, past this server's "
                       f"--max-image-bytes {limits.max_bytes:,}", param="messages")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"image {index}'s data URL is not valid base64", param="messages") from None


def _fetched(url: str, index: int, limits: ImageLimits) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=_FETCH_SECONDS) as response:
            body = response.read(limits.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise APIError(400, f"image {index}: fetching {url} failed ({error})", param="messages") from None
    if len(body) > limits.max_bytes:
        raise APIError(400, f"image {index} at {url} is past this server's --max-image-bytes {limits.max_bytes:,}",
                       param="messages")
    return body
