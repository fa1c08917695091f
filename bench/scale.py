"""A stage's start-up and resume metadata at the scale the pipeline stands in for (#27): JFT-300M as 300M
samples in 100k shards on 1,024 ranks x 8 loader workers (128 nodes), against 10k shards on 128 ranks.

    .venv/bin/python bench/scale.py --out bench/results/scale.json

Metadata only, no images: a real manifest.json of that many shards is written to a temporary folder, and the
per-rank functions run here with per-rank inputs. What a rank receives from the collectives is measured as
the bytes torch.distributed's object collectives move (a pickle per rank; all_gather_object pads each rank's
to the largest), from the real objects. Figures, per rank unless said:

- start-up, rank 0: reading the manifest and packing the dataset for the others (`Stage.dataset`): time and
  peak RSS over the process's after-import baseline (a fresh process each);
- start-up, any other rank: unpacking that broadcast and the epoch's quota: time and peak RSS; beside it,
  what every rank paid when each read the manifest itself (`dataset_info`);
- bytes received at start-up: the newest checkpoint agreed (`checkpoint.newest_record`: tag names gathered,
  the chosen COMPLETE.json of a ZeRO-3 save by every rank broadcast), the local tag lists `resume` gathers,
  the dataset and the data-stream position broadcast; against gathering every rank's record as before;
- the deal on a new world size (`continue_deal`), 1,024 -> 1,016 (a node lost) and 1,024 -> 512: time
  (median of 3) and the data position's bytes as checkpointed (`Deal.to_dict`, written once per checkpoint);
- the share of the split's samples an epoch uses (the epoch quota is every slot's worst case, so shards of
  uneven counts leave samples out);
- a resume on another number of ranks (one node lost; half the nodes) of ViT-H/14's ZeRO-3 checkpoint: the
  bytes and requests a node reads from the bucket, against its share of the tag (`resume_reads`: the
  ranged reshard's own span and request functions over the saved files' layout).

Each figure has its goal beside it and whether it is met; `growth` is the JFT scale's figure over the 10k's.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from provenance import write_result  # bench/provenance.py, beside this file

from data_prep.layout import Manifest, ShardInfo, shard_rel, write_manifest
from pipeline.data.deal import Deal, _ends, _order, continue_deal, rank_quota, slot_range
from pipeline.data.sources import DatasetInfo, dataset_info, epoch_batches
from pipeline.train.reshard import BLOCK, runs, zero3_offsets, zero3_spans
from pipeline.train.tag import tag_for

SCALES = {
    "jft": {"samples": 300_000_000, "shards": 100_000, "world": 1024, "nodes": 128},
    "10k": {"samples": 30_000_000, "shards": 10_000, "world": 128, "nodes": 16},
}
WORKERS, MICRO, CLASSES, KEEP_LAST = 8, 16, 18_291, 3
STEP = (
    12_345  # where the run stopped (step 12,345 of a ViT-H run: 202M samples in at a global batch of 16,384)
)


def shard_counts(samples: int, shards: int) -> list[int]:
    """Counts within +-10% of the mean (hash-partitioned keys, rejected inputs), summing to `samples`."""
    rng = np.random.default_rng(0)
    mean = samples // shards
    counts = rng.integers(int(mean * 0.9), int(mean * 1.1) + 1, size=shards)
    counts[-1] += samples - int(counts.sum())
    return counts.tolist()


def write_corpus(root: Path, samples: int, shards: int) -> int:
    counts = shard_counts(samples, shards)
    manifest = Manifest(
        classes=[f"class_{i:05d}" for i in range(CLASSES)],
        multi_label=True,
        shards=[
            ShardInfo("train", shard_rel("train", "shard", i), c, c * 110_000, f"{i:064x}")
            for i, c in enumerate(counts)
        ],
        command="vitpipe shard (bench/scale.py: metadata only)",
    )
    write_manifest(root, manifest)
    return (root / "manifest.json").stat().st_size


# ---------------------------------------------------------------- one rank's start-up, in a fresh process


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> float:
    """Reset the process's peak RSS to its current RSS (Linux: clear_refs 5); returns the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mb("VmRSS")


def read_past(counts: list[int], world: int) -> float:
    """Over every slot of epoch 0, the samples its run's first shard holds before the run (`slot_range`'s
    `passed`), vectorised over the slots, as a share of the epoch's samples."""
    per_rank = rank_quota(counts, world, MICRO)
    slot = np.arange(world * WORKERS)
    rank, worker = slot // WORKERS, slot % WORKERS
    start = MICRO * (
        rank * per_rank + worker * (per_rank // WORKERS) + np.minimum(worker, per_rank % WORKERS)
    )
    ends = _ends(tuple(counts), 0, 0)
    first = np.searchsorted(ends, start, side="right")
    shard_start = ends[first] - np.asarray(counts)[_order(len(counts), 0, 0)[first]]
    assert (
        slot_range(counts, 0, 0, world, WORKERS, 1, 1, MICRO)[1]
        == start[WORKERS + 1] - shard_start[WORKERS + 1]
    )
    return float((start - shard_start).sum() / (per_rank * MICRO * world))


def child(role: str, root: str, wire: str, world: int) -> dict:
    base = _reset_peak()
    t = time.perf_counter()
    if role == "rank0":  # reads the manifest, packs it for the broadcast
        packed = pickle.dumps(dataset_info(root, "train").packed())
        Path(wire).write_bytes(packed)
        info = None
    elif role == "rank":  # unpacks what rank 0 broadcast
        info = DatasetInfo.unpacked(pickle.loads(Path(wire).read_bytes()))
    else:  # "every_rank_reads": before, every rank read the manifest itself
        info = dataset_info(root, "train")
    if info is not None:
        rank_quota(info.shard_counts, world, MICRO)
    return {"seconds": round(time.perf_counter() - t, 3), "peak_rss_mb": round(_status_mb("VmHWM") - base, 1)}


def in_child(role: str, root: Path, wire: Path, world: int) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", role, str(root), str(wire), str(world)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- collectives' payloads


def gathered(per_rank: list[object]) -> int:
    """Bytes one rank receives from all_gather_object: every rank's pickle, padded to the largest."""
    return len(per_rank) * max(len(pickle.dumps(o)) for o in per_rank)


def complete_record(world: int) -> dict:
    """COMPLETE.json of a ZeRO-3 save by `world` ranks: each rank's optimizer and model shards, its RNG
    state and its EMA share, with sizes and hashes (ViT-H/14's sizes)."""
    files = {}
    for r in range(world):
        for name, size in (
            (f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", 7_600_000_000 // world),
            (f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", 1_300_000_000 // world),
            (f"rank_{r}.pt", 20_000),
            (f"ema_rank_{r}_fp32.safetensors", 2_530_000_000 // world),
        ):
            files[name] = {"bytes": size, "sha256": f"{r:064x}"}
    return {"step": STEP, "world_size": world, "micro_batch": MICRO, "grad_accum": 1, "files": files}


def vit_h_groups() -> list[list[tuple[str, int]]]:
    """ViT-H/14 with JFT's head, as ZeRO-3 sub-groups: (name, numel) per optimizer parameter group, in order."""
    import torch

    from pipeline.models import create_model
    from pipeline.models.param_groups import param_groups

    with torch.device("meta"):
        model = create_model("vit_h14", img_size=224, num_classes=CLASSES)
    names = {id(p): n for n, p in model.named_parameters()}
    return [[(names[id(p)], p.numel()) for p in g["params"]] for g in param_groups(model, 0.05)]


def resume_reads(groups: list[list[tuple[str, int]]], saved: int, per_node: int = 8) -> dict:
    """Bytes and requests a node sends the bucket when a ZeRO-3 tag saved by `saved` ranks resumes on one node
    fewer and on half the nodes, with the ranged reshard (`pipeline.train.reshard`): each rank's spans of
    every parameter (`zero3_spans`), made requests as it makes them (`runs`), over the saved files' layout:
    an optimizer file holds each sub-group's fp32 weights, then its two Adam moments (4 bytes an element);
    an EMA file each parameter's part in order. Per file a rank opens, its metadata: an optimizer file's zip
    directory and pickle (two blocks) and a local header per tensor read; an EMA file's header (its real
    size, built here). Per node, saved rank 0's model states once (est.) and, on node 0, rank 0's state."""
    shapes = [{n: (k,) for n, k in g} for g in groups]
    offsets = zero3_offsets(shapes, saved)
    flat = [sum(-(-k // saved) for _, k in g) for g in groups]  # each saved rank's elements per sub-group
    base, at = {}, 4096  # where each flat tensor starts in a saved rank's optimizer file
    for key, g in [("fp32", g) for g in range(len(groups))] + [
        (key, g) for g in range(len(groups)) for key in ("exp_avg", "exp_avg_sq")
    ]:
        base[(key, g)] = at
        at += flat[g] * 4
    ema_at = [0] + [sum(flat[:g]) * 4 for g in range(1, len(groups))]  # each sub-group's first byte in it
    header = {
        n: {"dtype": "F32", "shape": [-(-k // saved)], "data_offsets": [0, 4 * -(-k // saved)]}
        for g in groups
        for n, k in g
    }
    header["__metadata__"] = {"ranges": json.dumps({n: [0, -(-k // saved), k] for g in groups for n, k in g})}
    ema_header = 8 + len(json.dumps(header))
    optim_file, ema_file = at, ema_header + 4 * sum(flat)
    model_states = 2 * len(pickle.dumps(shapes))  # est.: the shapes, and the module's empty placeholders
    metadata = 2 * BLOCK + 3 * len(groups) * 256  # per opened optimizer file: directory, pickle, headers
    tag = saved * (optim_file + ema_file + 20_000) + model_states
    out = {"tag_bytes": tag, "cases": {}}
    for case, world in (("one_node_lost", saved - per_node), ("half", saved // 2)):
        nodes = world // per_node
        share = tag / nodes
        node_figures = []
        for node in (0, nodes // 2):
            read = requests = 0
            t = time.perf_counter()
            for rank in range(node * per_node, (node + 1) * per_node):
                ranges, opened = [], {0}
                for g, offset, numel in offsets.values():
                    for span in zero3_spans(g, offset, numel, saved, world, rank):
                        opened.add(span.saved)
                        for key in ("fp32", "exp_avg", "exp_avg_sq"):
                            ranges.append((str(span.saved), base[(key, g)] + 4 * span.start, 4 * span.count))
                        at = ema_header + ema_at[g] + 4 * span.start
                        ranges.append((f"ema{span.saved}", at, 4 * span.count))
                made = runs(ranges)
                read += sum(stop - start for _, start, stop, _ in made)
                read += len(opened) * metadata + (len(opened) - 1) * ema_header
                requests += len(made) + len(opened) * (2 + 3 * len(groups)) + (len(opened) - 1) * 2
            plan_s = (time.perf_counter() - t) / per_node
            read += model_states + (20_000 + 122_400 if node == 0 else 0)
            requests += 1 + (node == 0)
            node_figures.append(
                {"node": node, "bytes": read, "requests": requests, "plan_s_per_rank": plan_s}
            )
        worst = max(f["bytes"] for f in node_figures) / share
        out["cases"][case] = {
            "ranks": f"{saved}->{world}",
            "node_share_bytes": round(share),
            "nodes": node_figures,
            "node_bytes_over_share": figure(round(worst, 3), "<= 1.5 (#27 item 1)", worst <= 1.5),
            "node_bytes_over_share_before": nodes,  # every node downloaded the whole tag
        }
    return out


def figure(value, goal: str, met: bool | None) -> dict:
    return {"value": value, "goal": goal, "met": met}


def measure(name: str, samples: int, shards: int, world: int, nodes: int, tmp: Path) -> dict:
    root = tmp / name
    manifest_bytes = write_corpus(root, samples, shards)
    wire = tmp / f"{name}.wire"
    rank0 = in_child("rank0", root, wire, world)
    rank = in_child("rank", root, wire, world)
    before = in_child("every_rank_reads", root, wire, world)
    info = DatasetInfo.unpacked(pickle.loads(wire.read_bytes()))

    # The deal: the run stopped at STEP on world x 8 workers; it resumes one node short, and on half.
    deal = Deal(world, WORKERS, MICRO, 1)
    deals, times = {}, {}
    for new in (world - world // nodes, world // 2):
        shape = (new, WORKERS, MICRO, 1 if new > world // 2 else 2)
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            deals[new] = continue_deal(deal, STEP, shape, info, seed=0)
            runs.append(time.perf_counter() - t)
        times[new] = statistics.median(runs)
    lost = deals[world - world // nodes]
    position = json.dumps(lost.to_dict())
    t = time.perf_counter()  # a rank's own shards after the re-deal: its carried pieces', one permutation
    for p in lost.carried(0):
        p.extent(info)
    slot_range(info.shard_counts, 0, lost.first_epoch, lost.world_size, WORKERS, 0, 0, MICRO)
    own_shards = time.perf_counter() - t

    # Bytes a rank receives at start-up.
    tags = [tag_for(STEP - k * 1000) for k in range(KEEP_LAST)]
    record = complete_record(world)
    names = gathered([tags[0]] * world)  # newest_record: tag names
    chosen = len(pickle.dumps(record))  # ... and the chosen record, broadcast
    local_tags = gathered([tags] * world)  # resume: every node's local tags
    dataset = wire.stat().st_size
    stream = len(pickle.dumps({"step": STEP, "data": lost.to_dict()}))  # rank 0's extra state, broadcast
    received = names + chosen + local_tags + dataset + stream
    records_before = gathered([(tags[0], record)] * world)

    used = rank_quota(info.shard_counts, world, MICRO) * MICRO * world / samples
    passed = read_past(info.shard_counts, world)
    used_whole_shards = epoch_batches(info, world, MICRO, WORKERS) * MICRO * world / samples  # the old layout
    mb = 1e6
    return {
        "scale": {"samples": samples, "shards": shards, "ranks": world, "nodes": nodes, "workers": WORKERS},
        "manifest_mb": round(manifest_bytes / mb, 1),
        "startup_rank0_s": figure(rank0["seconds"], "<= 10 s", rank0["seconds"] <= 10),
        "startup_rank0_rss_mb": figure(
            rank0["peak_rss_mb"], "<= 250 MB (one rank reads the manifest)", rank0["peak_rss_mb"] <= 250
        ),
        "startup_rank_s": figure(rank["seconds"], "<= 1 s", rank["seconds"] <= 1),
        "startup_rank_rss_mb": figure(
            rank["peak_rss_mb"], "<= 40 MB: O(shards) arrays, no manifest", rank["peak_rss_mb"] <= 40
        ),
        "startup_rank_before": before,
        "deal_s": {  # a node lost; half the ranks
            case: {**figure(round(times[new], 3), "<= 2 s", times[new] <= 2), "ranks": f"{world}->{new}"}
            for case, new in zip(("one_node_lost", "half"), times)
        },
        "own_shards_after_redeal_s": round(own_shards, 3),
        "data_position_bytes": figure(
            len(position), "<= 1 MB, written once per checkpoint", len(position) <= mb
        ),
        "data_position_pieces": sum(len(s) for s in lost.carry),
        "startup_received_bytes": figure(
            received, "<= 2 MB: tag names gathered, the rest broadcast once", received <= 2 * mb
        ),
        "startup_received_parts": {
            "tag_names_gathered": names,
            "chosen_record_broadcast": chosen,
            "local_tags_gathered": local_tags,
            "dataset_broadcast": dataset,
            "data_position_broadcast": stream,
        },
        "startup_received_before_records_gathered": records_before,
        "epoch_share_used": figure(round(used, 6), ">= 0.999 (#27 item 5)", used >= 0.999),
        "epoch_share_used_whole_shards": round(used_whole_shards, 4),  # before: every slot the worst share
        # samples a slot reads past at the head of its run (the run before's, in the same shard): read, never
        # decoded, as a share of the epoch's samples
        "epoch_read_past": figure(round(passed, 4), "<= 0.06: about half a shard per slot", passed <= 0.06),
        "resume_reads": resume_reads(vit_h_groups(), world),
    }


def growth(big: dict, small: dict) -> dict:
    """The JFT scale's figure over the 10k's, for every number both have."""
    out = {}
    for key, a in big.items():
        b = small.get(key)
        if isinstance(a, dict) and "value" in a and isinstance(b, dict):
            out[key] = round(a["value"] / b["value"], 2) if b["value"] else None
        elif isinstance(a, dict) and isinstance(b, dict):
            inner = growth(a, b)
            if inner:
                out[key] = inner
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, role, root, wire, world = sys.argv
        print(json.dumps(child(role, root, wire, int(world))))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="where to write the JSON result")
    args = p.parse_args()
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = {name: measure(name, **s, tmp=Path(tmp)) for name, s in SCALES.items()}
    result["growth"] = growth(result["jft"], result["10k"])
    result["seconds"] = round(time.perf_counter() - t, 1)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
