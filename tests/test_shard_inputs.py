"""`vitpipe shard` against damaged and unusual inputs: no single input stops a run, and every stored
sample meets the stored-image contract (data_prep/images.py: 8-bit RGB or L, upright, the recorded size).

The corpus is generated here (nothing committed, nothing downloaded) and sharded through the real CLI
in a subprocess. As root (CI) that subprocess runs without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH
(`setpriv`), so a chmod-000 file is really unreadable to it.

.venv/bin/python -m pytest tests/test_shard_inputs.py -q
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import tarfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from data_prep.build import BuildOptions, build_dataset
from data_prep.images import Prepared, prepare_generated
from data_prep.layout import read_manifest
from data_prep.sources import Item

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]
RED, GREY = (220, 20, 20), (128, 128, 128)
# Root ignores file permissions; without these two capabilities it obeys them like anyone else.
DROP_FILE_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]


def unprivileged() -> list[str]:
    """The command prefix under which a chmod-000 file is unreadable: nothing, or setpriv as root."""
    return DROP_FILE_OVERRIDE if os.geteuid() == 0 else []


def shard(*args) -> subprocess.CompletedProcess:
    cmd = [*unprivileged(), sys.executable, "-m", "vitpipe", "shard", *map(str, args)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{cmd} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    for bad in ("Traceback", "UnboundLocalError"):
        assert bad not in proc.stderr, proc.stderr
    return proc


# ---------------------------------------------------------------------- the corpus


def encoded(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def noise(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def red_corner(w: int, h: int) -> Image.Image:
    """Grey with a red block in the top-left corner: shows which way up an image is."""
    img = Image.new("RGB", (w, h), GREY)
    img.paste(RED, (0, 0, w // 3, h // 3))
    return img


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_of(width: int, height: int, depth: int, colour: int, rows: bytes = b"") -> bytes:
    """A PNG written by hand: for what Pillow does not write (16-bit RGB) or a header that lies."""
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    idat = png_chunk(b"IDAT", zlib.compress(rows)) if rows else b""
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + idat + png_chunk(b"IEND", b"")


def animated(fmt: str) -> bytes:
    frames = [Image.new("RGB", (24, 16), colour) for colour in (RED, (20, 20, 220))]
    return encoded(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0)


def exif_rotated(upright: Image.Image) -> bytes:
    """A JPEG whose pixels lie on their side, with EXIF orientation 6 (turn 90 degrees clockwise)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return encoded(upright.transpose(Image.Transpose.ROTATE_90), "JPEG", quality=95, exif=exif.tobytes())


def broken_idat_length(png: bytes) -> bytes:
    """The first IDAT claims 7 bytes fewer than it holds: Pillow takes image data for the next chunk's
    header and raises SyntaxError ("broken PNG file"), not OSError, while decoding."""
    at = png.index(b"IDAT") - 4
    (length,) = struct.unpack(">I", png[at : at + 4])
    return png[:at] + struct.pack(">I", length - 7) + png[at + 4 :]


@dataclass(frozen=True)
class Stored:
    """The input becomes a sample: stored as `ext`, decoding to `mode` at `size` (w, h)."""

    ext: str
    mode: str
    size: tuple[int, int]
    check: Callable[[Image.Image], None] | None = None


@dataclass(frozen=True)
class Error:
    """The input becomes one errors.parquet row at `stage` whose reason contains `says`."""

    stage: str
    says: str


def corner_is_red(img: Image.Image) -> None:
    w, h = img.size
    r, g, b = img.convert("RGB").getpixel((2, 2))
    assert r > 180 and g < 80 and b < 80, f"top-left {(r, g, b)} is not red: not upright"
    for corner in ((w - 3, 2), (2, h - 3), (w - 3, h - 3)):
        assert img.convert("RGB").getpixel(corner)[0] < 180, f"{corner} is red: not upright"


def is_red(img: Image.Image) -> None:
    """Red: the CMYK input's colour, an animation's first frame (its second is blue)."""
    r, g, b = img.convert("RGB").getpixel((5, 5))
    assert r > 180 and g < 80 and b < 80, f"{(r, g, b)} is not red"


def grey_scaled_not_clipped(img: Image.Image) -> None:
    assert np.array_equal(np.asarray(img), np.arange(256, dtype=np.uint8).reshape(16, 16))


def white_under_transparency(img: Image.Image) -> None:
    white = 255 if img.mode == "L" else (255, 255, 255)
    assert img.getpixel((0, 0)) == white and img.getpixel((img.width - 1, 0)) != white


def sixteen_bit_rgb_is_eight_bit_now(img: Image.Image) -> None:
    assert img.getpixel((0, 0)) == (255, 128, 0)


def half_transparent(mode: str) -> Image.Image:
    """Left half fully transparent black, right half opaque colour."""
    img = Image.new(mode, (20, 10), (0,) * len(mode))
    img.paste((40,) * (len(mode) - 1) + (255,), (10, 0, 20, 10))
    return img


def write_corpus(root: Path) -> dict[str, Stored | Error]:
    """Every damaged or unusual input under root/a/, and where it must land."""
    folder = root / "a"
    folder.mkdir(parents=True)
    jpg, png = encoded(noise(96, 64), "JPEG", quality=90), encoded(noise(96, 64, seed=1), "PNG")
    small = noise(30, 20, seed=2)
    corpus: dict[str, tuple[bytes, Stored | Error]] = {
        "zero bytes.jpg": (b"", Error("listing", "empty file (0 bytes)")),
        "text.jpg": (b"just some notes\n", Error("decode", "not an image Pillow can read")),
        "png bytes.jpg": (encoded(small, "PNG"), Stored("png", "RGB", (30, 20))),
        "one by one png.png": (encoded(Image.new("RGB", (1, 1), RED), "PNG"), Stored("png", "RGB", (1, 1))),
        "one by one jpg.jpg": (encoded(Image.new("L", (1, 1), 7), "JPEG"), Stored("jpg", "L", (1, 1))),
        "photo with spaces.jpg": (encoded(small, "JPEG"), Stored("jpg", "RGB", (30, 20))),
        "café ünïcode 写真.webp": (encoded(small, "WEBP"), Stored("webp", "RGB", (30, 20))),
        "still.gif": (encoded(small.convert("P"), "GIF"), Stored("png", "RGB", (30, 20))),
        "plain bmp.bmp": (encoded(small, "BMP"), Stored("png", "RGB", (30, 20))),
        "plain tiff.tiff": (encoded(small, "TIFF"), Stored("png", "RGB", (30, 20))),
        "cmyk.jpg": (
            encoded(Image.new("CMYK", (32, 24), (0, 255, 255, 0)), "JPEG"),
            Stored("jpg", "RGB", (32, 24), is_red),  # (0, 255, 255, 0) is red
        ),
        "sixteen bit grey.png": (
            encoded(Image.fromarray(np.arange(0, 65536, 257, dtype=np.uint16).reshape(16, 16)), "PNG"),
            Stored("png", "L", (16, 16), grey_scaled_not_clipped),
        ),
        "sixteen bit rgb.png": (
            png_of(4, 3, 16, 2, (b"\x00" + struct.pack(">HHH", 65535, 32896, 0) * 4) * 3),
            Stored("png", "RGB", (4, 3), sixteen_bit_rgb_is_eight_bit_now),
        ),
        "palette.png": (encoded(small.convert("P"), "PNG"), Stored("png", "RGB", (30, 20))),
        "one bit.png": (encoded(small.convert("1"), "PNG"), Stored("png", "L", (30, 20))),
        "grey alpha.png": (
            encoded(half_transparent("LA"), "PNG"),
            Stored("png", "L", (20, 10), white_under_transparency),
        ),
        "rgba.png": (
            encoded(half_transparent("RGBA"), "PNG"),
            Stored("png", "RGB", (20, 10), white_under_transparency),
        ),
        # Orientation 6: the file is 60x40, upright it is 40x60; the red corner must be top-left.
        "exif rotated.jpg": (exif_rotated(red_corner(40, 60)), Stored("jpg", "RGB", (40, 60), corner_is_red)),
        # Also resized (--resize-max 100): drafted at the file's own orientation, then turned.
        "exif rotated big.jpg": (
            exif_rotated(red_corner(120, 200)),
            Stored("jpg", "RGB", (60, 100), corner_is_red),
        ),
        "animated gif.gif": (animated("GIF"), Stored("png", "RGB", (24, 16), is_red)),
        "animated webp.webp": (animated("WEBP"), Stored("webp", "RGB", (24, 16), is_red)),
        "animated png.png": (animated("PNG"), Stored("png", "RGB", (24, 16), is_red)),
        "bomb.png": (
            encoded(Image.new("1", (9500, 9500)), "PNG"),  # 90 Mpx: over the limit (warning), 11 KB
            Error("decode", "decompression bomb"),
        ),
        "bomb header.png": (png_of(20_000, 20_000, 8, 2), Error("decode", "decompression bomb")),
        "broken chunk.png": (broken_idat_length(png), Error("decode", "SyntaxError: broken PNG file")),
        "bad header.ppm": (b"P6\n4 4x\n255\n" + bytes(48), Error("decode", "ValueError: invalid literal")),
    }
    header_of = {  # cut at 16 bytes: the reason names the format the file starts like
        "jpg": (jpg, "JPEG"),
        "png": (png, "PNG"),
        "webp": (encoded(small, "WEBP"), "WEBP"),
        "gif": (encoded(small.convert("P"), "GIF"), "GIF"),
        "bmp": (encoded(small, "BMP"), "BMP"),
        "tiff": (encoded(small, "TIFF"), "TIFF"),
    }
    for ext, (data, says) in header_of.items():
        corpus[f"header cut {ext}.{ext}"] = (data[:16], Error("decode", says))
    for ext, data in (("jpg", jpg), ("png", png)):
        for percent in (25, 50, 90):
            corpus[f"body cut {percent} {ext}.{ext}"] = (
                data[: len(data) * percent // 100],
                Error("decode", "truncated"),
            )
    stems = [Path(name).stem for name in corpus]
    assert len(set(stems)) == len(stems), "two inputs would share a key"
    expected = {}
    for name, (data, outcome) in corpus.items():
        (folder / name).write_bytes(data)
        expected[name] = outcome
    locked = folder / "locked.jpg"
    locked.write_bytes(jpg)
    locked.chmod(0)
    expected[locked.name] = Error("read", "cannot read: Permission denied")
    (folder / "dangling.jpg").symlink_to(folder / "gone.jpg")
    expected["dangling.jpg"] = Error("listing", "cannot read: No such file or directory")
    return expected


def test_locked_file_is_unreadable_to_the_sharding_process(tmp_path):
    """Without this, as root, the permission case would prove nothing."""
    locked = tmp_path / "locked"
    locked.write_bytes(b"secret")
    locked.chmod(0)
    probe = [*unprivileged(), sys.executable, "-c", f"open({str(locked)!r}, 'rb').read()"]
    proc = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "PermissionError" in proc.stderr, (probe, proc.stderr)


# ---------------------------------------------------------------------- the runs


def read_samples(out: Path) -> dict[str, tuple[str, Image.Image]]:
    """key -> (member extension, decoded image), from every shard the manifest lists."""
    samples = {}
    for info in read_manifest(out).shards:
        with tarfile.open(out / info.path) as tar:
            for member in tar.getmembers():
                base, ext = member.name.rsplit("/", 1)[-1].split(".", 1)
                if ext in ("jpg", "png", "webp"):
                    img = Image.open(io.BytesIO(tar.extractfile(member).read()))
                    img.load()
                    samples[member.name.rsplit(".", 1)[0]] = (ext, img)
    return samples


def readable(reason: str) -> None:
    assert reason and "\n" not in reason and len(reason) < 400, repr(reason)
    for bad in ("Traceback", "UnboundLocalError", "<_io.", "object at 0x"):
        assert bad not in reason, reason


def landed_wrong(outcome: Stored | Error, row: dict | None, error: dict | None, samples: dict) -> str | None:
    """What is wrong with where one input landed; None if it landed as expected."""
    if isinstance(outcome, Error):
        if error is None:
            return f"expected an error at {outcome.stage}, stored as a sample"
        if error["stage"] != outcome.stage or outcome.says not in error["reason"]:
            return f"expected an error at {outcome.stage} saying {outcome.says!r}, got {error}"
        readable(error["reason"])
        return None
    if row is None:
        return f"expected a sample, got {error}"
    ext, img = samples[row["key"]]
    if (ext, img.mode, img.size) != (outcome.ext, outcome.mode, outcome.size):
        return f"expected {outcome.ext} {outcome.mode} {outcome.size}, stored {ext} {img.mode} {img.size}"
    if (row["width"], row["height"]) != img.size:
        return f"index.parquet says {row['width']}x{row['height']}, the image is {img.size}"
    if outcome.check is not None:
        try:
            outcome.check(img)
        except AssertionError as exc:
            return str(exc)
    return None


def test_every_damaged_or_unusual_input_lands_exactly_once(tmp_path):
    src = (tmp_path / "in").resolve()
    expected = write_corpus(src)
    out = tmp_path / "out"
    proc = shard(
        "folder", src, out, "--workers", 1, "--max-errors", 0.9, "--resize-max", 100, "--max-count", 16
    )
    assert (out / "manifest.json").is_file()
    index = {Path(r["source"]).name: r for r in pq.read_table(out / "index.parquet").to_pylist()}
    errors = pq.read_table(out / "errors.parquet").to_pylist()
    error_of = {Path(e["source"]).name: e for e in errors}
    assert len(error_of) == len(errors), "an input is listed twice in errors.parquet"
    assert not index.keys() & error_of.keys(), "an input is both a sample and an error"
    assert index.keys() | error_of.keys() == expected.keys()
    assert f"rejected {len(errors)} of {len(expected)} inputs" in proc.stdout

    samples = read_samples(out)
    assert len(samples) == len(index)
    wrong = [
        f"{name}: {problem}"
        for name, outcome in expected.items()
        if (problem := landed_wrong(outcome, index.get(name), error_of.get(name), samples))
    ]
    assert not wrong, "\n".join(wrong)
    # Kept byte for byte where the contract allows: a plain JPEG stays the file's own bytes.
    kept = index["photo with spaces.jpg"]
    assert kept["bytes"] == (src / "a" / "photo with spaces.jpg").stat().st_size


def test_manifest_bad_rows_are_error_rows_and_good_rows_are_written(tmp_path):
    for i in range(3):
        (tmp_path / f"good{i}.png").write_bytes(encoded(noise(12, 8, seed=i), "PNG"))
    rows = [
        ("good0.png", "0", "train"),
        ("good1.png", "1", "val"),
        ("good2.png", "1", ""),
        ("missing.png", "0", "train"),  # row 4: no such file
        ("", "0", "train"),  # row 5: no path
        ("good0.png", "5", "train"),  # row 6: label index out of range (2 classes)
        ("good1.png", "", "train"),  # row 7: no label
        ("good2.png", "1", "my split"),  # row 8: not a split name
    ]
    manifest = tmp_path / "list.csv"
    manifest.write_text("path,label,split\n" + "".join(f"{p},{c},{s}\n" for p, c, s in rows))
    out = tmp_path / "out"
    proc = shard("manifest", manifest, out, "--classes", "cat,dog", "--workers", 1, "--max-errors", 0.9)
    assert "rejected 5 of 8 inputs" in proc.stdout
    index = pq.read_table(out / "index.parquet").to_pylist()
    assert sorted((r["key"], r["split"], r["label"]) for r in index) == [
        ("good0", "train", 0),
        ("good1", "val", 1),
        ("good2", "train", 1),
    ]
    errors = pq.read_table(out / "errors.parquet").to_pylist()
    assert all(e["stage"] == "listing" for e in errors)
    got = sorted((e["source"].rsplit("/", 1)[-1], e["reason"]) for e in errors)
    assert got == [
        ("good0.png", "label index 5 outside 0..1"),
        ("good1.png", "no label"),
        ("good2.png", "split 'my split' is not a folder name of letters, digits, '_' or '-'"),
        ("list.csv row 5", "no path"),
        ("missing.png", "cannot read: No such file or directory"),
    ]
    for e in errors:
        readable(e["reason"])
    assert read_manifest(out).totals == {"train": 2, "val": 1}


class RaisingLoader:
    """Generated grey images; the item named "boom" raises what a buggy loader would."""

    def load(self, item: Item, resize_max: int | None, quality: int) -> Prepared:
        if item.key == "boom":
            raise RuntimeError("loader bug\nsecond line")
        return prepare_generated(Image.new("L", (8, 8), 100), "png", resize_max, quality)


class RaisingSource:
    kind, where, classes, multi_label, mix, split_salt = "raising", "test", ["x"], False, False, 0

    def describe(self) -> dict:
        return {"kind": self.kind}

    def count_hint(self) -> int | None:
        return 3

    def listing(self):
        for key in ("before", "boom", "after"):
            yield Item(key, f"test:{key}", (0,), 100)

    def loader(self) -> RaisingLoader:
        return RaisingLoader()


def test_an_unexpected_loader_exception_is_an_error_row_and_the_shard_goes_on(tmp_path):
    report = build_dataset(RaisingSource(), tmp_path / "out", BuildOptions(progress=False, max_errors=0.5))
    assert report.failure is None and report.num_written == 2 and report.num_errors == 1
    index = pq.read_table(tmp_path / "out" / "index.parquet").column("key").to_pylist()
    assert index == ["before", "after"]  # one shard: the inputs after the failing one are in it
    (error,) = pq.read_table(tmp_path / "out" / "errors.parquet").to_pylist()
    assert (error["key"], error["stage"], error["reason"]) == (
        "boom",
        "read",
        "RuntimeError: loader bug second line",
    )
    assert error["shard"] == "train/shard-000000.tar"
