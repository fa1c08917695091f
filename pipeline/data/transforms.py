"""Pure image transforms: functions of (image, size, rng) that return uint8 tensors.

    box = random_resized_crop_box(img.width, img.height, rng)     # from the JPEG header, no decode yet
    x = train_tensor(img, 224, rng, randaugment=(2, 9))           # uint8 [3, 224, 224]
    x = eval_tensor(img, 224)                                     # resize + centre crop, uint8 [3, 224, 224]

Batches stay uint8 until they reach the training device, where `normalize` turns them into
floats: four times less host memory and copy bandwidth than float batches.

The hot path decodes once and resamples once: the crop box is drawn from the header size, the
JPEG is decoded at the smallest DCT scale that still covers the crop at the target size
(`draft_for_box`), and one antialiased uint8 resize takes the crop to the target size
(`resized_crop`). `train_tensor` and `eval_tensor` return uint8 [3, size, size] tensors that the
loader copies straight into its batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageEnhance, ImageOps

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
Box = tuple[float, float, float, float]  # left, top, right, bottom in pixels


def random_resized_crop_box(
    width: int, height: int, rng: np.random.Generator, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)
) -> tuple[int, int, int, int]:
    """The crop box (left, top, right, bottom) of Inception-style RandomResizedCrop."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            left = int(rng.integers(0, width - w + 1))
            top = int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    # Fallback: the largest central crop within the ratio bounds.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def center_crop_box(width: int, height: int, size: int, crop_fraction: float = 0.875) -> Box:
    """The box of the original image that 'resize the shorter side to size / crop_fraction, then
    centre crop size x size' keeps, so one resize can do both."""
    scale = round(size / crop_fraction) / min(width, height)  # resized pixels per original pixel
    side = size / scale  # the crop's side in original pixels
    left, top = (width - side) / 2, (height - side) / 2
    return max(0.0, left), max(0.0, top), min(float(width), left + side), min(float(height), top + side)


def draft_request(width: int, height: int, box: Box, size: int) -> tuple[int, int]:
    """The smallest full-image size at which `box` still spans at least size x size pixels.

    PIL's JPEG `draft` picks the largest DCT scale 1/s (s in 1, 2, 4, 8) that keeps the image at
    least this large, so the crop is never resampled up from fewer pixels than the target has.
    """
    box_w, box_h = max(box[2] - box[0], 1e-6), max(box[3] - box[1], 1e-6)
    return math.ceil(width * size / box_w), math.ceil(height * size / box_h)


def draft_for_box(img: Image.Image, box: Box, size: int) -> tuple[Image.Image, Box]:
    """Decode a not-yet-loaded JPEG at reduced scale where `box` allows; returns the box rescaled.

    A no-op (same image, same box) for other formats, already-decoded images, and crops too small
    to shrink: quality at the target size is never lower than decoding at full scale.
    """
    img, box, _ = _drafted(img, box, size)
    return img, box


def _drafted(img: Image.Image, box: Box, size: int) -> tuple[Image.Image, Box, tuple[float, float]]:
    """`draft_for_box`, also returning the scale (x, y) from original to decoded pixels. The scale is the
    decoder's (1/2, 1/4, 1/8), not decoded size / original size: 500 px at 1/8 decode to 63 pixels that
    hold 62.5 pixels' worth of the image."""
    width, height = img.size
    drafted = img.draft(img.mode, draft_request(width, height, box, size))
    if drafted is None or img.size == (width, height):
        return img, box, (1.0, 1.0)
    extent = drafted[1]  # (0, 0, width * scale, height * scale)
    sx, sy = extent[2] / width, extent[3] / height
    scaled = (box[0] * sx, box[1] * sy, min(box[2] * sx, img.width), min(box[3] * sy, img.height))
    return img, scaled, (sx, sy)


def _int_box(box: Box, width: int, height: int) -> tuple[int, int, int, int]:
    """Round a box to whole pixels inside the image, at least one pixel wide and high."""
    left, top = min(max(0, round(box[0])), width - 1), min(max(0, round(box[1])), height - 1)
    return left, top, max(left + 1, min(width, round(box[2]))), max(top + 1, min(height, round(box[3])))


def to_hwc(img: Image.Image) -> torch.Tensor:
    """RGB image -> uint8 [H, W, 3] tensor. A bytearray, not np.asarray: PIL's arrays are read-only
    and torch warns about those; the extra memcpy costs as little as silencing the warning."""
    return torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(img.height, img.width, 3)


def resized_crop(img: Image.Image, box: Box, size: int, interpolation: str = "bilinear") -> torch.Tensor:
    """Crop `box` and resize it to size x size -> uint8 [3, size, size].

    Antialiased bilinear (or bicubic: `interpolation`, eval's default) in torch's uint8 kernel: the same
    filter as PIL's BILINEAR resize (within a few levels on a few pixels) at a third to a half of its cost
    here, reading the crop as it lies in memory ([H, W, 3] is channels-last) with no float copy.
    """
    crop = img.crop(_int_box(box, img.width, img.height))
    if crop.mode != "RGB":  # grey, CMYK, palette: converted after the crop, on fewer pixels
        crop = crop.convert("RGB")
    crop = to_hwc(crop).permute(2, 0, 1).unsqueeze(0)  # [1, 3, h, w], channels-last
    return F.interpolate(crop, size=(size, size), mode=interpolation, antialias=True, align_corners=False)[0]


def to_pil(chw: torch.Tensor) -> Image.Image:
    """uint8 [3, H, W] -> RGB image (for PIL-only ops such as RandAugment's)."""
    return Image.fromarray(chw.permute(1, 2, 0).contiguous().numpy())


# -- RandAugment (Cubuk et al. 2020; timm's magnitude scales, out of 10): each op is a pure
# function of (img, magnitude, rng); the rng draws only the sign of signed ops.
MAX_MAGNITUDE = 10.0
FILL = (128, 128, 128)


def _signed(value: float, rng: np.random.Generator) -> float:
    return value if rng.random() < 0.5 else -value


def auto_contrast(img: Image.Image, magnitude: float, rng: np.random.Generator) -> Image.Image:
    return ImageOps.autocontrast(img)


def equalize(img: Image.Image, magnitude: float, rng: np.random.Generator) -> Image.Image:
    return ImageOps.equalize(img)


def rotate(img: Image.Image, magnitude: float, rng: np.random.Generator) -> Image.Image:
    return img.rotate(_signed(30.0 * magnitude / MAX_MAGNITUDE, rng), Image.BILINEAR, fillcolor=FILL)


def solarize(img: Image.Image, magnitude: float, rng: np.random.Generator) -> Image.Image:
    return ImageOps.solarize(img, 256 - int(256 * magnitude / MAX_MAGNITUDE))


def posterize(img: Image.Image, magnitude: float, rng: np.random.Generator) -> Image.Image:
    return ImageOps.posterize(img, max(1, 8 - int(4 * magnitude / MAX_MAGNITUDE)))


def _enhance(kind: Callable[[Image.Image], ImageEnhance._Enhance]) -> Callable:
    def op(img: Image.Image, magnitude: float, rng: np.random.Generator) -> Image.Image:
        return kind(img).enhance(1.0 + _signed(0.9 * magnitude / MAX_MAGNITUDE, rng))

    op.__name__ = kind.__name__.lower()
    return op


color = _enhance(ImageEnhance.Color)
contrast = _enhance(ImageEnhance.Contrast)
brightness = _enhance(ImageEnhance.Brightness)
sharpness = _enhance(ImageEnhance.Sharpness)


def _affine(img: Image.Image, coeffs: tuple[float, ...]) -> Image.Image:
    return img.transform(img.size, Image.AFFINE, coeffs, Image.BILINEAR, fillcolor=FILL)


def shear_x(img: Image.Image, magnitude: float, rng: np.random.Generator) -> Image.Image:
    return _affine(img, (1, _signed(0.3 * magnitude / MAX_MAGNITUDE, rng), 0, 0, 1, 0))


def shear_y(img: Image.Image, magnitude: float, rng: np.random.Generator) -> Image.Image:
    return _affine(img, (1, 0, 0, _signed(0.3 * magnitude / MAX_MAGNITUDE, rng), 1, 0))


def translate_x(img: Image.Image, magnitude: float, rng: np.random.Generator) -> Image.Image:
    return _affine(img, (1, 0, _signed(0.45 * magnitude / MAX_MAGNITUDE * img.width, rng), 0, 1, 0))


def translate_y(img: Image.Image, magnitude: float, rng: np.random.Generator) -> Image.Image:
    return _affine(img, (1, 0, 0, 0, 1, _signed(0.45 * magnitude / MAX_MAGNITUDE * img.height, rng)))


RAND_AUGMENT_OPS: tuple[Callable[[Image.Image, float, np.random.Generator], Image.Image], ...] = (
    auto_contrast,
    equalize,
    rotate,
    solarize,
    color,
    posterize,
    contrast,
    brightness,
    sharpness,
    shear_x,
    shear_y,
    translate_x,
    translate_y,
)


def rand_augment(img: Image.Image, num_ops: int, magnitude: float, rng: np.random.Generator) -> Image.Image:
    """RandAugment: `num_ops` ops drawn uniformly (with replacement) at a fixed magnitude (0-10)."""
    for i in rng.integers(len(RAND_AUGMENT_OPS), size=num_ops):
        img = RAND_AUGMENT_OPS[i](img, magnitude, rng)
    return img


def train_tensor(
    img: Image.Image,
    size: int,
    rng: np.random.Generator,
    min_scale: float = 0.08,
    randaugment: tuple[int, float] | None = None,
    hflip: bool = True,
) -> torch.Tensor:
    """RandomResizedCrop (+ RandAugment) + horizontal flip -> uint8 [3, size, size] tensor.

    hflip=False for data whose meaning flips with the image (digits, text).

    Draws the box from the header size before decoding, so a JPEG decodes at reduced scale
    when the crop is large enough (`draft_for_box`).
    """
    box = random_resized_crop_box(img.width, img.height, rng, scale=(min_scale, 1.0))
    img, box = draft_for_box(img, box, size)
    out = resized_crop(img, box, size)
    if randaugment is not None:
        out = to_hwc(rand_augment(to_pil(out), randaugment[0], randaugment[1], rng)).permute(2, 0, 1)
    return out.flip(-1) if hflip and rng.random() < 0.5 else out


def mask_crop(mask: Image.Image, box: Box, size: int) -> torch.Tensor:
    """Crop `box` of a class mask (mode "L") and resize it to size x size by nearest neighbour -> uint8
    [size, size]: a pixel keeps a class of its source, classes are never blended."""
    crop = mask.crop(_int_box(box, mask.width, mask.height)).resize((size, size), Image.NEAREST)
    return torch.frombuffer(bytearray(crop.tobytes()), dtype=torch.uint8).view(size, size)


def _crop_pair(
    img: Image.Image, mask: Image.Image, box: Box, size: int, interpolation: str = "bilinear"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The crop `box` of an image and of its mask, both resized to size x size, covering the same pixels: the
    mask is cropped where the (possibly reduced-scale) decoded image's whole-pixel crop lies."""
    img, scaled, (sx, sy) = _drafted(img, box, size)
    left, top, right, bottom = _int_box(scaled, img.width, img.height)
    image = resized_crop(img, (left, top, right, bottom), size, interpolation)
    in_mask = (left / sx, top / sy, min(right / sx, mask.width), min(bottom / sy, mask.height))
    return image, mask_crop(mask, in_mask, size)


def train_pair(
    img: Image.Image,
    mask: Image.Image,
    size: int,
    rng: np.random.Generator,
    min_scale: float = 0.08,
    hflip: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`train_tensor` (no RandAugment) of an image and its class mask of the same size: one crop box and one
    flip (`train_crop_plan`, `train_tensor`'s draws) -> (uint8 [3, size, size], uint8 [size, size])."""
    box, flip = train_crop_plan(img.width, img.height, rng, min_scale, hflip)
    image, target = _crop_pair(img, mask, box, size)
    return (image.flip(-1), target.flip(-1)) if flip else (image, target)


def eval_pair(
    img: Image.Image,
    mask: Image.Image,
    size: int,
    crop_fraction: float = 0.875,
    interpolation: str = "bilinear",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`eval_tensor` of an image and its class mask: the same centre crop of both (the mask by nearest)."""
    box = center_crop_box(img.width, img.height, size, crop_fraction)
    return _crop_pair(img, mask, box, size, interpolation)


def crop_boxes(boxes: np.ndarray, crop: Box, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Boxes [M, 4] (left, top, right, bottom in the image's pixels) seen through the crop `crop` (same
    units) resized to size x size -> (boxes [K, 4] as fractions of the output, clipped to it, keep [M] bool):
    a box keeps what shows of it; one of which less than 1 output pixel across shows is dropped."""
    left, top, right, bottom = crop
    scale = np.array([right - left, bottom - top, right - left, bottom - top], dtype=np.float64)
    out = (np.asarray(boxes, dtype=np.float64).reshape(-1, 4) - [left, top, left, top]) / scale
    out = out.clip(0.0, 1.0)
    keep = ((out[:, 2] - out[:, 0]) * size >= 1.0) & ((out[:, 3] - out[:, 1]) * size >= 1.0)
    return out[keep], keep


def flip_boxes(boxes: np.ndarray) -> np.ndarray:
    """Fractional (left, top, right, bottom) boxes of an image flipped left-right."""
    return np.stack([1.0 - boxes[:, 2], boxes[:, 1], 1.0 - boxes[:, 0], boxes[:, 3]], axis=1)


def _crop_with_boxes(
    img: Image.Image, boxes: np.ndarray, box: Box, size: int, interpolation: str = "bilinear"
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """The crop `box` of an image resized to size x size, and its objects' boxes seen through the very
    pixels the (possibly reduced-scale) decoded image's whole-pixel crop covers (`crop_boxes`)."""
    img_w, img_h = img.width, img.height
    img, scaled, (sx, sy) = _drafted(img, box, size)
    left, top, right, bottom = _int_box(scaled, img.width, img.height)
    image = resized_crop(img, (left, top, right, bottom), size, interpolation)
    covered = (left / sx, top / sy, min(right / sx, img_w), min(bottom / sy, img_h))
    return (image, *crop_boxes(boxes, covered, size))


def train_boxes(
    img: Image.Image,
    boxes: np.ndarray,
    size: int,
    rng: np.random.Generator,
    min_scale: float = 0.08,
    hflip: bool = True,
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """`train_tensor` (no RandAugment) of an image and its objects' boxes [M, 4] (left, top, right, bottom
    in pixels): one crop box and one flip (`train_crop_plan`) -> (uint8 [3, size, size], the kept boxes as
    fractions of the output [K, 4], keep [M] bool; `crop_boxes`)."""
    box, flip = train_crop_plan(img.width, img.height, rng, min_scale, hflip)
    image, out, keep = _crop_with_boxes(img, boxes, box, size)
    return (image.flip(-1), flip_boxes(out), keep) if flip else (image, out, keep)


def eval_boxes(
    img: Image.Image, boxes: np.ndarray, size: int, interpolation: str = "bilinear"
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """The whole image resized to size x size (no centre crop: it would cut objects off), with its boxes
    as fractions of it: what a detection eval sees; fractions times the image's own size are its pixels."""
    return _crop_with_boxes(img, boxes, (0, 0, img.width, img.height), size, interpolation)


def train_crop_plan(
    width: int, height: int, rng: np.random.Generator, min_scale: float = 0.08, hflip: bool = True
) -> tuple[tuple[int, int, int, int], bool]:
    """(crop box, flip) of `train_tensor` without RandAugment, drawn in its order from the same `rng`:
    what a loader worker sends with a still-encoded JPEG when the training device decodes (data.decode: cuda)."""
    box = random_resized_crop_box(width, height, rng, scale=(min_scale, 1.0))
    return box, bool(hflip and rng.random() < 0.5)


def crop_resize_flip(image: torch.Tensor, box: Box, flip: bool, size: int) -> torch.Tensor:
    """uint8 [3, H, W] on any device -> the crop `box` resized to uint8 [3, size, size] (antialiased
    bilinear, as `resized_crop`), flipped left-right if `flip`. The device side of `train_crop_plan`."""
    left, top, right, bottom = _int_box(box, image.shape[2], image.shape[1])
    crop = image[None, :, top:bottom, left:right].float()  # [1, 3, h, w]
    out = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
    out = out.round_().clamp_(0, 255).to(torch.uint8)
    return out.flip(-1) if flip else out


# A batch's crops are padded to its largest crop, as floats: past this many elements a batch is cut into groups of
# similar crop sizes (1 << 28 is 1 GiB of fp32; 256 crops of 500 x 500 take 0.2 of it), so one outsized image
# costs a second group, not a padded copy of the whole batch at its size.
CROP_BATCH_ELEMENTS = 1 << 28


def crop_resize_flip_batch(
    images: list[torch.Tensor],
    boxes: list[Box],
    flips: list[bool],
    size: int,
    max_elements: int = CROP_BATCH_ELEMENTS,
) -> torch.Tensor:
    """`crop_resize_flip` of every image at once -> uint8 [B, 3, size, size] on the images' device: the same
    integer boxes (`_int_box`) and the same antialiased bilinear filter, to within one grey level, in a number
    of kernels that does not grow with B (one group: about 60 small ops; the per-image path ran ~8 per image).

    images: uint8 [3, H_i, W_i] of any sizes on one device (contiguous, as decoders return them: a
    non-contiguous one costs a copy). The resampling is separable, so each sample's is two matrices,
    Wy [size, h] and Wx [size, w] over its crop (h x w), and out = Wy @ crop @ Wx^T: the crops gathered
    padded into one tensor, then two batched matmuls in fp32 (TF32 where the process enables it: off by
    under half a grey level before rounding). The flip reverses Wx's rows; padding gets zero weight.
    """
    n = len(images)
    if not (n == len(boxes) == len(flips)) or n == 0:
        raise ValueError(f"{n} images, {len(boxes)} boxes and {len(flips)} flips: need as many, at least one")
    device = images[0].device
    # per sample: [its crop's first pixel in the flat buffer, channel stride, row stride, crop h, crop w, flip]
    starts, params = 0, []
    for img, box, flip in zip(images, boxes, flips):
        if img.dtype != torch.uint8 or img.dim() != 3 or img.shape[0] != 3:
            raise ValueError(f"expected uint8 [3, H, W] images, got {img.dtype} {list(img.shape)}")
        height, width = img.shape[1], img.shape[2]
        left, top, right, bottom = _int_box(box, width, height)
        first = starts + top * width + left
        params.append([first, height * width, width, bottom - top, right - left, int(flip)])
        starts += img.numel()
    widest = max(p[4] for p in params)
    # Every image's pixels one after another, then `widest` zeros so that a window of that width starting at
    # any pixel stays inside the buffer: one copy kernel per batch (torch.cat launches one per 64-128 inputs).
    flat = torch.cat([img.reshape(-1) for img in images] + [images[0].new_zeros(widest)])  # [total + widest]
    groups = _crop_groups([(p[3], p[4]) for p in params], max_elements)
    if len(groups) == 1:
        return _crop_group(flat, params, size, device)
    out = torch.empty((n, 3, size, size), dtype=torch.uint8, device=device)
    for group in groups:
        index = _host_to(torch.tensor(group), device)
        out.index_copy_(0, index, _crop_group(flat, [params[i] for i in group], size, device))
    return out


def _crop_groups(crops: list[tuple[int, int]], max_elements: int) -> list[list[int]]:
    """Sample indices in groups whose crops, padded to the group's largest height and width, stay within
    `max_elements` (a crop alone over it is a group of its own): the whole batch in order when it fits."""
    n, most_h, most_w = len(crops), max(h for h, _ in crops), max(w for _, w in crops)
    if n * 3 * most_h * most_w <= max_elements:
        return [list(range(n))]
    groups: list[list[int]] = []
    group, gh, gw = [], 0, 0
    for i in sorted(range(n), key=lambda i: crops[i][0] * crops[i][1], reverse=True):
        h, w = max(gh, crops[i][0]), max(gw, crops[i][1])
        if group and (len(group) + 1) * 3 * h * w > max_elements:
            groups.append(group)
            group, h, w = [], crops[i][0], crops[i][1]
        group, gh, gw = group + [i], h, w
    return groups + [group]


def _host_to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` with no host sync: through pinned memory, copied asynchronously (the
    host allocator keeps the pinned block until the copy is done)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _crop_group(flat: torch.Tensor, params: list[list[int]], size: int, device: torch.device) -> torch.Tensor:
    """One group of `crop_resize_flip_batch`: n samples' params -> uint8 [n, 3, size, size]."""
    n, tall, wide = len(params), max(p[3] for p in params), max(p[4] for p in params)
    first, channel, row, heights, widths, flips = _host_to(torch.tensor(params), device).unbind(1)  # each [n]
    # The crops' rows, gathered as windows of `wide` pixels: rows past a crop's height repeat its last row
    # and columns past its width read whatever follows; both get zero weight.
    y = torch.minimum(torch.arange(tall, device=device), heights[:, None] - 1)  # [n, tall]
    starts = first[:, None, None] + y[:, :, None] * row[:, None, None]  # [n, tall, 1]
    starts = starts + torch.arange(3, device=device) * channel[:, None, None]  # [n, tall, 3]
    windows = flat.unfold(0, wide, 1)  # [total + widest - wide + 1, wide] view: window k = flat[k : k + wide]
    crops = windows.index_select(0, starts.reshape(-1)).view(n, tall, 3 * wide)  # [n, y, (c, x)] uint8
    wy = _antialias_weights(heights, tall, size)  # [n, size, tall]
    wx = _antialias_weights(widths, wide, size)  # [n, size, wide]
    wx = torch.where(flips.bool()[:, None, None], wx.flip(1), wx)  # a flip reverses the output columns
    out = torch.bmm(wy, crops.float())  # [n, size, 3 * wide]: rows resampled
    out = torch.bmm(out.view(n, size * 3, wide), wx.transpose(1, 2))  # [n, (y, c), size]: then columns
    out = out.round_().clamp_(0, 255).view(n, size, 3, size).permute(0, 2, 1, 3)  # [n, 3, size, size]
    return torch.empty((n, 3, size, size), dtype=torch.uint8, device=device).copy_(out)


def _antialias_weights(lengths: torch.Tensor, padded: int, size: int) -> torch.Tensor:
    """float32 [n, size, padded]: row i of sample b weighs the first lengths[b] input pixels (zero beyond) into
    output pixel i, as torch's antialiased bilinear resize does (ATen's `_compute_weights_aa`, PIL's filter):
    a triangle of half-width max(1, scale) around the centre scale * (i + 0.5), scale = lengths[b] / size,
    weights normalised to sum to one. Its window [xmin, xmin + xsize) adds nothing: outside it the triangle
    is zero."""
    length = lengths.to(torch.float32)[:, None, None]  # [n, 1, 1]
    scale = length / size
    invscale = scale.clamp(min=1.0).reciprocal_()  # a downscale widens the filter by its scale
    i = torch.arange(size, device=lengths.device, dtype=torch.float32)[:, None]  # [size, 1] output pixels
    centre = scale * (i + 0.5)  # [n, size, 1]
    j = torch.arange(padded, device=lengths.device, dtype=torch.float32)  # [padded] input pixels
    w = (j - centre).add_(0.5).mul_(invscale).abs_().neg_().add_(1.0).clamp_(min=0.0)  # [n, size, padded]
    w.masked_fill_(j >= length, 0.0)  # padding
    return w.div_(w.sum(-1, keepdim=True))


def eval_tensor(
    img: Image.Image, size: int, crop_fraction: float = 0.875, interpolation: str = "bilinear"
) -> torch.Tensor:
    """Resize the shorter side to size / crop_fraction and centre crop, in one resampling pass."""
    box = center_crop_box(img.width, img.height, size, crop_fraction)
    img, box = draft_for_box(img, box, size)
    return resized_crop(img, box, size, interpolation)


_NORM_CONSTANTS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _norm_constants(mean, std, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean x 255, std x 255) as [1, 3, 1, 1] float32 on `device`: copied there once per process, not per
    batch (a host-to-device copy from pageable memory blocks the host)."""
    key = (tuple(mean), tuple(std), device)
    if key not in _NORM_CONSTANTS:
        m = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1) * 255
        s = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1) * 255
        _NORM_CONSTANTS[key] = (m.to(device), s.to(device))
    return _NORM_CONSTANTS[key]


def normalize(images: torch.Tensor, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> torch.Tensor:
    """uint8 [B, 3, H, W] on any device -> float32 normalised, on that device."""
    m, s = _norm_constants(mean, std, images.device)
    return (images.float() - m) / s


def mixup_cutmix(
    images: torch.Tensor,
    targets: torch.Tensor,
    rng: np.random.Generator,
    mixup_alpha: float = 0.0,
    cutmix_alpha: float = 0.0,
    switch_prob: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-level Mixup or CutMix (timm's recipe): each sample is mixed with the batch reversed.

    images [B, C, H, W] float, targets [B, K] probabilities; every random draw comes from `rng`.
    """
    if mixup_alpha <= 0 and cutmix_alpha <= 0:
        return images, targets
    use_cutmix = cutmix_alpha > 0 and (mixup_alpha <= 0 or rng.random() < switch_prob)
    alpha = cutmix_alpha if use_cutmix else mixup_alpha
    lam = float(rng.beta(alpha, alpha))
    flipped = images.flip(0)
    if use_cutmix:
        h, w = images.shape[-2:]
        cut = (1 - lam) ** 0.5
        ch, cw = int(h * cut), int(w * cut)
        cy, cx = int(rng.integers(h)), int(rng.integers(w))
        y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, h)
        x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, w)
        images = images.clone()
        images[..., y0:y1, x0:x1] = flipped[..., y0:y1, x0:x1]
        lam = 1 - (y1 - y0) * (x1 - x0) / (h * w)  # the area actually pasted
    else:
        images = images * lam + flipped * (1 - lam)
    return images, targets * lam + targets.flip(0) * (1 - lam)
