"""Image checks and re-encoding for `vitpipe shard`: bytes (or a generated image) in, stored bytes out.

The stored-image contract: every stored sample decodes with Pillow to an 8-bit "RGB" or "L" image,
upright, at the width and height recorded in index.parquet, as JPEG, PNG or WebP (the tar member's
extension says which). To get there:

- Kept byte for byte: a JPEG, PNG or WebP that is already 8-bit RGB or L, one frame, with no EXIF
  orientation that turns or mirrors it (none, or 1), and not resized. It is still decoded once, in
  full (a JPEG at 1/8 scale: every entropy-coded block, not every pixel), so a truncated or corrupt
  file is rejected here instead of killing a training loader later.
- Everything else is converted, then re-encoded: JPEG and WebP in their own format at `--quality`,
  PNG as PNG, any other format (GIF, BMP, TIFF, ...) as lossless PNG. Bytes of one format under
  another's extension (PNG bytes named .jpg) are taken for what they are: stored as .png.
- `--resize-max` bounds the longer side (aspect ratio kept, like img2dataset).
- Modes: CMYK and other colour spaces -> RGB; palette "P" -> RGB; 1-bit -> L; 16-bit and wider grey
  ("I;16", "I", "F") -> L scaled, not clipped (0..65535 -> 0..255; "F" in 0..1 -> 0..255); 16-bit RGB
  PNG -> 8-bit; alpha (LA, RGBA, a palette's transparency) composited over white, since what lies
  under transparent pixels is whatever the encoder left there. An ICC profile stays where it fits the
  stored mode and is dropped where it does not (a CMYK profile on RGB pixels).
- EXIF orientation 2-8: the pixels are turned upright (`ImageOps.exif_transpose`) and re-encoded:
  stored upright, orientation tag dropped (a re-encoded image keeps no EXIF at all).
- Animated GIF, PNG (APNG) and WebP, multi-page TIFF: the first frame only. MPO (the multi-picture
  JPEG phones write) counts as one frame: its bytes are a JPEG whose first image every decoder shows.

Decompression bombs (more pixels than Pillow's `Image.MAX_IMAGE_PIXELS`, about 89 megapixels) are
rejected before their pixels are decoded. Whatever one input raises while it is decoded, converted,
resized or re-encoded becomes a `Rejected` naming the stage ("decode", "convert", "resize"; a
loader's own reading is "read") and a one-line reason: the input is a row of errors.parquet and the
shard goes on. Only MemoryError passes through: that is the machine, not the input.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from PIL import ExifTags, Image, ImageOps

from data_prep.layout import BOXES_EXT, boxes_json, check_box

# Pillow format -> the extension a WebDataset decoder keys on. MPO is the multi-picture JPEG
# that phone cameras write; its bytes are a valid JPEG.
STORED_FORMATS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp"}
STORED_MODES = ("RGB", "L")
_ENCODER = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}
_ICC_SPACE = {"RGB": b"RGB ", "L": b"GRAY"}  # ICC header bytes 16..20: the profile's colour space
_WIDE_GREY = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")  # more than 8 bits a pixel, one channel
# Signatures of the formats a user is likely to name, for a readable reason when Pillow cannot open one.
_SIGNATURES = {
    b"\xff\xd8\xff": "JPEG",
    b"\x89PNG\r\n\x1a\n": "PNG",
    b"GIF8": "GIF",
    b"BM": "BMP",
    b"II*\x00": "TIFF",
    b"MM\x00*": "TIFF",
}


class Rejected(Exception):
    """An input that cannot become a sample. The message is the reason listed in errors.parquet;
    `stage` is where it failed: "read" (getting the bytes or pixels: the loader's own work),
    "decode", "convert" (mode, orientation, frame, re-encoding), "resize" or "boxes" (an annotated box that
    does not fit the image)."""

    def __init__(self, reason: str, stage: str = "decode"):
        super().__init__(reason)
        self.stage = stage

    @classmethod
    def of(cls, exc: Exception, stage: str) -> Rejected:
        """`exc` as a rejection: itself if it already is one, else `<ExceptionType>: <message>` at `stage`."""
        return exc if isinstance(exc, Rejected) else cls(describe(exc), stage)


def describe(exc: BaseException) -> str:
    """`ValueError: bad header`: an exception as one readable line, for errors.parquet."""
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextmanager
def at_stage(name: str, what: str) -> Iterator[None]:
    """Any exception but MemoryError inside becomes `Rejected("<what>: <Type>: <message>", name)`."""
    try:
        yield
    except (Rejected, MemoryError):
        raise
    except Exception as exc:
        raise Rejected(f"{what}: {describe(exc)}", name) from None


@dataclass(frozen=True)
class Prepared:
    data: bytes  # encoded image, as stored in the shard
    ext: str  # "jpg", "png" or "webp"
    width: int
    height: int
    labels: tuple[int, ...] | None = None  # drawn by a generator; None: the item's listed labels
    # More members of the sample, stored after the image: tar member extension -> bytes ({"seg.png": ...})
    extra: dict[str, bytes] = field(default_factory=dict)
    # The input's size as it stands upright, before any resize (where it differs from width x height);
    # what a manifest's boxes are checked against and scaled from
    source_size: tuple[int, int] | None = None


def fitted_size(width: int, height: int, resize_max: int | None) -> tuple[int, int]:
    """(w, h) with the longer side at most `resize_max`, aspect ratio kept."""
    longer = max(width, height)
    if not resize_max or longer <= resize_max:
        return width, height
    scale = resize_max / longer
    return max(1, round(width * scale)), max(1, round(height * scale))


def _icc_for(img: Image.Image) -> bytes | None:
    """The image's ICC profile if it describes the image's mode (an RGB profile on RGB pixels)."""
    icc = img.info.get("icc_profile")
    if icc and len(icc) >= 20 and icc[16:20] == _ICC_SPACE.get(img.mode):
        return icc
    return None


def encode(img: Image.Image, ext: str, quality: int) -> bytes:
    """An RGB or L image as `ext`; its ICC profile goes along where it fits (colours stay right)."""
    buf = io.BytesIO()
    kwargs: dict = {"quality": quality} if ext in ("jpg", "webp") else {}
    # Both always passed, None included: PNG would otherwise copy them from img.info, a profile that
    # does not fit (CMYK on RGB) or a palette's transparent index on RGB pixels.
    kwargs["icc_profile"] = _icc_for(img)
    kwargs["transparency"] = None
    img.save(buf, format=_ENCODER[ext], **kwargs)
    return buf.getvalue()


def _over_white(img: Image.Image) -> Image.Image:
    """LA/RGBA (any alpha) -> L/RGB composited over white, profile kept."""
    grey = img.mode in ("LA", "La")
    rgba = img.convert("LA" if grey else "RGBA")
    out = Image.new(rgba.mode, rgba.size, (255, 255) if grey else (255, 255, 255, 255))
    out.alpha_composite(rgba)
    out = out.convert("L" if grey else "RGB")
    out.info = {k: v for k, v in img.info.items() if k == "icc_profile"}
    return out


def _wide_grey_to_l(img: Image.Image) -> Image.Image:
    """16-bit ("I;16*"), 32-bit integer ("I") or float ("F") grey -> 8-bit L, scaled, not clipped:
    integers as 16-bit values (0..65535 -> 0..255, what 16-bit PNG and TIFF decode to), floats in
    0..1 by 255 and others like integers."""
    values = np.asarray(img).astype(np.float64)
    if img.mode == "F" and values.size and 0.0 <= values.min() and values.max() <= 1.0:
        scaled = values * 255.0
    else:
        scaled = np.clip(values, 0, 65535) * (255.0 / 65535.0)
    return Image.fromarray(np.rint(scaled).astype(np.uint8), mode="L")


def to_stored_mode(img: Image.Image) -> Image.Image:
    """Any decoded mode -> 8-bit "RGB" or "L" (see the module docstring for each rule)."""
    mode = img.mode
    if mode in STORED_MODES:
        return img
    if mode == "1":
        return img.convert("L")
    if mode in _WIDE_GREY:
        return _wide_grey_to_l(img)
    if mode == "P":
        if "transparency" in img.info:
            return _over_white(img.convert("RGBA"))
        return img.convert("RGB")
    if mode in ("LA", "La", "PA", "RGBA", "RGBa"):
        return _over_white(img if mode != "PA" else img.convert("RGBA"))
    out = img.convert("RGB")  # CMYK, YCbCr, LAB, HSV, RGBX, ...
    out.info = {k: v for k, v in img.info.items() if k == "icc_profile"}  # dropped by encode if CMYK
    return out


def resize_image(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    if size == img.size:
        return img
    return to_stored_mode(img).resize(size, Image.Resampling.LANCZOS)


def _orientation(img: Image.Image) -> int:
    """The EXIF orientation tag (1-8; 1 or anything else: nothing to do)."""
    value = img.getexif().get(ExifTags.Base.Orientation, 1)
    return value if isinstance(value, int) and 2 <= value <= 8 else 1


def _claimed(data: bytes) -> str | None:
    """The format `data` starts like, from its signature; None if none is known."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((fmt for sig, fmt in _SIGNATURES.items() if data.startswith(sig)), None)


def _is_16bit_png(data: bytes) -> bool:
    # IHDR's bit depth, at a fixed offset: 8-byte signature, chunk length and type, width, height.
    return len(data) > 24 and data[24] == 16


@dataclass
class _Decoded:
    img: Image.Image  # decoded in full; drafted (smaller) only where it is resized next
    fmt: str  # Pillow's format name
    orientation: int  # EXIF orientation, 1-8
    upright: tuple[int, int]  # (w, h) of the full image once turned upright
    target: tuple[int, int]  # (w, h) to store
    keep: bool  # the input's bytes are stored as they are


def _decode(data: bytes, resize_max: int | None) -> _Decoded:
    """Open and decode `data` in full (a JPEG kept as is at 1/8 scale), or raise Rejected (stage "decode")."""
    claimed = _claimed(data) or "image"
    fmt = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow's notes on odd files; a failure is reported below
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            fmt, (width, height) = img.format, img.size
            orientation = _orientation(img)
            upright = (height, width) if orientation >= 5 else (width, height)  # 5-8 swap the sides
            target = fitted_size(*upright, resize_max)
            animated = fmt != "MPO" and getattr(img, "is_animated", False)
            keep = (
                fmt in STORED_FORMATS
                and img.mode in STORED_MODES
                and not animated
                and orientation == 1
                and target == upright
                and not (fmt == "PNG" and _is_16bit_png(data))
            )
            if fmt in ("JPEG", "MPO") and keep:
                # The check needs every entropy-coded block, not every pixel: decode at 1/8 scale.
                img.draft(img.mode, (max(1, width // 8), max(1, height // 8)))
            elif fmt in ("JPEG", "MPO") and target != upright:
                # DCT scaling: decode no larger than needed, asked in the file's own orientation.
                img.draft(img.mode, target if orientation < 5 else target[::-1])
            img.load()  # the first frame of an animation
    except MemoryError:
        raise
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise Rejected(f"decompression bomb, not decoded: {' '.join(str(exc).split())}") from None
    except Image.UnidentifiedImageError:
        if claimed == "image":
            raise Rejected("not an image Pillow can read (no known image signature)") from None
        raise Rejected(
            f"not an image Pillow can read: starts like a {claimed} but its header is cut short or corrupt"
        ) from None
    except OSError as exc:  # Pillow's error for truncated or corrupt data
        raise Rejected(f"cannot decode {fmt or claimed}: {' '.join(str(exc).split())}") from None
    except Exception as exc:
        raise Rejected(f"cannot decode {fmt or claimed}: {describe(exc)}") from None
    return _Decoded(img, fmt, orientation, upright, target, keep)


def prepare_encoded(data: bytes, resize_max: int | None, quality: int) -> Prepared:
    """Check that `data` decodes in full; keep it as is where the contract allows, else convert or resize."""
    if not data:
        raise Rejected("empty file (0 bytes)", "read")
    d = _decode(data, resize_max)
    if d.keep:
        return Prepared(data, STORED_FORMATS[d.fmt], *d.upright)
    ext = STORED_FORMATS.get(d.fmt, "png")  # other formats are converted losslessly
    img = d.img
    with at_stage("convert", f"cannot convert {d.fmt} {img.mode} to upright 8-bit RGB or L"):
        if d.orientation != 1:
            img = ImageOps.exif_transpose(img)
        img = to_stored_mode(img)
    with at_stage("resize", f"cannot resize {d.upright[0]}x{d.upright[1]} to {d.target[0]}x{d.target[1]}"):
        img = resize_image(img, d.target)  # the target from the full size, not from a drafted one
    with at_stage("convert", f"cannot encode as {_ENCODER[ext]}"):
        out = encode(img, ext, quality)
    return Prepared(out, ext, img.width, img.height, source_size=d.upright)


def encode_mask(mask: Image.Image, size: tuple[int, int]) -> bytes:
    """A per-pixel class mask ("L") at `size` as lossless PNG: resized NEAREST, so its values stay the
    original's (interpolating would invent classes along every edge)."""
    if mask.mode != "L":
        raise ValueError(f"a mask must be an 8-bit 'L' image, got mode {mask.mode}")
    if mask.size != size:
        mask = mask.resize(size, Image.Resampling.NEAREST)
    buf = io.BytesIO()
    mask.save(buf, format="PNG", compress_level=1)  # few values, long runs: small even at the fastest level
    return buf.getvalue()


def boxes_member(
    boxes, source_size: tuple[int, int], stored_size: tuple[int, int], num_classes: int | None = None
) -> bytes:
    """The KEY.boxes.json member of an input's objects: `boxes` a sequence of (class, [x, y, w, h]) in the
    pixels of the input as it stands upright (`source_size`, w x h), checked against it (`layout.check_box`;
    a bad box rejects the input at stage "boxes", naming the box) and scaled to the stored image's size.
    `num_classes`: classes are checked below it (None: resolved already, by the listing)."""
    sx, sy = stored_size[0] / source_size[0], stored_size[1] / source_size[1]
    out, classes = [], []
    for i, (cls, box) in enumerate(boxes):
        try:
            x, y, w, h = check_box(box, source_size, f"box {i}")
        except ValueError as exc:
            raise Rejected(str(exc), "boxes") from None
        if num_classes is not None and not 0 <= cls < num_classes:
            raise Rejected(
                f"box {i} has class index {cls}, outside the {num_classes} detection classes", "boxes"
            )
        # clipped to the image: a box up to BOX_TOLERANCE px past an edge is stored inside it
        x0, y0 = max(x, 0.0), max(y, 0.0)
        x1, y1 = min(x + w, source_size[0]), min(y + h, source_size[1])
        out.append([x0 * sx, y0 * sy, (x1 - x0) * sx, (y1 - y0) * sy])
        classes.append(cls)
    return boxes_json(out, classes)


def prepare_generated(
    img: Image.Image,
    ext: str,
    resize_max: int | None,
    quality: int,
    labels: tuple[int, ...] | None = None,
    masks: dict[str, Image.Image] | None = None,
    boxes=None,
    num_box_classes: int = 0,
) -> Prepared:
    """A generated image: resize if asked, encode in its source's format. `masks` (member extension ->
    an "L" image of the image's size, e.g. {"seg.png": objects}) go into `Prepared.extra` as PNG, at
    the stored image's size exactly; `boxes` ((class, [x, y, w, h]) in the image's pixels, classes below
    `num_box_classes`) as KEY.boxes.json (`boxes_member`), scaled likewise."""
    source_size = img.size
    target = fitted_size(img.width, img.height, resize_max)
    with at_stage("convert", f"cannot convert a generated {img.mode} image to 8-bit RGB or L"):
        img = to_stored_mode(img)
    with at_stage("resize", f"cannot resize {img.width}x{img.height} to {target[0]}x{target[1]}"):
        img = resize_image(img, target)
    with at_stage("convert", f"cannot encode as {_ENCODER[ext]}"):
        data = encode(img, ext, quality)
    extra = {}
    for member, mask in (masks or {}).items():
        with at_stage("convert", f"cannot store the {member} mask at {img.width}x{img.height}"):
            extra[member] = encode_mask(mask, img.size)
    if boxes is not None:
        extra[BOXES_EXT] = boxes_member(boxes, source_size, img.size, num_box_classes)
    return Prepared(data, ext, img.width, img.height, labels, extra)
