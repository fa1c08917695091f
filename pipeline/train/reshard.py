"""A ZeRO checkpoint loaded on another number of ranks than saved it, each rank reading only its own part.

What the saved files hold. ZeRO-1/2 (and DeepSpeed's bf16 optimizer) on W ranks: per parameter group, one flat
fp32 vector (the group's parameters end to end, each padded to 16 bytes, the group padded at its end) cut in W
equal slices, rank r's slice and its Adam moments in its `*zero_pp_rank_r_*optim_states.pt`; the flat layout
does not depend on W, only the end padding does. ZeRO-3 on W ranks: every parameter cut in W equal parts of
ceil(numel / W) elements, rank r's parts end to end per sub-group in its optim_states file, the parameters'
shapes in saved rank 0's model states.

How a rank of the new world size loads. It knows which elements of the flat vectors (ZeRO-1/2) or of each
parameter (ZeRO-3) it owns, so it reads those elements, and no others, from the saved files that hold them:
byte ranges of each file's tensors, found from the file's zip directory and its pickled structure read
without its tensors (`TorchFile`: a few KB per file), from this node's disk where it holds the file whole
and from the bucket otherwise (`Sources`). Neighbouring ranges of one file are read as one where the gap is
short (`GAP`), several at once (`READERS`). Bytes a rank reads: its share of the optimizer states, plus the metadata of the files
it reads from and of saved rank 0's (loss scale, step, parameter groups).

The fragments go into DeepSpeed's optimizer through its own universal-checkpoint loader (`load_checkpoint`
with `load_universal_checkpoint`), whose per-parameter hook (`load_hp_checkpoint_state`) is pointed at the
fragments read here instead of at whole-parameter files: no conversion runs and nothing is written to the
bucket, so a killed resume leaves nothing a later one could take for complete. Where a file's layout is
not the one described above (`LayoutMismatch` names the file, group and parameter), the resume falls back
to DeepSpeed's universal conversion of the whole tag (`checkpoint.to_universal`).

The weight EMA's files (safetensors) are read the same way: a rank reads its share's slices of the files
that hold them (`SafetensorsParts`), not the files.

A file on this node's disk is read only where it matches COMPLETE.json's size and sha256 (a rank hashes the
few files it reads from); the ranges read from the bucket are checked against the sizes it records, not its
sha256s, which cover whole files.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import pickle
import shutil
import struct
import tempfile
import threading
import types
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from data_prep.storage import Store
from data_prep.tario import file_sha256
from pipeline.train.tag import ZERO3_STATES, model_states, optim_files

log = logging.getLogger(__name__)

STATES = ("fp32", "exp_avg", "exp_avg_sq")
BLOCK = 1 << 14  # bytes of a file's metadata read at once (its zip directory, its pickle)
GAP = (
    1 << 16
)  # bytes: a gap between ranges of one file this short, and a quarter of the next range at most, is read through
READERS = 8  # ranges a rank reads at once


class LayoutMismatch(RuntimeError):
    """A saved file's layout is not the one this module reads in ranges."""


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a torch.save file, not read: its storage record, dtype, element offset and shape."""

    key: str
    dtype: torch.dtype
    offset: int
    shape: tuple

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: torch.dtype


def _rebuild(storage, offset, size, stride, *_):
    size = tuple(size)
    contiguous = tuple(torch.empty(size, device="meta").stride()) if size else ()
    if tuple(stride) != contiguous:
        raise LayoutMismatch(f"a saved tensor of shape {size} has strides {tuple(stride)}, not contiguous")
    return TensorRef(storage.key, storage.dtype, int(offset), size)


class _WithoutTensors(pickle.Unpickler):
    """A torch.save pickle with every tensor left as a `TensorRef` (its bytes stay in the file)."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) in (
            ("torch._utils", "_rebuild_parameter"),
            ("torch._utils", "_rebuild_parameter_with_state"),
        ):
            return lambda data, *_: data  # an nn.Parameter: its tensor
        return super().find_class(module, name)

    def persistent_load(self, pid):
        _, storage_type, key, _, _ = pid
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type._dtype
        return _Storage(str(key), dtype)


class Sources:
    """The files of one checkpoint tag, read in byte ranges: from this node's disk where it holds a file as
    COMPLETE.json lists it (size and sha256), else from `store`. Counts the bytes and requests that went
    to the store."""

    def __init__(self, tag_dir: Path, record: dict, store: Store | None):
        self.tag_dir, self.files, self.store = tag_dir, record["files"], store
        self.bucket_bytes = self.bucket_requests = 0
        self._open: dict[str, object] = {}
        self._lock = threading.Lock()

    def size(self, name: str) -> int:
        if name not in self.files:
            raise LayoutMismatch(f"{self.tag_dir.name}: COMPLETE.json lists no {name}")
        return self.files[name]["bytes"]

    def _held(self, path: Path, name: str) -> bool:
        """Whether this node's disk holds the file as the tag lists it: its size, and its sha256 (a file left
        by a save that never completed can have the size of the one listed)."""
        meta = self.files[name]
        if not path.is_file() or path.stat().st_size != meta["bytes"]:
            return False
        return "sha256" not in meta or file_sha256(path) == meta["sha256"]

    def open(self, name: str) -> None:
        """Find where the file is read from (this disk, or the store), or raise: before a reader that would
        take an error reading it for something else (zipfile: a file that is not a zip)."""
        self._handle(name)

    def _handle(self, name: str):
        with self._lock:
            if name not in self._open:
                path = self.tag_dir / name
                if self._held(path, name):
                    self._open[name] = ("local", path)
                elif self.store is not None:
                    remote = self.store.open_file(f"{self.tag_dir.name}/{name}")
                    if remote.size() != self.size(name):
                        raise OSError(
                            f"{self.store.describe(self.tag_dir.name + '/' + name)}: {remote.size()} bytes, "
                            f"COMPLETE.json says {self.size(name)}"
                        )
                    self._open[name] = ("store", remote)
                else:
                    raise FileNotFoundError(
                        f"{path}: not on this node's disk as COMPLETE.json lists it (missing, or another size or "
                        "sha256) and no checkpoint.uri to read it from (a resume on another number of ranks "
                        "reads parts of the saved ranks' files)"
                    )
            return self._open[name]

    def read(self, name: str, offset: int, length: int) -> bytes:
        if offset < 0 or offset + length > self.size(name):
            raise LayoutMismatch(
                f"{self.tag_dir / name}: bytes [{offset}, {offset + length}) lie past its end"
            )
        kind, handle = self._handle(name)
        if kind == "local":
            with open(handle, "rb") as f:
                f.seek(offset)
                data = f.read(length)
        else:
            data = handle.read_at(length, offset)
            with self._lock:
                self.bucket_bytes += len(data)
                self.bucket_requests += 1
        if len(data) != length:
            raise OSError(f"{self.tag_dir / name}: read {len(data)} bytes of [{offset}, {offset + length})")
        return bytes(data)

    def close(self) -> None:
        for kind, handle in self._open.values():
            if kind == "store":
                handle.close()
        self._open.clear()


class _RangeFile(io.RawIOBase):
    """A file of `Sources` as a seekable stream for `zipfile`, read in cached blocks of BLOCK bytes."""

    def __init__(self, sources: Sources, name: str):
        self.sources, self.name, self.pos = sources, name, 0
        self.length = sources.size(name)
        self.blocks: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.length + offset}[whence]
        return self.pos

    def _block(self, index: int) -> bytes:
        if index not in self.blocks:
            start = index * BLOCK
            self.blocks[index] = self.sources.read(self.name, start, min(BLOCK, self.length - start))
        return self.blocks[index]

    def read(self, size: int = -1) -> bytes:
        stop = self.length if size is None or size < 0 else min(self.length, self.pos + size)
        out = bytearray()
        while self.pos < stop:
            block = self._block(self.pos // BLOCK)
            within = self.pos % BLOCK
            piece = block[within : within + stop - self.pos]
            out += piece
            self.pos += len(piece)
        return bytes(out)

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


class TorchFile:
    """A torch.save file of `Sources`: its pickled structure with `TensorRef`s in place of tensors, and where
    each storage's bytes lie, read from its zip directory and local headers (a few KB, never its tensors)."""

    def __init__(self, sources: Sources, name: str):
        self.sources, self.name = sources, name
        sources.open(name)
        raw = _RangeFile(sources, name)
        try:
            archive = zipfile.ZipFile(raw)
        except zipfile.BadZipFile as exc:
            raise LayoutMismatch(f"{sources.tag_dir / name}: not a torch.save zip file ({exc})") from exc
        infos = {i.filename: i for i in archive.infolist()}
        pickles = [n for n in infos if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise LayoutMismatch(f"{sources.tag_dir / name}: {len(pickles)} data.pkl records, expected one")
        prefix = pickles[0][: -len("data.pkl")]
        order = infos.get(prefix + "byteorder")
        if order is not None and archive.read(order).decode() != "little":
            raise LayoutMismatch(f"{sources.tag_dir / name}: saved big-endian")
        self.obj = _WithoutTensors(io.BytesIO(archive.read(pickles[0]))).load()
        self.records = {n[len(prefix) + 5 :]: i for n, i in infos.items() if n.startswith(prefix + "data/")}
        self.offsets: dict[str, int] = {}

    def data_offset(self, key: str) -> int:
        """Where storage `key`'s bytes start in the file: after its record's local header, read on first use
        (its extra field pads the data to torch's alignment, and only the header says how long it is)."""
        if key not in self.offsets:
            info = self.records[key]
            if info.compress_type != zipfile.ZIP_STORED:
                raise LayoutMismatch(f"{self.sources.tag_dir / self.name}: {info.filename} is compressed")
            head = 30 + len(info.filename.encode()) + 128
            header = self.sources.read(
                self.name, info.header_offset, min(head, self.sources.size(self.name) - info.header_offset)
            )
            if header[:4] != b"PK\x03\x04":
                raise LayoutMismatch(
                    f"{self.sources.tag_dir / self.name}: no local header for {info.filename}"
                )
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            self.offsets[key] = info.header_offset + 30 + name_len + extra_len
        return self.offsets[key]

    def byte_range(self, ref: TensorRef, start: int, count: int) -> tuple[int, int]:
        """(offset, length) in the file of elements [start, start + count) of the flattened tensor `ref`."""
        if start < 0 or start + count > ref.numel:
            raise LayoutMismatch(
                f"{self.sources.tag_dir / self.name}: elements [{start}, {start + count}) of a tensor of "
                f"{ref.numel}"
            )
        size = torch.empty((), dtype=ref.dtype).element_size()
        return self.data_offset(ref.key) + (ref.offset + start) * size, count * size

    def tensor(self, ref: TensorRef) -> torch.Tensor:
        """A small tensor of the file, read whole (a step count)."""
        offset, length = self.byte_range(ref, 0, ref.numel)
        data = bytearray(self.sources.read(self.name, offset, length))
        return torch.frombuffer(data, dtype=ref.dtype).reshape(ref.shape).clone()


_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}


class SafetensorsParts:
    """A safetensors file of `Sources` (a weight EMA share): its header read (two small reads), and slices of
    its tensors in byte ranges, never the rest of the file."""

    def __init__(self, sources: Sources, name: str):
        self.sources, self.name = sources, name
        (length,) = struct.unpack("<Q", sources.read(name, 0, 8))
        if not 2 <= length <= sources.size(name) - 8:
            raise LayoutMismatch(
                f"{sources.tag_dir / name}: not a safetensors file (header of {length} bytes)"
            )
        self.header = json.loads(sources.read(name, 8, length))
        self.base = 8 + length

    def metadata(self) -> dict:
        return self.header.get("__metadata__") or {}

    def slices(self, wanted: list[tuple[str, int, int]]) -> list[torch.Tensor]:
        """Elements [a, b) of each flattened tensor `name`, in the requests `runs` makes."""
        pieces = []
        for name, a, b in wanted:
            info = self.header[name]
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            size = torch.empty((), dtype=dtype).element_size()
            start, stop = info["data_offsets"]
            if not 0 <= a <= b <= (stop - start) // size:
                raise LayoutMismatch(f"{self.sources.tag_dir / self.name}: elements [{a}, {b}) of {name}")
            pieces.append(
                _Piece(self, self.base + start + a * size, (b - a) * size, torch.empty(b - a, dtype=dtype))
            )
        read_pieces(pieces)
        return [p.dst for p in pieces]

    def close(self) -> None:
        """Nothing held open: the reads went through `Sources`."""


@dataclass
class _Piece:
    file: TorchFile | SafetensorsParts
    offset: int
    length: int
    dst: torch.Tensor  # a 1-D view the bytes are copied into


def runs(ranges: list[tuple[str, int, int]]) -> list[tuple[str, int, int, list[int]]]:
    """The requests that read `ranges` (file, offset, length): a file's ranges sorted, each read with the one
    before it where the gap between them is under GAP bytes and a quarter of the range (a gap read is bytes
    wasted). Returns (file, start, stop, indices of the ranges it holds) per request."""
    out: list[tuple[str, int, int, list[int]]] = []
    by_file: dict[str, list[int]] = {}
    for i, (name, _, length) in enumerate(ranges):
        if length:
            by_file.setdefault(name, []).append(i)
    for name, members in by_file.items():
        members.sort(key=lambda i: ranges[i][1])
        start, stop, held = ranges[members[0]][1], sum(ranges[members[0]][1:]), [members[0]]
        for i in members[1:]:
            _, offset, length = ranges[i]
            if offset - stop <= min(GAP, length // 4):
                stop, held = max(stop, offset + length), held + [i]
            else:
                out.append((name, start, stop, held))
                start, stop, held = offset, offset + length, [i]
        out.append((name, start, stop, held))
    return out


def read_pieces(pieces: list[_Piece]) -> None:
    """Read every piece into its destination, in the requests `runs` makes, READERS at once."""
    files = {p.file.name: p.file for p in pieces}

    def one(run) -> None:
        name, start, stop, held = run
        data = bytearray(files[name].sources.read(name, start, stop - start))
        for i in held:
            piece = pieces[i]
            at = piece.offset - start
            piece.dst.copy_(torch.frombuffer(data, dtype=piece.dst.dtype, offset=at, count=piece.dst.numel()))

    requests = runs([(p.file.name, p.offset, p.length) for p in pieces])
    with ThreadPoolExecutor(max(1, min(READERS, len(requests)))) as pool:
        for future in [pool.submit(one, run) for run in requests]:
            future.result()


@dataclass(frozen=True)
class Span:
    """Elements [start, start + count) of saved rank `saved`'s flat tensor of (sub-)group `group`: elements
    [at, at + count) of this rank's part."""

    saved: int
    group: int
    start: int
    count: int
    at: int


def zero12_spans(group: int, old: int, new: int, saved: int, rank: int) -> list[Span]:
    """ZeRO-1/2: rank `rank` owns elements [rank x new, (rank + 1) x new) of the group's flat vector; saved rank
    i held [i x old, (i + 1) x old) (the end padding of `saved` slices of `old` holds nothing)."""
    lo, hi = rank * new, min((rank + 1) * new, saved * old)
    out = []
    for i in range(lo // old, (hi - 1) // old + 1) if hi > lo else ():
        a, b = max(lo, i * old), min(hi, (i + 1) * old)
        out.append(Span(i, group, a - i * old, b - a, a - lo))
    return out


def zero3_offsets(shapes: list[dict], saved: int) -> dict[str, tuple[int, int, int]]:
    """ZeRO-3 saved by `saved` ranks (`param_shapes`: one name -> shape dict per sub-group): each parameter's
    (sub-group, offset in every saved rank's flat tensor of it, numel)."""
    out = {}
    for g, group in enumerate(shapes):
        offset = 0
        for name, shape in group.items():
            numel = math.prod(shape)
            out[name] = (g, offset, numel)
            offset += -(-numel // saved)
    return out


def zero3_spans(group: int, offset: int, numel: int, saved: int, world: int, rank: int) -> list[Span]:
    """ZeRO-3: this rank's part of a parameter of `numel` elements (ceil(numel / world) from rank x that,
    zero-padded past the end) from the saved ranks' parts (ceil(numel / saved) each, at `offset` in their
    sub-group's flat tensor)."""
    old, new = -(-numel // saved), -(-numel // world)
    lo, hi = rank * new, min((rank + 1) * new, numel)
    out = []
    for i in range(lo // old, (hi - 1) // old + 1) if hi > lo else ():
        a, b = max(lo, i * old), min(hi, (i + 1) * old)
        out.append(Span(i, group, offset + a - i * old, b - a, a - lo))
    return out


def _materialized(obj, file: TorchFile):
    """`obj` with its small tensors read (a step count); a large one left in is a layout this module does
    not know."""
    if isinstance(obj, TensorRef):
        if obj.numel > 64:
            raise LayoutMismatch(f"{file.sources.tag_dir / file.name}: an unexpected tensor of {obj.shape}")
        return file.tensor(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _materialized(v, file)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_materialized(v, file) for v in obj)
    return obj


class _Plan:
    """What one rank reads of a tag saved by `saved` ranks, and the DeepSpeed hooks that hand it over."""

    def __init__(self, engine, sources: Sources, record: dict):
        self.engine, self.sources = engine, sources
        self.optimizer = engine.optimizer
        self.names = optim_files(record)
        self.saved = record["world_size"]
        if sorted(self.names) != list(range(self.saved)):
            raise LayoutMismatch(f"{sources.tag_dir.name}: optimizer files of ranks {sorted(self.names)}")
        group = self.optimizer.dp_process_group
        self.rank, self.world = dist.get_rank(group=group), dist.get_world_size(group=group)
        self.files: dict[int, TorchFile] = {}
        self.restore: list = []

    def stage(self, tag_dir: Path, record: dict) -> None:
        """The folder DeepSpeed's universal loader reads: the tag's model states (a link) and the optimizer's
        global state, written before any rank loads (a failure here is agreed on like a read's)."""
        self.folder = Path(tempfile.mkdtemp(prefix="vitpipe-reshard-")) / "ranged"
        (self.folder / "zero").mkdir(parents=True)
        states = model_states(record)
        os.symlink((tag_dir / states).resolve(), self.folder / states)
        torch.save(self.global_sd, self.folder / "zero" / "optimizer_state.pt")

    def close(self) -> None:
        if getattr(self, "folder", None) is not None:
            shutil.rmtree(self.folder.parent, ignore_errors=True)
            self.folder = None

    def file(self, rank: int) -> TorchFile:
        if rank not in self.files:
            self.files[rank] = TorchFile(self.sources, self.names[rank])
        return self.files[rank]

    def state(self, rank: int) -> dict:
        return self.file(rank).obj["optimizer_state_dict"]

    def where(self, rank: int, group: int, param: str = "") -> str:
        return f"{self.sources.tag_dir / self.names[rank]}: group {group}" + (
            f", parameter {param}" if param else ""
        )


class _Zero12(_Plan):
    """ZeRO-1/2 and the bf16 optimizer: rank r owns elements [r x P', (r + 1) x P') of each group's flat
    vector, which saved ranks [r x P' / P, ...] hold at offsets of their own slices of P elements."""

    def __init__(self, engine, sources: Sources, record: dict):
        super().__init__(engine, sources, record)
        opt = self.optimizer
        self.lp_groups = opt.bf16_groups if hasattr(opt, "bf16_groups") else opt.bit16_groups
        partitions = (
            opt.fp32_groups_flat_partition
            if hasattr(opt, "fp32_groups_flat_partition")
            else opt.single_partition_of_fp32_groups
        )
        first = self.state(0)
        self.buffers, self.steps, pieces = [], [], []
        for g, lp_group in enumerate(self.lp_groups):
            # a saved slice's length with padding: rank 0's (unpadded unless it is also the last, saved alone)
            old = first["single_partition_of_fp32_groups"][g].numel + first["group_paddings"][g]
            new = partitions[g].numel()
            buffers = {k: torch.zeros(new, dtype=torch.float32) for k in STATES}
            self.buffers.append(buffers)
            self.steps.append(first["base_optimizer_state"]["state"][g].get("step"))
            spans = self.check(g, lp_group, new, old)
            for span in zero12_spans(g, old, new, self.saved, self.rank):
                i = span.saved
                file, state = self.file(i), self.state(i)
                refs = {
                    "fp32": state["single_partition_of_fp32_groups"][g],
                    "exp_avg": state["base_optimizer_state"]["state"][g]["exp_avg"],
                    "exp_avg_sq": state["base_optimizer_state"]["state"][g]["exp_avg_sq"],
                }
                # DeepSpeed saves the fp32 slice without the group's end padding (the last rank's, where the
                # group does not divide; the moments keep it): the rest of the span is padding, left zero.
                real = refs["fp32"].numel
                padding = state["group_paddings"][g]
                if real + padding != old or (padding and i != self.saved - 1):
                    raise LayoutMismatch(
                        f"{self.where(i, g)}: a slice of {real} + {padding} padding, not {old}"
                    )
                if any(ref.numel not in (real, old) for ref in refs.values()):  # moments: padded or not
                    raise LayoutMismatch(f"{self.where(i, g)}: moments of {[r.numel for r in refs.values()]}")
                self.check_saved(i, g, old, spans)
                count = min(span.count, real - span.start)
                for key, ref in refs.items():
                    if count > 0:
                        offset, length = file.byte_range(ref, span.start, count)
                        pieces.append(_Piece(file, offset, length, buffers[key][span.at : span.at + count]))
        read_pieces(pieces)
        self.steps = [_materialized(s, self.file(0)) for s in self.steps]
        self.global_sd = self.global_state()

    def check(self, g: int, lp_group, new: int, old: int) -> dict[str, tuple[int, int]]:
        """Where each of this rank's parameters lies in the group's flat vector: (first element, numel)."""
        spans = {}
        for lp in lp_group:
            mapping = lp._hp_mapping
            if mapping is None:
                continue
            lp_start = mapping.lp_fragment_address.start
            hp_start = mapping.get_hp_fragment_address().start
            spans[self.optimizer.param_names[lp]] = (self.rank * new + hp_start - lp_start, lp.numel())
        return spans

    def check_saved(self, i: int, g: int, old: int, spans: dict[str, tuple[int, int]]) -> None:
        """Saved rank i's own record of what it held (DeepSpeed's param_slice_mappings) agrees with the
        flat layout this rank computed, for every parameter of this rank's that lies in its slice."""
        mappings = self.state(i).get("param_slice_mappings")
        if mappings is None:
            raise LayoutMismatch(f"{self.where(i, g)}: no param_slice_mappings")
        for name, (first, numel) in spans.items():
            a, b = max(first, i * old), min(first + numel, (i + 1) * old)
            if a >= b:
                continue
            got = mappings[g].get(name)
            if got is None or (got.start, got.numel) != (a - i * old, b - a):
                raise LayoutMismatch(
                    f"{self.where(i, g, name)}: holds {got}, the layout says elements "
                    f"[{a - i * old}, {b - i * old}) of its slice"
                )

    def after(self) -> None:
        """DeepSpeed's ZeRO-1/2 loader sets each group's own hyperparameters; the step counts are mended."""
        own_steps(self.optimizer.optimizer)

    def global_state(self) -> dict:
        first = self.state(0)
        sharded = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
        out = {k: v for k, v in first.items() if k not in sharded}
        out["param_groups"] = first["base_optimizer_state"]["param_groups"]
        return _materialized(out, self.file(0))

    def hook(self) -> None:
        plan = self

        def load_hp_checkpoint_state(param, folder, tp_rank, tp_world_size, ep_rank=0, ep_size=1):
            g, mapping = param._reshard_group, param._hp_mapping
            mapping.optim_fragment = {}
            start = mapping.get_hp_fragment_address().start
            numel = mapping.lp_fragment_address.numel
            for key in STATES:
                piece = plan.buffers[g][key][start : start + numel]
                if key == "fp32":
                    mapping.get_hp_fragment().data.copy_(piece)
                else:
                    mapping.optim_fragment[key] = piece.clone()
            step = plan.steps[g]
            return step.clone() if torch.is_tensor(step) else step

        for g, lp_group in enumerate(self.lp_groups):
            for lp in lp_group:
                if lp._hp_mapping is not None:
                    self.restore.append((lp, lp.__dict__.get("load_hp_checkpoint_state")))
                    lp._reshard_group = g
                    lp.load_hp_checkpoint_state = types.MethodType(load_hp_checkpoint_state, lp)

    def unhook(self) -> None:
        for lp, before in self.restore:
            del lp._reshard_group
            if before is None:
                del lp.load_hp_checkpoint_state
            else:
                lp.load_hp_checkpoint_state = before


class _Zero3(_Plan):
    """ZeRO-3: rank r owns elements [r x c', (r + 1) x c') of each parameter (c' = ceil(numel / W')), which
    saved ranks [r x c' / c, ...] hold at the parameter's offset in their sub-group's flat vector."""

    def __init__(self, engine, sources: Sources, record: dict):
        super().__init__(engine, sources, record)
        shapes = TorchFile(sources, ZERO3_STATES).obj["param_shapes"]
        saved = zero3_offsets(shapes, self.saved)
        totals = [sum(-(-math.prod(s) // self.saved) for s in group.values()) for group in shapes]
        groups = self.state(0)["optimizer_state_dict"]["param_groups"]
        if sorted(i for pg in groups for i in pg["params"]) != list(range(len(shapes))):
            raise LayoutMismatch(
                f"{self.where(0, 0)}: sub-groups {[pg['params'] for pg in groups]}, shapes of {len(shapes)}"
            )
        checked: set[int] = set()
        self.parts: dict[tuple[str, str], torch.Tensor] = {}
        pieces = []
        opt = self.optimizer
        for group in opt.fp16_groups:
            for param in group:
                name = opt.param_names[param]
                numel = param.ds_numel
                if name not in saved or saved[name][2] != numel:
                    raise LayoutMismatch(
                        f"{sources.tag_dir / ZERO3_STATES}: parameter {name} has "
                        f"{saved[name][2] if name in saved else 'no'} elements saved, {numel} in this model"
                    )
                g, offset, _ = saved[name]
                parts = {k: torch.zeros(-(-numel // self.world), dtype=torch.float32) for k in STATES}
                self.parts.update({(name, k): t for k, t in parts.items()})
                for span in zero3_spans(g, offset, numel, self.saved, self.world, self.rank):
                    file, state = self.file(span.saved), self.state(span.saved)
                    refs = {
                        "fp32": state["fp32_flat_groups"][g],
                        "exp_avg": state["optimizer_state_dict"]["state"][g]["exp_avg"],
                        "exp_avg_sq": state["optimizer_state_dict"]["state"][g]["exp_avg_sq"],
                    }
                    if (span.saved, g) not in checked:  # each saved rank's flat tensors: the shapes' parts
                        if any(ref.numel != totals[g] for ref in refs.values()):
                            raise LayoutMismatch(
                                f"{self.where(span.saved, g)}: flat tensors of {[r.numel for r in refs.values()]}"
                                f" elements, the parameter shapes make {totals[g]}"
                            )
                        checked.add((span.saved, g))
                    for key, ref in refs.items():
                        start, length = file.byte_range(ref, span.start, span.count)
                        pieces.append(_Piece(file, start, length, parts[key][span.at : span.at + span.count]))
        read_pieces(pieces)
        self.global_sd = self.global_state()

    def global_state(self) -> dict:
        first = self.state(0)
        inner = first["optimizer_state_dict"]
        out = {k: v for k, v in first.items() if k not in ("optimizer_state_dict", "fp32_flat_groups")}
        out["optimizer_state_dict"] = {
            "state": {0: {"step": inner["state"][0]["step"]}},
            "param_groups": inner["param_groups"],
        }
        out["param_groups"] = inner["param_groups"]
        return _materialized(out, self.file(0))

    def after(self) -> None:
        """DeepSpeed's ZeRO-3 universal loader gives every parameter group group 0's hyperparameters ("should
        be the same"), which drops the weight decay of a model whose first group is the no-decay one: each
        group's saved hyperparameters are put back, as a load on the same world size does, and each sub-group
        gets its own step count (`mend_zero3`)."""
        mend_zero3(self.optimizer.optimizer, self.global_sd["param_groups"])

    def hook(self) -> None:
        parts = self.parts

        def load_hp_checkpoint_state(optimizer, folder, key, param=None):
            return parts[(os.path.basename(folder), key)]

        self.optimizer.load_hp_checkpoint_state = types.MethodType(load_hp_checkpoint_state, self.optimizer)

    def unhook(self) -> None:
        del self.optimizer.load_hp_checkpoint_state


def plan(engine, tag_dir: Path, record: dict, store: Store | None) -> _Plan:
    """Read this rank's part of the optimizer states of the tag (saved by record["world_size"] ranks) for
    `engine` on this world size; the engine is not touched yet (`apply`). `LayoutMismatch` where the saved
    layout is not the one this module reads."""
    sources = Sources(tag_dir, record, store)
    try:
        planned = (_Zero3 if engine.zero_optimization_stage() == 3 else _Zero12)(engine, sources, record)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, pickle.UnpicklingError) as exc:
        # A structure other than the one read here (another DeepSpeed, elastic_checkpoint): not a broken tag.
        raise LayoutMismatch(
            f"{tag_dir}: the saved optimizer states are laid out otherwise ({exc!r})"
        ) from exc
    finally:
        sources.close()
    planned.stage(tag_dir, record)
    return planned


def apply(engine, plan: _Plan, load_optimizer: bool):
    """Load the planned fragments, the tag's model states and its optimizer's global state (loss scale, step,
    parameter groups) into `engine` through DeepSpeed's universal-checkpoint loader, from the folder `plan`
    staged. Returns its (load path, client state)."""
    config = engine._config  # DeepSpeed reads the flag at load time; the engine was built without it
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    plan.hook()
    try:
        loaded = engine.load_checkpoint(
            str(plan.folder.parent),
            tag=plan.folder.name,
            load_optimizer_states=load_optimizer,
            load_lr_scheduler_states=load_optimizer,
        )
        if load_optimizer:
            plan.after()
        return loaded
    finally:
        plan.unhook()
        config.load_universal_checkpoint = before


def own_steps(optimizer: torch.optim.Optimizer) -> None:
    """Each parameter's Adam step count its own tensor, where torch keeps it: DeepSpeed's universal loaders
    give one loaded tensor to several (ZeRO-3: every sub-group), which torch then increments in place once per
    sub-group a step, and leave it on the CPU, where a fused or capturable Adam wants it on the parameter's
    device (as torch's own load_state_dict puts it)."""
    on_device = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
    for param, state in optimizer.state.items():
        step = state.get("step")
        if torch.is_tensor(step):
            state["step"] = step.detach().clone().to(param.device if on_device else "cpu", torch.float32)


def mend_zero3(optimizer: torch.optim.Optimizer, saved_groups: list[dict]) -> None:
    """After DeepSpeed's ZeRO-3 universal load: each group's saved hyperparameters back (the loader gives
    every group the first's, no weight decay where the first is the no-decay group), and each sub-group its
    own step count (`own_steps`)."""
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    own_steps(optimizer)
