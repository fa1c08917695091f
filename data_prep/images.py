"""Image checks and re-encoding for `vitpipe shard`: bytes (or a generated image) in, stored bytes out.

Encoded inputs are stored as they are unless they must change: `--resize-max` bounds the longer side
(re-encoded in the same format, like img2dataset), and formats WebDataset decoders do not all know
(GIF, BMP, TIFF, ...) become PNG. Every input is decoded once, in full, so a truncated or corrupt file
is rejected here instead of killing a training loader later.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image

# Pillow format -> the extension a WebDataset decoder keys on. MPO is the multi-picture JPEG
# that phone cameras write; its bytes are a valid JPEG.
STORED_FORMATS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp"}
_ENCODER = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}


class Rejected(Exception):
    """An input that cannot become a sample; the message is the reason listed in errors.parquet."""


@dataclass(frozen=True)
class Prepared:
    data: bytes  # encoded image, as stored in the shard
    ext: str  # "jpg", "png" or "webp"
    width: int
    height: int
    labels: tuple[int, ...] | None = None  # drawn by a generator; None: the item's listed labels


def fitted_size(width: int, height: int, resize_max: int | None) -> tuple[int, int]:
    """(w, h) with the longer side at most `resize_max`, aspect ratio kept."""
    longer = max(width, height)
    if not resize_max or longer <= resize_max:
        return width, height
    scale = resize_max / longer
    return max(1, round(width * scale)), max(1, round(height * scale))


def encode(img: Image.Image, ext: str, quality: int) -> bytes:
    if ext == "jpg" and img.mode not in ("L", "RGB", "CMYK"):
        img = img.convert("RGB")
    buf = io.BytesIO()
    kwargs: dict = {"quality": quality} if ext in ("jpg", "webp") else {}
    if ext == "jpg" and img.info.get("icc_profile"):
        kwargs["icc_profile"] = img.info["icc_profile"]  # colours stay right after re-encoding
    img.save(buf, format=_ENCODER[ext], **kwargs)
    return buf.getvalue()


def _resizable(img: Image.Image) -> Image.Image:
    # Palette and 1-bit images cannot be resampled smoothly; widen them first.
    if img.mode == "P":
        return img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode == "1":
        return img.convert("L")
    if img.mode not in ("L", "LA", "RGB", "RGBA", "CMYK", "I;16"):
        return img.convert("RGB")
    return img


def resize_image(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    if size == img.size:
        return img
    return _resizable(img).resize(size, Image.Resampling.LANCZOS)


def prepare_encoded(data: bytes, resize_max: int | None, quality: int) -> Prepared:
    """Check that `data` decodes in full; keep it as is where allowed, else resize or convert."""
    if not data:
        raise Rejected("empty file (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            fmt, (width, height) = img.format, img.size
            target = fitted_size(width, height, resize_max)
            ext = STORED_FORMATS.get(fmt or "")
            if ext == "jpg" and target == (width, height):
                # The check needs every entropy-coded block, not every pixel: decode at 1/8 scale.
                img.draft(img.mode, (max(1, width // 8), max(1, height // 8)))
            elif ext == "jpg":
                img.draft(img.mode, target)  # DCT scaling: decode no larger than needed
            img.load()
    except (Image.UnidentifiedImageError, Image.DecompressionBombWarning) as exc:
        raise Rejected(f"not an image Pillow can read ({type(exc).__name__})") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise Rejected(f"cannot decode {fmt or 'image'}: {exc}") from None
    if ext is not None and target == (width, height):
        return Prepared(data, ext, width, height)
    out_ext = ext or "png"  # other formats are converted losslessly
    img = resize_image(img, target)  # the size from the full image, not from a drafted one
    return Prepared(encode(img, out_ext, quality), out_ext, img.width, img.height)


def prepare_generated(
    img: Image.Image, ext: str, resize_max: int | None, quality: int, labels: tuple[int, ...] | None = None
) -> Prepared:
    """A generated image: resize if asked, encode in its source's format."""
    img = resize_image(img, fitted_size(img.width, img.height, resize_max))
    return Prepared(encode(img, ext, quality), ext, img.width, img.height, labels)
