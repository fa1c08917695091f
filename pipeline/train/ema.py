"""Weight EMA (`optim.ema_decay`): an fp32 exponential moving average of the weights, as DeiT (timm's ModelEma)
and big_vision keep, evaluated beside the raw weights.

    ema <- decay * ema + (1 - decay) * weights        after every optimizer step, from the step-0 weights

Each rank keeps the EMA of its own share of the parameters only, beside the fp32 master weights it already
holds, so the EMA costs 4 bytes per parameter / world size on each rank, and its update no communication:

- ZeRO-1/2: the fragment of each parameter in this rank's optimizer partition (DeepSpeed's `_hp_mapping`);
- ZeRO-3: this rank's partition of each parameter (`ds_tensor`'s range; its fp32 master);
- ZeRO-0: every rank holds every weight; rank r keeps the r-th of world-size equal slices of the
  parameters laid end to end (the fp32 masters of DeepSpeed's bf16 wrapper, or the weights in fp32).

A share is a list of fragments (parameter name, [start, stop) of its flattened elements), so the state is
independent of how it was partitioned: a checkpoint holds one file per rank,

    TAG/ema_rank_R_fp32.safetensors    R's fragments (1-D fp32), their ranges in the header

and a rank resuming on another world size, or another ZeRO stage, reads the ranges of its new share from
whichever files hold them (safetensors slices: bytes in proportion to its own share). On the same world size
a rank reads its own file only: the file its own node saved. The export assembles the whole EMA on rank 0
(one reduce per parameter, as the raw weights' `safe_get_full_fp32_param` gathers them) into
export/model_ema.safetensors beside export/model.safetensors.

The update is one `torch._foreach_lerp_` over this rank's fragments: no host sync, no collective.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from data_prep import atomic
from pipeline.train.engine import _stage0_fp32_masters
from pipeline.train.tag import COMPLETE

log = logging.getLogger(__name__)

FILE = "ema_rank_{rank}_fp32.safetensors"  # `rank_R_` in the name: the checkpoint code's owner rule
GLOB = "ema_rank_*_fp32.safetensors"


@dataclass(frozen=True)
class Fragment:
    name: str  # the parameter's name in module.named_parameters()
    start: int  # [start, stop) of the parameter's flattened elements
    stop: int
    numel: int  # the whole parameter's


def ema_file(rank: int) -> str:
    return FILE.format(rank=rank)


class _LocalFile:
    """An EMA file on this node's disk: its header's metadata and slices of its tensors."""

    def __init__(self, path: Path):
        self.file = safe_open(str(path), framework="pt")

    def metadata(self) -> dict:
        return self.file.metadata() or {}

    def slices(self, wanted: list[tuple[str, int, int]]) -> list[torch.Tensor]:
        return [self.file.get_slice(name)[a:b] for name, a, b in wanted]

    def close(self) -> None:
        self.file = None


def reading_order(rank: int, world_size: int, saved_world: int) -> list[int]:
    """The saved ranks in the order a rank of `world_size` opens their files: those whose share lay where this
    rank's lies (saved ranks [rank x S / W, (rank + 1) x S / W) for S saved ranks), then outwards from there."""
    lo = rank * saved_world // world_size
    hi = max(lo + 1, -(-(rank + 1) * saved_world // world_size))
    return sorted(
        range(saved_world), key=lambda r: (0 if lo <= r < hi else min(abs(r - lo), abs(r - hi + 1)), r)
    )


def _per_parameter(ranges: dict, rank: int, saved_world: int) -> bool:
    """Whether a saved rank's ranges are ZeRO-3's partitions: part `rank` of S equal parts of each parameter."""
    return bool(ranges) and all(
        start == rank * -(-numel // saved_world) and stop == min(start + -(-numel // saved_world), numel)
        for start, stop, numel in ranges.values()
    )


def _zero3_owners(fragments: list[Fragment], saved_world: int) -> list[int]:
    """The saved ranks that held these fragments' elements under ZeRO-3's partitioning, most elements first."""
    counts: dict[int, int] = {}
    for f in fragments:
        size = -(-f.numel // saved_world)
        for k in range(f.start // size, (f.stop - 1) // size + 1):
            counts[k] = counts.get(k, 0) + min(f.stop, (k + 1) * size) - max(f.start, k * size)
    return sorted(counts, key=lambda k: -counts[k])


def local_masters(engine, rank: int, world_size: int) -> list[tuple[Fragment, torch.Tensor]]:
    """This rank's share of the trainable parameters: (fragment, a 1-D view of its fp32 master values) each,
    in named_parameters order. The views are the optimizer's own tensors, which it updates in place."""
    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    if any(hasattr(p, "ds_id") for _, p in params):
        return _zero3_masters(engine.optimizer, params)
    if any(hasattr(p, "_hp_mapping") for _, p in params):  # ZeRO-1/2 (and DeepSpeed's BF16_Optimizer)
        out = []
        for name, p in params:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:  # none of this parameter is in this rank's partition
                continue
            address = mapping.lp_fragment_address
            if address.numel:
                out.append(
                    (
                        Fragment(name, address.start, address.start + address.numel, p.numel()),
                        mapping.get_hp_fragment().view(-1),
                    )
                )
        return out
    masters = _stage0_fp32_masters(engine)  # empty in fp32: the module's weights are the masters
    views = {name: masters.get(id(p), p).detach().view(-1) for name, p in params}
    share = flat_share([(name, p.numel()) for name, p in params], rank, world_size)
    return [(f, views[f.name][f.start : f.stop]) for f in share]


def flat_share(sizes: list[tuple[str, int]], rank: int, world_size: int) -> list[Fragment]:
    """Rank `rank`'s 1/world_size slice of the parameters (name, numel) laid end to end (ZeRO-0's share)."""
    total = sum(n for _, n in sizes)
    lo, hi = rank * total // world_size, (rank + 1) * total // world_size
    out, offset = [], 0
    for name, numel in sizes:
        start, stop = max(lo, offset), min(hi, offset + numel)
        if start < stop:
            out.append(Fragment(name, start - offset, stop - offset, numel))
        offset += numel
    return out


def _zero3_masters(optimizer, params) -> list[tuple[Fragment, torch.Tensor]]:
    """ZeRO-3: each parameter is split into world-size partitions of `partition_numel` elements (the last one
    padded); this rank's fp32 master partition is a view into the optimizer's flat fp32 group."""
    out = []
    for name, p in params:
        size = p.partition_numel()
        start = size * optimizer._get_param_partition_rank(p)
        stop = min(start + size, p.ds_numel)
        if start >= stop:  # a small parameter's padding-only partition
            continue
        master, _ = optimizer._get_fp32_opt_state_partition(p, release_swap_buffers=False)
        out.append((Fragment(name, start, stop, p.ds_numel), master.view(-1)[: stop - start]))
    return out


class WeightEma:
    """This rank's part of the weight EMA: `fragments` of the parameters `params` (every trainable one, with its
    shape: the same list on every rank), each with a view of its master values, which `update` follows. Built
    from an engine with `of_engine` after its resume: it starts from the current weights; `load` then puts a
    checkpoint's EMA in its place."""

    def __init__(
        self,
        pairs: list[tuple[Fragment, torch.Tensor]],
        params: list[tuple[str, tuple[int, ...]]],
        decay: float,
        rank: int,
        world_size: int,
    ) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"optim.ema_decay must be in (0, 1), got {decay}")
        self.decay, self.rank, self.world_size, self.params = decay, rank, world_size, params
        self.fragments = [f for f, _ in pairs]
        self._masters = [m for _, m in pairs]
        self.ema = [m.detach().float().clone() for m in self._masters]
        self.last_load: dict = {}  # what the last `load` read: files opened, elements taken

    @classmethod
    def of_engine(cls, engine, decay: float, rank: int, world_size: int, group=None) -> WeightEma:
        """The EMA of this rank's share of a DeepSpeed engine's weights. Collective: the ranks check that their
        shares add up to the trainable elements, over `group` (a gloo group: the control group)."""
        params = [  # ZeRO-3 leaves an empty p.data; ds_shape is the real shape
            (n, tuple(getattr(p, "ds_shape", p.shape)))
            for n, p in engine.module.named_parameters()
            if p.requires_grad
        ]
        ema = cls(local_masters(engine, rank, world_size), params, decay, rank, world_size)
        ema._check_cover(sum(math.prod(s) for _, s in params), group)
        return ema

    def _check_cover(self, total: int, group) -> None:
        """The ranks' shares together hold as many elements as the trainable parameters (else the export would
        be wrong): one all-reduce of a single count, whatever the number of ranks."""
        owned = torch.tensor([sum(f.stop - f.start for f in self.fragments)], dtype=torch.int64)
        held = owned.clone()
        dist.all_reduce(held, group=group)
        if int(held) != total:
            raise RuntimeError(
                f"weight EMA: the ranks' shares hold {int(held)} elements in all (rank {self.rank}: {int(owned)}), "
                f"for {total} trainable elements"
            )

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: ema += (1 - decay) * (weights - ema), on the masters' device."""
        if self.ema:
            torch._foreach_lerp_(self.ema, self._masters, 1.0 - self.decay)

    @torch.no_grad()
    def reset(self) -> None:
        """Restart from the current weights (a checkpoint saved without an EMA)."""
        for ema, master in zip(self.ema, self._masters):
            ema.copy_(master)

    def save(self, tag_dir: Path) -> Path:
        """Write this rank's fragments into a checkpoint tag (atomically)."""
        return self.snapshot()(tag_dir)

    def snapshot(self) -> Callable[[Path], Path]:
        """A copy of this rank's fragments in host memory now, and the writer of that copy into a tag: an
        asynchronous save writes it later, while the optimizer steps (and this EMA moves) on."""
        tensors = {f.name: e.detach().to("cpu", copy=True) for f, e in zip(self.fragments, self.ema)}
        ranges = {f.name: [f.start, f.stop, f.numel] for f in self.fragments}
        header = {"ranges": json.dumps(ranges), "decay": repr(self.decay), "world_size": str(self.world_size)}
        name = ema_file(self.rank)

        def write(tag_dir: Path) -> Path:
            path = tag_dir / name
            with atomic.writing(path) as tmp:
                save_file(tensors, str(tmp), metadata=header)
            return path

        return write

    @torch.no_grad()
    def load(self, tag_dir: Path, open_file: Callable[[str], object] | None = None) -> bool:
        """Take the EMA a checkpoint tag holds for this rank's share; False when the tag has no EMA files (then
        this EMA is unchanged). Files are opened nearest first until the share is whole: on the same world size
        and partitioning, this rank's own file alone; on another, those whose shares lay where this one lies
        (`reading_order`: ZeRO-0 and ZeRO-1/2 cut the parameters, or each parameter group, end to end in rank
        order), or, once the first file shows ZeRO-3's layout (every parameter cut in S equal parts), the owners
        of this share's elements under it. Elements read: this rank's share, from a few files (bench/ema.py).
        `open_file(name)`: a file of the tag by another way than this node's disk (a resume on another number
        of ranks reads the slices it needs in byte ranges, `reshard.SafetensorsParts`); its list of files is
        then the tag's COMPLETE.json, not this disk's."""
        if open_file is None:
            names = [p.name for p in tag_dir.glob(GLOB)]

            def open_file(name: str):
                return _LocalFile(tag_dir / name)
        else:
            names = [n for n in json.loads((tag_dir / COMPLETE).read_text())["files"] if fnmatch(n, GLOB)]
        by_rank = {int(n.split("_")[2]): n for n in names}
        if not by_rank:
            return False
        # With the tag's whole list (every saved rank wrote one) the nearest file first, else the lowest here.
        first_rank = min(by_rank)
        if len(by_rank) == max(by_rank) + 1:
            first_rank = reading_order(self.rank, self.world_size, len(by_rank))[0]
        files = {first_rank: open_file(by_rank[first_rank])}  # its header says who saved the tag
        saved_world = int(files[first_rank].metadata().get("world_size", max(by_rank) + 1))
        by_name: dict[str, list[int]] = {}
        for i, frag in enumerate(self.fragments):
            by_name.setdefault(frag.name, []).append(i)
        missing = sum(f.stop - f.start for f in self.fragments)
        queue = deque(reading_order(self.rank, self.world_size, saved_world))
        opened: list[int] = []
        read = 0
        while queue and missing:
            k = queue.popleft()
            if k in opened or k not in by_rank:
                continue
            saved = files.pop(k, None) or open_file(by_rank[k])
            ranges = json.loads(saved.metadata().get("ranges", "{}"))
            wanted = []  # (fragment, name, [a, b) of the file's range of it, where in the fragment)
            for name, (start, stop, numel) in ranges.items():
                for i in by_name.get(name, ()):
                    frag = self.fragments[i]
                    if numel != frag.numel:
                        raise ValueError(
                            f"{tag_dir / by_rank[k]}: EMA of parameter {name!r} has {numel} elements, this "
                            f"model's {frag.numel}"
                        )
                    lo, hi = max(start, frag.start), min(stop, frag.stop)
                    if lo < hi:
                        wanted.append((i, name, lo - start, hi - start, lo - frag.start))
            pieces = saved.slices([(name, a, b) for _, name, a, b, _ in wanted])
            for (i, _, a, b, at), piece in zip(wanted, pieces):
                self.ema[i][at : at + b - a].copy_(piece)
                missing -= b - a
                read += b - a
            saved.close()
            if not opened and _per_parameter(ranges, k, saved_world):  # ZeRO-3's: the owners are known
                queue.extendleft(reversed(_zero3_owners(self.fragments, saved_world)))
            opened.append(k)
        for f in files.values():
            f.close()
        self.last_load = {"files_opened": len(opened), "elements_read": read, "saved_world": saved_world}
        if missing:
            raise RuntimeError(
                f"{tag_dir}: the EMA files of {saved_world} saved ranks ({len(by_rank)} here) lack {missing} "
                f"elements of rank {self.rank}'s share of the weights (saved on another world size, the "
                "checkpoint's every file must be on this node: a shared run_dir or checkpoint.uri)"
            )
        return True

    @torch.no_grad()
    def consolidated(self, device: torch.device) -> dict[str, torch.Tensor] | None:
        """The whole EMA in fp32 on rank 0's CPU (None elsewhere); every rank must call it. Each parameter is
        summed over the ranks from zeros and each rank's fragment: every element has one owner, so it is exact."""
        by_name: dict[str, list[int]] = {}
        for i, frag in enumerate(self.fragments):
            by_name.setdefault(frag.name, []).append(i)
        out: dict[str, torch.Tensor] = {}
        for name, shape in self.params:
            full = torch.zeros(math.prod(shape), dtype=torch.float32, device=device)
            for i in by_name.get(name, ()):
                frag = self.fragments[i]
                full[frag.start : frag.stop].copy_(self.ema[i])
            dist.reduce(full, dst=0)
            if self.rank == 0:
                out[name] = full.view(shape).cpu()
        return out if self.rank == 0 else None
