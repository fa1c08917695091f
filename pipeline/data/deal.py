"""Which samples each loader slot reads, and how the training stream continues on another world size.

A slot is one DataLoader worker of one rank: slot r x W + w for rank r and worker w. A deal is the shape
a stage streams with: world size, workers per rank, micro-batch and grad_accum, from `base_step` on.
Under a deal every slot reads first its carry (the unread rest of epochs begun under an earlier deal),
then the deal's own epochs from `first_epoch` on. An epoch (`slot_range`) lays the split's shards end to
end in an order drawn from (seed, epoch) and cuts that sequence of samples into runs of whole batches,
rank after rank, worker after worker: every rank the same number of batches (`rank_quota`: samples //
(ranks x micro-batch)), its workers within one of each other (`worker_quota`), and fewer than ranks x
micro-batch samples at the end left for no one. So an epoch reads every sample once but fewer than one
global batch, whatever the shards' sizes; a slot reads whole shards but at its two ends, where it passes
over the samples of the slot before it. Checkpoints of before this layout dealt whole shards, each slot
its share of the order and every slot the quota of the worst such share (`epochs: "shards"`,
`sources.epoch_batches`): such a stream goes on as it was, and its pieces keep their layout when re-dealt.

A stage starts on the initial deal (base step 0, no carry): the stream as it always was, and a resume on
the same shape continues it bitwise. A resume on another shape (a node lost or added, other workers or
grad_accum) re-deals (`continue_deal`):
1. each old slot's position follows from the step (the DataLoader takes batches from its workers
   round-robin, `batches_done_by_worker`);
2. the frontier is the newest epoch any old slot had begun; each old slot's unread rest up to and
   including the frontier (its carry's rest, the rest of its current epoch's quota, whole later epochs
   up to the frontier) is a list of pieces: samples [skip, skip + take) of one slot-epoch's shuffled
   stream, the very samples, shuffle order and augmentation the old deal would have given them;
3. the old slots' pieces, in slot order, are cut into equal whole batches over the new slots: the new
   deal's carry. Its epochs begin after the frontier.
So within every epoch no sample is read twice and none is left out, beyond what every epoch leaves out
by design (fewer than ranks x micro-batch samples) and, when the micro-batch changed, fewer than one batch
at the end of the carry. The deal (`to_dict`: JSON, its pieces one compressed table of integers that name their
slot-epochs, never shards or URLs: kilobytes at 100k shards) goes into every checkpoint once, so a later
change re-deals from it. A re-deal costs O(1) per old slot (and, for a stream in the old layout, one sort of the
shard counts); a rank lists the shards of its own pieces only, from the epoch's permutation and its
running sample counts (computed once per epoch and process, `slot_range`). Re-dealing needs the manifest's exact counts; a resampled stream has no epochs to
keep, and starts fresh draws keyed by the new base step.
"""

from __future__ import annotations

import base64
import functools
import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from data_prep.layout import DatasetError
from pipeline.data import seeds
from pipeline.data.sources import DatasetInfo, epoch_batches

log = logging.getLogger(__name__)
SAMPLES, SHARDS = "samples", "shards"  # how a deal's epochs are laid out (the module docstring)


@dataclass(frozen=True)
class Piece:
    """Samples [skip, skip + take) of one slot-epoch's stream: slot (rank, worker) of `epoch` in a deal over
    world_size x workers slots keyed by `seed` (its samples `extent`, shuffled by `shuffle_key`; sample i
    augmented from `augment_key` and i). `batch`: the deal's micro-batch, whose runs of batches the epoch
    was cut into (`slot_range`); 0 for an epoch dealt in whole shards (`slot_shards`, the old layout). A
    piece names its slot-epoch rather than listing its shards, so a deal's record is O(pieces) whatever the
    dataset, and a rank finds the shards of its own pieces only."""

    seed: int
    epoch: int
    world_size: int
    workers: int
    rank: int
    worker: int
    skip: int
    take: int
    batch: int = 0
    # Explicit shard indices: a piece read from a checkpoint whose deal listed URLs (`Deal.from_dict`).
    shards: tuple[int, ...] | None = None

    @property
    def shuffle_key(self) -> tuple[int, ...]:
        return (seeds.SHUFFLE, self.seed, self.epoch, self.rank, self.worker)

    @property
    def augment_key(self) -> tuple[int, ...]:
        return (seeds.AUGMENT, self.seed, self.epoch, self.rank, self.worker)

    def extent(self, info: DatasetInfo) -> tuple[list[int], int, int | None]:
        """The slot-epoch's samples in `info`'s dataset: (shard indices, samples of the first passed over,
        samples in all; None: every sample of those shards)."""
        if self.shards is not None:
            return list(self.shards), 0, None
        if self.batch:
            return slot_range(
                info.shard_counts,
                self.seed,
                self.epoch,
                self.world_size,
                self.workers,
                self.rank,
                self.worker,
                self.batch,
            )
        slot = slot_shards(
            len(info.urls), self.seed, self.epoch, self.world_size, self.rank, self.worker, self.workers
        )
        return slot, 0, None


# A piece as one row of the record's table (`Deal.to_dict`); format 1 had no batch (whole-shard epochs).
_COLUMNS = ("seed", "epoch", "world_size", "workers", "rank", "worker", "skip", "take", "batch")
_FORMAT = "slot-epochs/2"
_FORMATS = {"slot-epochs/1": _COLUMNS[:-1], _FORMAT: _COLUMNS}


def _pack(a: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(np.ascontiguousarray(a, "<i8").tobytes(), 6)).decode("ascii")


def _unpack(s: str, columns: int = 1) -> np.ndarray:
    return np.frombuffer(zlib.decompress(base64.b64decode(s)), "<i8").reshape(-1, columns)


@dataclass(frozen=True)
class Deal:
    world_size: int
    workers: int
    batch_size: int
    grad_accum: int
    base_step: int = 0
    first_epoch: int = 0
    carry: tuple[tuple[Piece, ...], ...] = field(default=())  # per slot; () when there is none
    epochs: str = SAMPLES  # its own epochs' layout; SHARDS: a stream begun before sample-exact epochs

    @property
    def slots(self) -> int:
        return self.world_size * self.workers

    def shape(self) -> tuple[int, int, int, int]:
        return (self.world_size, self.workers, self.batch_size, self.grad_accum)

    def carried(self, slot: int) -> tuple[Piece, ...]:
        return self.carry[slot] if self.carry else ()

    def carry_batches(self, slot: int) -> int:
        return sum(p.take for p in self.carried(slot)) // self.batch_size

    def rank_batches(self, step: int) -> int:
        """Batches each rank has made under this deal by `step`."""
        return (step - self.base_step) * self.grad_accum

    def to_dict(self) -> dict:
        """The deal as a JSON-able record, the same whatever the dataset's size: the carry's pieces as one
        compressed table of integers (`_COLUMNS`, one row per piece) and each slot's number of pieces."""
        record = {
            "world_size": self.world_size,
            "workers": self.workers,
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "base_step": self.base_step,
            "first_epoch": self.first_epoch,
            "epochs": self.epochs,
        }
        if self.carry:
            pieces = [p for slot in self.carry for p in slot]
            table = np.array([[getattr(p, c) for c in _COLUMNS] for p in pieces], dtype=np.int64)
            record["carry"] = {
                "format": _FORMAT,
                "columns": list(_COLUMNS),
                "pieces": _pack(table.reshape(-1, len(_COLUMNS))),
                "per_slot": _pack(np.array([len(slot) for slot in self.carry], dtype=np.int64)),
                "shards": {str(i): list(p.shards) for i, p in enumerate(pieces) if p.shards is not None},
            }
        return record

    @classmethod
    def from_dict(cls, d: dict, shard_urls: list[str] | None = None) -> Deal:
        """The deal `to_dict` wrote. A record of before pieces named their slot-epoch lists each piece's
        shard URLs: `shard_urls` (the dataset's, in order) turns them into indices; a URL it lacks is an
        error naming it. A record without `epochs` is of a stream dealt in whole shards, and goes on so."""
        carry = d.get("carry") or ()
        if isinstance(carry, dict):
            carry = _carry_from_table(carry)
        elif carry:
            carry = _carry_from_urls(carry, shard_urls)
        return cls(**{**d, "carry": carry, "epochs": d.get("epochs", SHARDS)})


def _carry_from_table(record: dict) -> tuple[tuple[Piece, ...], ...]:
    columns = _FORMATS.get(record.get("format"))
    if columns is None or tuple(record.get("columns", ())) != columns:
        raise DatasetError(
            f"the checkpoint's data position is in format {record.get('format')!r} with columns "
            f"{record.get('columns')}; this version reads {', '.join(map(repr, _FORMATS))} with "
            f"{list(_COLUMNS)}: resume with the version of the project that saved it"
        )
    table = _unpack(record["pieces"], len(columns))
    explicit = {int(i): tuple(s) for i, s in record.get("shards", {}).items()}
    pieces = [Piece(*(int(v) for v in row), shards=explicit.get(i)) for i, row in enumerate(table.tolist())]
    ends = np.cumsum(_unpack(record["per_slot"])[:, 0]).tolist()
    return tuple(tuple(pieces[a:b]) for a, b in zip([0, *ends[:-1]], ends))


def _carry_from_urls(carry: list, shard_urls: list[str] | None) -> tuple[tuple[Piece, ...], ...]:
    """A carry saved as lists of pieces with their shard URLs and keys (the first format): each piece's
    slot-epoch comes from its shuffle key (SHUFFLE, seed, epoch, rank, worker), its shards from its URLs."""
    if shard_urls is None:
        raise ValueError("this deal lists its pieces' shard URLs: pass the dataset's shard_urls to read it")
    index = {u: i for i, u in enumerate(shard_urls)}

    def piece(p: dict) -> Piece:
        missing = [u for u in p["urls"] if u not in index]
        if missing:
            raise DatasetError(
                f"the checkpoint's data position names shard {missing[0]} (and {len(missing) - 1} more), which "
                f"the dataset ({shard_urls[0]}... {len(shard_urls)} shards) does not list: resume with the "
                "dataset the checkpoint was saved with"
            )
        _, seed, epoch, rank, worker = p["shuffle_key"]
        shards = tuple(index[u] for u in p["urls"])
        return Piece(seed, epoch, 0, 0, rank, worker, p["skip"], p["take"], shards=shards)

    return tuple(tuple(piece(p) for p in slot) for slot in carry)


def batches_done_by_worker(rank_batches: int, worker: int, workers: int) -> int:
    """Of a rank's first `rank_batches` batches, how many came from `worker` (round-robin):
    ceil((rank_batches - worker) / workers), never negative."""
    return max(0, (rank_batches - worker + workers - 1) // workers)


@functools.lru_cache(maxsize=4)
def _order(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's shard order (a permutation): computed once per epoch in a process, whichever slots ask."""
    order = seeds.rng(seeds.ORDER, seed, epoch).permutation(num_shards)
    order.flags.writeable = False
    return order


def slot_shards(
    num_shards: int, seed: int, epoch: int, world_size: int, rank: int, worker: int, workers: int
) -> list[int]:
    """Epoch mode: the shard indices of slot (rank, worker) in `epoch` (every shard once over all slots)."""
    return _order(num_shards, seed, epoch)[rank::world_size][worker::workers].tolist()


def rank_quota(counts: Sequence[int], world_size: int, batch: int) -> int:
    """Batches each rank yields per epoch dealt in runs of samples: floor(samples / (ranks x batch))."""
    return sum(counts) // (world_size * batch)


def worker_quota(per_rank: int, worker: int, workers: int) -> int:
    """Of a rank's `per_rank` batches per epoch, those of `worker`: the first workers one more."""
    return per_rank // workers + (1 if worker < per_rank % workers else 0)


@functools.lru_cache(maxsize=4)
def _ends(counts: tuple[int, ...], seed: int, epoch: int) -> np.ndarray:
    """The running sample count at the end of each shard of the epoch's order: once per epoch and process."""
    ends = np.cumsum(np.asarray(counts, dtype=np.int64)[_order(len(counts), seed, epoch)])
    ends.flags.writeable = False
    return ends


def slot_range(
    counts: Sequence[int],
    seed: int,
    epoch: int,
    world_size: int,
    workers: int,
    rank: int,
    worker: int,
    batch: int,
) -> tuple[list[int], int, int]:
    """Slot (rank, worker)'s samples of `epoch` (the module docstring): (the shard indices its run covers,
    in the epoch's order; samples of the first of them that belong to the slot before it; samples in the
    run, a whole number of batches)."""
    per_rank = rank_quota(counts, world_size, batch)
    n = worker_quota(per_rank, worker, workers) * batch
    if n == 0:
        return [], 0, 0
    start = batch * (rank * per_rank + worker * (per_rank // workers) + min(worker, per_rank % workers))
    ends = _ends(tuple(counts), seed, epoch)
    first = int(np.searchsorted(ends, start, side="right"))  # the shard that holds sample `start`
    last = int(np.searchsorted(ends, start + n, side="left"))  # ... and sample start + n - 1
    order = _order(len(counts), seed, epoch)
    passed = start - int(ends[first]) + counts[int(order[first])]
    return order[first : last + 1].tolist(), passed, n


def deal_quota(info: DatasetInfo, deal: Deal) -> int | None:
    """Batches every rank yields per epoch of the deal (None without exact counts)."""
    if info.shard_counts is None:
        return None
    if deal.epochs == SAMPLES:
        return rank_quota(info.shard_counts, deal.world_size, deal.batch_size)
    return epoch_batches(info, deal.world_size, deal.batch_size, deal.workers)


def slot_quota(deal: Deal, per_rank: int | None, worker: int) -> int | None:
    """Batches worker `worker` of every rank yields per epoch of the deal (None without counts)."""
    if per_rank is None:
        return None
    return (
        worker_quota(per_rank, worker, deal.workers) if deal.epochs == SAMPLES else per_rank // deal.workers
    )


def epoch_piece(seed: int, deal: Deal, epoch: int, rank: int, worker: int, q: int | None) -> Piece:
    """The whole of slot (rank, worker)'s `epoch` under `deal`: its quota `q` of batches."""
    batch = deal.batch_size if deal.epochs == SAMPLES else 0
    return Piece(
        seed, epoch, deal.world_size, deal.workers, rank, worker, 0, (q or 0) * deal.batch_size, batch
    )


@dataclass(frozen=True)
class Position:
    """Where a slot stands after `done` batches under its deal: the rest of its carry, else an epoch of
    the deal and the batches of it made."""

    carry: tuple[Piece, ...]
    epoch: int
    within: int


def position(deal: Deal, slot: int, done: int, q: int | None) -> Position:
    """`q`: the slot's quota (`slot_quota`), None for an uncounted stream."""
    carried = deal.carried(slot)
    in_carry = deal.carry_batches(slot)
    if done < in_carry:
        offset = done * deal.batch_size
        for i, p in enumerate(carried):
            if offset < p.take:
                head = replace(p, skip=p.skip + offset, take=p.take - offset)
                return Position((head, *carried[i + 1 :]), deal.first_epoch, 0)
            offset -= p.take
        raise AssertionError("unreachable: the carry holds more than `done` batches")
    if q is None:  # uncounted: epochs flow into one another; the stream skips samples instead
        return Position((), deal.first_epoch, done - in_carry)
    k = done - in_carry
    return Position((), deal.first_epoch + k // q, k % q)


def continue_deal(
    deal: Deal,
    step: int,
    shape: tuple[int, int, int, int],
    info: DatasetInfo,
    seed: int,
    resampled: bool = False,
) -> Deal:
    """The deal to stream on from `step` with `shape` (world size, workers, micro-batch, grad_accum):
    `deal` itself when the shape is the same, else a re-deal (the module docstring)."""
    world, workers, batch, accum = shape
    workers = max(1, workers)
    shape = (world, workers, batch, accum)
    if deal.shape() == shape:
        return deal
    fresh = Deal(world, workers, batch, accum, base_step=step)  # its own epochs in runs of samples
    if resampled:
        return fresh
    if info.shard_counts is None:
        raise DatasetError(
            f"{info.urls[0]}...: the stream was dealt over {deal.world_size} ranks x {deal.workers} workers "
            f"(micro-batch {deal.batch_size}, grad_accum {deal.grad_accum}) and resumes over {world} x "
            f"{workers} ({batch}, {accum}); continuing its epoch on another shape needs the dataset's exact "
            "per-shard counts (a manifest.json)"
        )
    # The quota once (a sum of the counts; a sort for the old layout), then O(1) per old slot and piece:
    # no slot's shards are listed.
    rank_batches, per_rank = deal.rank_batches(step), deal_quota(info, deal)
    quotas = [slot_quota(deal, per_rank, w) for w in range(deal.workers)]
    positions = [
        position(
            deal,
            slot,
            batches_done_by_worker(rank_batches, slot % deal.workers, deal.workers),
            quotas[slot % deal.workers],
        )
        for slot in range(deal.slots)
    ]
    begun = [p.epoch if p.within else p.epoch - 1 for p in positions if not p.carry]
    frontier = max(begun, default=deal.first_epoch - 1)
    rest: list[Piece] = []
    for slot, pos in enumerate(positions):
        rank, worker = divmod(slot, deal.workers)
        rest.extend(pos.carry)
        for epoch in range(pos.epoch, frontier + 1):
            piece = epoch_piece(seed, deal, epoch, rank, worker, quotas[worker])
            if epoch == pos.epoch and pos.within:
                done = pos.within * deal.batch_size
                piece = replace(piece, skip=done, take=piece.take - done)
            rest.append(piece)
    carry = _split(rest, world, workers, batch)
    log.info(
        "the stream re-deals at step %d: %d ranks x %d workers -> %d x %d; %d samples of epochs up to %d "
        "carried over, then epoch %d",
        step,
        deal.world_size,
        deal.workers,
        world,
        workers,
        sum(p.take for p in rest),
        frontier,
        frontier + 1,
    )
    return replace(fresh, first_epoch=frontier + 1, carry=carry)


def _split(pieces: list[Piece], world: int, workers: int, batch: int) -> tuple[tuple[Piece, ...], ...]:
    """Cut `pieces` (in order) into one run of equal whole batches per slot; where they do not divide, one
    more for the first workers of every rank before the next workers (so ranks differ by one batch at
    most); the last fewer than a batch of samples are left out, with a warning."""
    slots = world * workers
    total = sum(p.take for p in pieces)
    batches = total // batch
    if total % batch:
        log.warning(
            "re-deal: %d carried samples do not fill a batch of %d and are left out", total % batch, batch
        )
    out: list[tuple[Piece, ...]] = []
    queue = [p for p in pieces if p.take > 0]
    head = 0  # queue[head] is the next piece to cut from
    for s in range(slots):
        rank, worker = divmod(s, workers)
        need = (batches // slots + (1 if worker * world + rank < batches % slots else 0)) * batch
        run: list[Piece] = []
        while need:
            p = queue[head]
            n = min(need, p.take)
            run.append(replace(p, take=n))
            need -= n
            if n == p.take:
                head += 1
            else:
                queue[head] = replace(p, skip=p.skip + n, take=p.take - n)
        out.append(tuple(run))
    return tuple(out)
