"""Which samples each loader slot reads, and how the training stream continues on another world size.

A slot is one DataLoader worker of one rank: slot r x W + w for rank r and worker w. A deal is the shape
a stage streams with: world size, workers per rank, micro-batch and grad_accum, from `base_step` on.
Under a deal every slot reads first its carry (the unread rest of epochs begun under an earlier deal),
then the deal's own epochs from `first_epoch` on, each of which deals every shard once over the slots
(`shards_for`; train_stream's epoch mode) and owes every slot the same quota of batches.

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
by design (a slot's tail past its quota) and, when the micro-batch changed, fewer than one batch at the
end of the carry. The deal (JSON-able, `to_dict`) goes into every checkpoint, so a later change
re-deals from it. Re-dealing needs the manifest's exact counts; a resampled stream has no epochs to
keep, and starts fresh draws keyed by the new base step.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace

from data_prep.layout import DatasetError
from pipeline.data import seeds
from pipeline.data.sources import DatasetInfo, epoch_batches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Piece:
    """Samples [skip, skip + take) of one slot-epoch's stream (its shards, shuffled by `shuffle_key`;
    sample i augmented from `augment_key` and i)."""

    urls: tuple[str, ...]
    shuffle_key: tuple[int, ...]
    augment_key: tuple[int, ...]
    epoch: int
    skip: int
    take: int


@dataclass(frozen=True)
class Deal:
    world_size: int
    workers: int
    batch_size: int
    grad_accum: int
    base_step: int = 0
    first_epoch: int = 0
    carry: tuple[tuple[Piece, ...], ...] = field(default=())  # per slot; () when there is none

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
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Deal:
        carry = tuple(
            tuple(
                Piece(
                    **{
                        **p,
                        "urls": tuple(p["urls"]),
                        "shuffle_key": tuple(p["shuffle_key"]),
                        "augment_key": tuple(p["augment_key"]),
                    }
                )
                for p in slot
            )
            for slot in d.get("carry", ())
        )
        return cls(**{**d, "carry": carry})


def batches_done_by_worker(rank_batches: int, worker: int, workers: int) -> int:
    """Of a rank's first `rank_batches` batches, how many came from `worker` (round-robin):
    ceil((rank_batches - worker) / workers), never negative."""
    return max(0, (rank_batches - worker + workers - 1) // workers)


def shards_for(
    info: DatasetInfo, seed: int, epoch: int, world_size: int, rank: int, worker: int, workers: int
) -> list[str]:
    """Epoch mode: the shards of slot (rank, worker) in `epoch` (every shard once over all slots)."""
    order = seeds.rng(seeds.ORDER, seed, epoch).permutation(len(info.urls))
    return [info.urls[i] for i in order[rank::world_size][worker::workers]]


def quota(info: DatasetInfo, deal: Deal) -> int | None:
    """Batches every slot yields per epoch of the deal (None without exact counts)."""
    per_rank = epoch_batches(info, deal.world_size, deal.batch_size, deal.workers)
    return None if per_rank is None else per_rank // deal.workers


def epoch_piece(info: DatasetInfo, seed: int, deal: Deal, epoch: int, rank: int, worker: int) -> Piece:
    """The whole of slot (rank, worker)'s `epoch` under `deal`: its quota of batches."""
    urls = shards_for(info, seed, epoch, deal.world_size, rank, worker, deal.workers)
    q = quota(info, deal)
    return Piece(
        tuple(urls),
        (seeds.SHUFFLE, seed, epoch, rank, worker),
        (seeds.AUGMENT, seed, epoch, rank, worker),
        epoch,
        0,
        (q or 0) * deal.batch_size,
    )


@dataclass(frozen=True)
class Position:
    """Where a slot stands after `done` batches under its deal: the rest of its carry, else an epoch of
    the deal and the batches of it made."""

    carry: tuple[Piece, ...]
    epoch: int
    within: int


def position(deal: Deal, info: DatasetInfo, slot: int, done: int) -> Position:
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
    q = quota(info, deal)
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
    fresh = Deal(world, workers, batch, accum, base_step=step)
    if resampled:
        return fresh
    if info.shard_counts is None:
        raise DatasetError(
            f"{info.urls[0]}...: the stream was dealt over {deal.world_size} ranks x {deal.workers} workers "
            f"(micro-batch {deal.batch_size}, grad_accum {deal.grad_accum}) and resumes over {world} x "
            f"{workers} ({batch}, {accum}); continuing its epoch on another shape needs the dataset's exact "
            "per-shard counts (a manifest.json)"
        )
    rank_batches = deal.rank_batches(step)
    positions = []
    for slot in range(deal.slots):
        worker = slot % deal.workers
        positions.append(
            position(deal, info, slot, batches_done_by_worker(rank_batches, worker, deal.workers))
        )
    begun = [p.epoch if p.within else p.epoch - 1 for p in positions if not p.carry]
    frontier = max(begun, default=deal.first_epoch - 1)
    rest: list[Piece] = []
    for slot, pos in enumerate(positions):
        rank, worker = divmod(slot, deal.workers)
        rest.extend(pos.carry)
        for epoch in range(pos.epoch, frontier + 1):
            piece = epoch_piece(info, seed, deal, epoch, rank, worker)
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
    for s in range(slots):
        rank, worker = divmod(s, workers)
        need = (batches // slots + (1 if worker * world + rank < batches % slots else 0)) * batch
        run: list[Piece] = []
        while need:
            p = queue[0]
            n = min(need, p.take)
            run.append(replace(p, take=n))
            need -= n
            if n == p.take:
                queue.pop(0)
            else:
                queue[0] = replace(p, skip=p.skip + n, take=p.take - n)
        out.append(tuple(run))
    return tuple(out)
