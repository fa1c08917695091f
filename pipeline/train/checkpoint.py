"""Resuming from the newest complete checkpoint, on as many ranks as saved it or on another number.

What a tag holds: `pipeline.train.tag`. Saving (every rank, the files written and uploaded beside training):
`pipeline.train.saving`. Downloads from the bucket: `pipeline.train.transfer`.

Resume walks the tags newest first and takes the first one that is complete and whose files match
COMPLETE.json; a newest checkpoint cut short or corrupted is skipped with a warning. All ranks walk one
list (the union of every node's local tags and the stored ones, gathered before the walk: nodes without
a shared disk hold different sets) and agree on each tag through an all-reduce, so no rank loads a
different step than another.

Nodes need not share a disk: each node's first local rank removes a leftover of an interrupted save,
writes COMPLETE.json and `latest` on its own disk (where rank 0's copy is not), and prunes its disk to
`keep_last` tags once the new tag is complete everywhere. A rank checks only the files it reads (its own
shard and state, and the model states), so a tag is loadable on a node that holds its ranks' part of it;
ZeRO 0-2 read rank 0's model states on every rank, which only a shared disk or `checkpoint.uri` provides.

With a remote store (`checkpoint.uri`: s3://, gs://, ...), each rank uploads the files it wrote, and
rank 0 uploads COMPLETE.json and then `latest` once every rank has: a remote tag without
COMPLETE.json is a save cut short. Resume takes remote tags into the same walk: where a node's copy
is missing or broken, its first local rank fetches what the node's ranks read (`transfer.fetch`: at the world size
that saved it, their own files and the model states, several at once; at another, the whole tag), so a
run resumes on machines that never saw its earlier steps.

Another number of ranks than saved a tag (a node lost, more bought, an elastic stage) loads it resharded:
each rank reads its own part of the saved ZeRO partitions in byte ranges, from its node's disk or the
bucket (`pipeline.train.reshard`); a node fetches whole only the model states and rank 0's state. Where the
saved layout is not one `reshard` reads, every rank falls back to DeepSpeed's universal checkpoint: every
node fetches the whole tag, its first local rank converts it once (TAG/universal: each parameter's fp32
weights and optimizer moments whole) and each rank loads its own partition from there (`to_universal`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import random
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from data_prep.storage import Store
from data_prep.tario import file_sha256
from pipeline.train import reshard
from pipeline.train.tag import COMPLETE, UNIVERSAL, files_read, optim_files, read_record, set_rng_state
from pipeline.train.transfer import fetch_for_node, remote_tags

log = logging.getLogger(__name__)


@dataclass
class Restored:
    step: int
    tag: str
    extra: dict  # the stage's saved extra state (data-stream position, ...): rank 0's, on every rank
    saved_by: int = 0  # the number of ranks that saved it


def verify(tag_dir: Path, rank: int, world_size: int, local_rank: int = 0, whole: bool = False) -> str | None:
    """Why this checkpoint cannot be loaded by `rank`, or None if it can.

    Each rank checks the files it reads whole (`files_read`): at the world size that saved it its own ZeRO
    shard, its own state and the model states; at another, the model states and (rank 0) rank 0's state,
    the optimizer states being read in parts wherever they are (`reshard`). The other ranks' files may be on
    other nodes' disks, where their own ranks check them. `whole` (DeepSpeed's universal conversion, which
    reads every file): each node's first local rank checks them all."""
    if not tag_dir.is_dir():
        return "not on this node's disk (without a shared run_dir, set checkpoint.uri or storage)"
    record_path = tag_dir / COMPLETE
    if not record_path.is_file():
        return "no COMPLETE.json (the save was cut short)"
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not even UTF-8 (a torn or corrupted file)
        return f"COMPLETE.json is not readable JSON ({type(exc).__name__})"
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        return "COMPLETE.json has no file list"
    if whole:
        mine = list(record["files"]) if local_rank == 0 else []
    else:
        mine = files_read(record, [rank], world_size)
    for name in mine:
        meta, path = record["files"][name], tag_dir / name
        if not path.is_file() or path.stat().st_size != meta["bytes"]:
            return f"{name} is missing or has the wrong size" + (
                f" (saved by {record['world_size']} ranks, this run has {world_size}: a conversion of the whole "
                "tag reads every rank's files, which a node holds only on a shared run_dir or from checkpoint.uri)"
                if whole
                else ""
            )
    for name in mine:
        try:
            digest = file_sha256(tag_dir / name)
        except OSError as exc:  # a failing disk (EIO): this tag is not loadable here, an older one may be
            return f"{name} could not be read ({type(exc).__name__}: {exc})"
        if digest != record["files"][name]["sha256"]:
            return f"{name} does not match its sha256 (corrupted)"
    return None


def to_universal(tag_dir: Path) -> Path | None:
    """DeepSpeed's universal checkpoint of a ZeRO tag (`ds_to_universal`: every parameter's fp32 weights and
    optimizer moments whole, one folder each), made once into TAG/universal, which ZeRO 1-3 load on any
    number of ranks. None for a tag without partitioned optimizer states (ZeRO-0 in fp32/fp16: its optimizer
    states lie whole in the model states, which load on any number of ranks as they are)."""
    out = tag_dir / UNIVERSAL
    if out.is_dir():
        return out
    if not any(tag_dir.glob("*optim_states.pt")):
        return None
    from deepspeed.checkpoint import ds_to_universal

    # Every node converts its own copy; on a shared disk they race to one folder: each writes its own and
    # the first rename wins. DeepSpeed reads its input folder recursively (os.walk): given the tag, it also
    # counted the model states another node's conversion had copied into its folder (or left there when
    # killed), and failed ("model-state file count"). It reads links to the tag's own files instead.
    me = f"{socket.gethostname()}-{os.getpid()}"
    partial, given = tag_dir / f"{UNIVERSAL}.partial-{me}", tag_dir / f".{UNIVERSAL}.input-{me}"
    for folder in (partial, given):
        shutil.rmtree(folder, ignore_errors=True)
    given.mkdir()
    for f in tag_dir.iterdir():
        if f.is_file() and not f.name.startswith("."):
            (given / f.name).symlink_to(f"../{f.name}")
    args = argparse.Namespace(
        input_folder=str(given),
        output_folder=str(partial),
        num_extract_workers=1,  # no process pool: this runs inside a rank (Ray Train's worker thread)
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(args)
    except BaseException:
        log.error("%s: ds_to_universal failed; its output:\n%s", tag_dir, chatter.getvalue()[-4000:])
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(given, ignore_errors=True)
    try:
        os.replace(partial, out)  # whole or absent
    except OSError:
        if not out.is_dir():
            raise
        shutil.rmtree(partial, ignore_errors=True)  # another node on this disk converted it first
    return out


def all_agree(ok: bool, group=None) -> bool:
    """True on every rank iff `ok` on every rank (a CPU all-reduce over the control group)."""
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _load(engine, ckpt_dir: Path, tag_dir: Path, universal: Path | None, load_optimizer: bool):
    loaded = _load_tag(engine, ckpt_dir, tag_dir, universal, load_optimizer)
    refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
    if not load_optimizer and engine.zero_optimization_stage() == 0 and refresh is not None:
        # ZeRO-0 under bf16: DeepSpeed's wrapper steps fp32 master copies and copies them into the module. A
        # load without the optimizer states sets the module's weights only and leaves the masters at their
        # initial values (DeepSpeed refreshes them only for load_module_only), so the next step would put
        # the initial weights back. The masters are taken from the loaded weights.
        refresh()
    return loaded


def _load_tag(engine, ckpt_dir: Path, tag_dir: Path, universal: Path | None, load_optimizer: bool):
    if universal is None:
        return engine.load_checkpoint(
            str(ckpt_dir),
            tag=tag_dir.name,
            load_optimizer_states=load_optimizer,
            load_lr_scheduler_states=load_optimizer,
        )
    config = engine._config  # DeepSpeed reads the flag at load time; the engine was built without it
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        loaded = engine.load_checkpoint(
            str(universal.parent),
            tag=universal.name,
            load_optimizer_states=load_optimizer,
            load_lr_scheduler_states=load_optimizer,
        )
    finally:
        config.load_universal_checkpoint = before
    if load_optimizer and engine.zero_optimization_stage() == 3:
        # DeepSpeed's ZeRO-3 universal loader gives every group group 0's hyperparameters and every sub-group
        # one step tensor (`reshard.mend_zero3`).
        saved = torch.load(universal / "zero" / "optimizer_state.pt", weights_only=False)["param_groups"]
        reshard.mend_zero3(engine.optimizer.optimizer, saved)
    elif load_optimizer:
        reshard.own_steps(engine.optimizer.optimizer)
    return loaded


def reseed(seed: int, step: int, rank: int) -> None:
    """Random states for a rank that has no saved ones of its own (a resume on another world size)."""
    entropy = np.random.SeedSequence([seed, step, rank]).generate_state(4)
    random.seed(int(entropy[0]))
    np.random.seed(int(entropy[1]))
    torch.manual_seed(int(entropy[2]) << 32 | int(entropy[3]))


def newest_record(ckpt_dir: Path, store: Store | None, rank: int, group=None) -> dict | None:
    """COMPLETE.json of the newest complete tag on any node's disk or on the store (the same on every rank),
    or None: what the stage will resume from, read before its engine is built. The ranks gather tag names
    only (bytes per rank O(ranks x a name)); the lowest rank that holds the chosen tag broadcasts its record."""
    found: tuple[str, dict] | None = None
    if ckpt_dir.is_dir():
        for tag in sorted((p.name for p in ckpt_dir.glob("step_*") if p.is_dir()), reverse=True):
            record = read_record(ckpt_dir / tag)
            if record is not None:
                found = (tag, record)
                break
    if rank == 0 and store is not None:
        try:  # raised here, the other ranks would wait in the gather below
            stored = remote_tags(store, 0, None, broadcast=False)
            if stored and (found is None or stored[-1] > found[0]):
                found = (stored[-1], json.loads(store.read_text(f"{stored[-1]}/{COMPLETE}")))
        except Exception as exc:
            log.warning("%s: could not read the newest stored checkpoint's record: %r", store, exc)
    names: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, found and found[0], group=group)
    newest = max((n for n in names if n), default=None)
    if newest is None:
        return None
    holder = names.index(newest)  # a group rank
    box = [found[1] if found is not None and found[0] == newest else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, holder) if group else holder, group=group)
    return box[0]


def _whole_tag(
    tag_dir: Path, store: Store | None, rank: int, world_size: int, local_rank: int, group
) -> bool:
    """Every file of the tag on every node (fetched from `store` where a node lacks some), checked by each
    node's first local rank: what DeepSpeed's universal conversion reads. True on every rank, or on none."""
    problem = verify(tag_dir, rank, world_size, local_rank, whole=True)
    if store is not None and not all_agree(problem is None, group):
        fetch_for_node(store, tag_dir, rank, local_rank, world_size, problem, group, whole=True)
        problem = verify(tag_dir, rank, world_size, local_rank, whole=True)
    if problem:
        log.warning("rank %d: skipping checkpoint %s: %s", rank, tag_dir, problem)
    return all_agree(problem is None, group)


def resume(
    engine,
    ckpt_dir: Path,
    rank: int,
    world_size: int,
    group=None,
    load_optimizer: bool = True,
    store: Store | None = None,
    local_rank: int = 0,
    seed: int = 0,
) -> Restored | None:
    """Load the newest complete checkpoint, falling back past broken ones; None if there is none.

    A checkpoint saved by another number of ranks is resharded: each rank reads its own part of the saved
    weights and optimizer states in byte ranges (`reshard.plan`, `reshard.apply`); where the saved layout
    is one `reshard` does not read, every node fetches the whole tag (from `store` where its disk lacks
    part), its first local rank converts it to a universal checkpoint (`to_universal`), and every rank
    loads its own partition from that.
    Each rank's random states then restart from (seed, step, rank); the data-stream position comes from
    rank 0's state, which describes the whole stream (`pipeline.data.deal`)."""
    remote = set(remote_tags(store, rank, group))
    local = {p.name for p in ckpt_dir.glob("step_*") if p.is_dir()} if ckpt_dir.is_dir() else set()
    # Every rank walks the same list, else the ranks pair up different collectives and hang: nodes that
    # share no disk see different local tags.
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, sorted(local), group=group)
    tags = [ckpt_dir / t for t in sorted(remote.union(*seen), reverse=True)]
    for tag_dir in tags:
        problem = verify(tag_dir, rank, world_size, local_rank)
        if tag_dir.name in remote and not all_agree(problem is None, group):
            fetch_for_node(store, tag_dir, rank, local_rank, world_size, problem, group)
            problem = verify(tag_dir, rank, world_size, local_rank)  # the stored copy, checked as any other
        if not all_agree(problem is None, group):
            if rank == 0 or problem:
                log.warning(
                    "rank %d: skipping checkpoint %s: %s",
                    rank,
                    tag_dir,
                    problem or "another rank found it broken",
                )
            continue
        saved_by = (read_record(tag_dir) or {}).get("world_size", world_size)
        counts: list = [None] * dist.get_world_size()
        dist.all_gather_object(counts, saved_by, group=group)
        if len(set(counts)) > 1:  # a node holds another save of this tag: no rank may take another load path
            if rank == 0:
                log.warning(
                    "skipping checkpoint %s: its nodes' copies were saved by %s ranks", tag_dir, counts
                )
            continue
        record = read_record(tag_dir)
        if saved_by != world_size and not load_optimizer and engine.zero_optimization_stage() == 3:
            raise RuntimeError(
                f"{tag_dir}: saved by {saved_by} ranks, resumed on {world_size} with debug.resume_optimizer: false; "
                "DeepSpeed loads a ZeRO-3 checkpoint without its optimizer only on the number of ranks that saved "
                f"it (its module-only load reads the consolidated weights of that layout): resume on {saved_by} "
                "ranks, or with the optimizer"
            )
        plan, ranged = None, saved_by != world_size
        if ranged:  # every rank the same path, though a node's copy of COMPLETE.json decides it
            ranged = all_agree(bool(optim_files(record)), group)
        if ranged:  # each rank reads its part of the optimizer states (pipeline.train.reshard)
            failure = None
            try:
                plan = reshard.plan(engine, tag_dir, record, store)
            except Exception as exc:
                failure = exc
            if not all_agree(not isinstance(failure, reshard.LayoutMismatch), group):
                if rank == 0 or failure:
                    log.warning(
                        "rank %d: checkpoint %s cannot be read in parts (%s); converting the whole tag instead",
                        rank,
                        tag_dir.name,
                        failure or "another rank found its layout unknown",
                    )
                if plan is not None:
                    plan.close()
                plan, ranged = None, False
                if not _whole_tag(tag_dir, store, rank, world_size, local_rank, group):
                    continue
            elif not all_agree(failure is None, group):
                if plan is not None:
                    plan.close()
                if rank == 0 or failure:
                    log.warning(
                        "rank %d: skipping checkpoint %s: it could not be read in parts: %s",
                        rank,
                        tag_dir.name,
                        repr(failure) if failure else "another rank could not read its part",
                    )
                continue
            else:
                log.info(
                    "rank %d: read its part of checkpoint %s: %d bytes in %d requests from %s",
                    rank,
                    tag_dir.name,
                    plan.sources.bucket_bytes,
                    plan.sources.bucket_requests,
                    store.describe() if store is not None else "no bucket",
                )
        universal, failure = None, None
        if saved_by != world_size and not ranged and local_rank == 0:
            try:
                universal = to_universal(tag_dir)
            except Exception as exc:
                failure = exc
                log.warning(
                    "rank %d: checkpoint %s does not convert to a universal one: %r", rank, tag_dir, exc
                )
        if not all_agree(failure is None, group):
            continue
        if saved_by != world_size:
            universal = tag_dir / UNIVERSAL if not ranged and (tag_dir / UNIVERSAL).is_dir() else None
            if rank == 0:
                log.warning(
                    "checkpoint %s was saved by %d ranks; resharding it for %d%s",
                    tag_dir.name,
                    saved_by,
                    world_size,
                    " (each rank reading its part)"
                    if ranged
                    else " (universal checkpoint)"
                    if universal
                    else "",
                )
        try:
            if plan is not None:
                path, client_state = reshard.apply(engine, plan, load_optimizer)
            else:
                path, client_state = _load(engine, ckpt_dir, tag_dir, universal, load_optimizer)
            # Its own RNG states where the world size is the same; the stage's `extra` is rank 0's alone.
            own = (
                torch.load(tag_dir / f"rank_{rank}.pt", weights_only=False)
                if saved_by == world_size or rank == 0
                else {}
            )
            loaded = path is not None
        except Exception as exc:  # a file that hashes right but does not load: treat as broken
            log.warning("rank %d: checkpoint %s failed to load: %r", rank, tag_dir, exc)
            loaded = False
        finally:
            if plan is not None:
                plan.close()
        if not all_agree(loaded, group):
            continue
        step = int(client_state["step"])
        box = [own["extra"] if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)  # one read of the stage's state, one broadcast
        if saved_by == world_size:
            set_rng_state(own["rng"])
        else:
            reseed(seed, step, rank)
        if rank == 0:
            log.info("resumed from %s", tag_dir)
        return Restored(step, tag_dir.name, box[0], saved_by)
    if tags:
        raise RuntimeError(
            f"{ckpt_dir}: none of {len(tags)} checkpoints could be loaded; see the warnings above"
        )
    return None
