"""Seeded random streams of the loader: every draw comes from a generator keyed by integers.

Every random stream is seeded by a list of integers, never by a hash (hashes differ between
processes). numpy pads short seeds with zeros, so [seed, e] (shard order) and [seed, e, 0, 0]
(the shuffle of rank 0 worker 0) would be one stream: each purpose but the shuffle (kept as it
was) gets its own spawn key. Key lengths are fixed per purpose, so no two streams coincide.

    rng(ORDER, seed, epoch)                         # the epoch's shard order
    rng(SHUFFLE, seed, epoch, rank, worker)          # a worker's shuffle buffer in that epoch
    sample_rngs(AUGMENT, seed, epoch, rank, worker)(i)   # sample i's augmentation in that epoch
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# Purposes; the keys each takes: SHUFFLE/AUGMENT (seed, epoch, rank, worker), ORDER (seed, epoch),
# DRAW (seed, rank, worker), ROUND_SHUFFLE/ROUND_AUGMENT (seed, rank, worker, round).
SHUFFLE, ORDER, AUGMENT, DRAW, ROUND_SHUFFLE, ROUND_AUGMENT = range(6)


def seed_sequence(purpose: int, *key: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([int(k) for k in key], spawn_key=(purpose,) if purpose != SHUFFLE else ())


def rng(purpose: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(seed_sequence(purpose, *key))


def sample_rngs(purpose: int, *key: int) -> Callable[[int], np.random.Generator]:
    """Sample i's generator within one round: Philox keyed by (purpose, key) from counter block i,
    so any sample's draws come without replaying the others' (resume skips undecoded samples),
    at half the cost of a SeedSequence per sample."""
    philox_key = seed_sequence(purpose, *key).generate_state(2, np.uint64)
    return lambda i: np.random.Generator(np.random.Philox(key=philox_key, counter=[0, 0, 0, i]))
