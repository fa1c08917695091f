"""Checkpoint tags to and from a bucket (`checkpoint.uri`: s3://, gs://, ...).

Saving uploads each rank's files beside training (`pipeline.train.saving`). At a resume, rank 0 lists the
tags the bucket holds complete (`remote_tags`), and where a node's copy of the chosen tag is missing or
broken its first local rank downloads what the node's ranks read whole (`fetch`, `tag.files_read`), several
at once: at the world size that saved it their own files and the model states; at another, the model
states and rank 0's state (the ranks read their parts of the rest in ranges, `reshard`), or the whole tag
where DeepSpeed's universal conversion must run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch.distributed as dist

from data_prep import atomic
from data_prep.storage import Store
from data_prep.tario import file_sha256
from pipeline.train.tag import COMPLETE, files_read

log = logging.getLogger(__name__)

DOWNLOADS = 8  # files of a tag fetched at once by a node


def fetch(
    store: Store, tag_dir: Path, ranks: list[int], world_size: int, whole: bool = False
) -> tuple[int, int]:
    """Download from `store` what this node's `ranks` read whole of the tag (`files_read`; `whole`: every
    file), several files at once, leaving the files already here that match COMPLETE.json; COMPLETE.json
    last (a fetch cut short is a tag without it, or one whose files do not match it). Returns (bytes
    fetched, bytes of the tag)."""
    tag = tag_dir.name
    record = json.loads(store.read_text(f"{tag}/{COMPLETE}"))
    files = record["files"]
    wanted = files_read(record, ranks, world_size, whole)
    (tag_dir / COMPLETE).unlink(missing_ok=True)

    def held(name: str) -> bool:
        path = tag_dir / name
        return (
            path.is_file()
            and path.stat().st_size == files[name]["bytes"]
            and file_sha256(path) == files[name]["sha256"]
        )

    missing = [n for n in wanted if not held(n)]
    store.download_files(tag, missing, tag_dir, workers=DOWNLOADS)
    atomic.write_text(tag_dir / COMPLETE, json.dumps(record, indent=1), shared=True)  # every node on the disk
    return sum(files[n]["bytes"] for n in missing), sum(f["bytes"] for f in files.values())


def fetch_for_node(
    store: Store,
    tag_dir: Path,
    rank: int,
    local_rank: int,
    world_size: int,
    problem: str | None,
    group,
    whole: bool = False,
) -> None:
    """Every rank: the stored copy of the tag onto every node where some rank found a `problem` with its part
    (its first local rank fetches what the node's ranks read, `fetch`; `whole`: every file), then a barrier.
    A node's ranks are numbered from its first local rank's: after a restart a node may hold ranks whose
    files another node wrote."""
    node = rank - local_rank
    seen: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, (node, rank, problem), group=group)
    if local_rank == 0 and any(p for n, _, p in seen if n == node):
        fetch_or_log(store, tag_dir, rank, [r for n, r, _ in seen if n == node], world_size, whole)
    dist.barrier(group=group)


def fetch_or_log(
    store: Store, tag_dir: Path, rank: int, ranks: list[int], world_size: int, whole: bool = False
) -> bool:
    """`fetch`, and whether it worked. A fetch that fails (an object gone from the bucket, a full disk) is
    logged, not raised: the other ranks wait at the barrier after it, and the checks that follow find the tag
    incomplete on this node, so every rank agrees to try an older one."""
    try:
        fetched, size = fetch(store, tag_dir, ranks, world_size, whole)
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
        log.warning(
            "rank %d: could not fetch checkpoint %s from %s: %s", rank, tag_dir, store.describe(), why
        )
        return False
    log.info(
        "rank %d: fetched checkpoint %s from %s for this node's ranks: %d of its %d bytes",
        rank,
        tag_dir.name,
        store.describe(),
        fetched,
        size,
    )
    return True


def remote_tags(store: Store | None, rank: int, group, broadcast: bool = True) -> list[str]:
    """Tags on the store that have COMPLETE.json, listed by rank 0 and broadcast (one listing, one view)."""
    if store is None:
        return []
    box = [
        sorted(t for t in store.list_dirs() if t.startswith("step_") and store.exists(f"{t}/{COMPLETE}"))
        if rank == 0
        else None
    ]
    if not broadcast:
        return box[0]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
