"""What a checkpoint tag holds: its files, its record, its RNG states, and which rank wrote what.

    ckpt_dir/step_00000040/   DeepSpeed's files (mp_rank_00_model_states.pt, zero_pp_rank_R_*...)
                              rank_R.pt        this rank's RNG states; rank 0's also the stage's data-stream position
                              ema_rank_R_fp32.safetensors  its share of the weight EMA (optim.ema_decay)
                              COMPLETE.json    written by rank 0 after every rank's files are on disk:
                                               the file list with sizes, and the sha256 of each
                              universal/       DeepSpeed's universal checkpoint of it, made at a resume on
                                               another number of ranks only where the saved layout cannot
                                               be read in parts (`checkpoint.to_universal`, `reshard`)
    ckpt_dir/latest           the newest complete tag, replaced atomically (write tmp, rename)

Saving: `pipeline.train.saving`. Resuming: `pipeline.train.checkpoint`. Moving tags to and from a bucket:
`pipeline.train.transfer`.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from data_prep.atomic import TMP_SUFFIX

COMPLETE = "COMPLETE.json"
LATEST = "latest"
UNIVERSAL = "universal"
OPTIM = re.compile(
    r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$"
)  # a rank's ZeRO optimizer states
ZERO3_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # ZeRO-3: saved rank 0's (the parameters' shapes)
MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO 0-2: the whole module


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict:
    """This rank's random states. CUDA: the rank's own device only (the current one), so a resume on a
    node with another GPU count restores it; a list of every visible device's state would not fit there.
    Only where the rank uses CUDA (a GPU stage has started it): reading the state would start CUDA, and a CPU
    stage on a host with GPUs would hold a context on the first of them."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if isinstance(cuda, list):  # written before: every visible device's state; this rank's is its own
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        cuda = cuda[index] if index < len(cuda) else None
    if cuda is not None and torch.cuda.is_initialized():  # saved on CPU or resumed on CPU: nothing to do
        torch.cuda.set_rng_state(cuda)


def owned_by(name: str, rank: int, world_size: int | None = None) -> bool:
    """Whether `rank` wrote this file of a tag: its ZeRO shards and RNG state; rank 0 also the model states.

    A file still being written is nobody's: on a disk the ranks share, another rank's write in progress
    (safetensors' `.tmpXXXXXX` beside the file it writes, an atomic `NAME.tmp`) lies in the tag while rank 0
    lists it, and rank 0 took it for one of its own: it failed when the file was renamed away under it
    (FileNotFoundError, the save lost), or recorded a file that is gone in COMPLETE.json."""
    if name.startswith(".") or name.endswith(TMP_SUFFIX):
        return False
    if f"rank_{rank}_" in name or name == f"rank_{rank}.pt":
        return True
    world_size = dist.get_world_size() if world_size is None else world_size
    return rank == 0 and not any(f"rank_{r}_" in name or name == f"rank_{r}.pt" for r in range(1, world_size))


def stale_tags(tags: list[str], tag: str, keep_last: int) -> list[str]:
    """Which of `tags` to delete once `tag` is complete: all but `tag` and the keep_last - 1 newest before
    it. Tags newer than `tag` stay (a resume skipped them; they are evidence, and the save overwrites its
    own tag anyway)."""
    older = sorted(t for t in tags if t.startswith("step_") and t < tag)
    return older[: max(0, len(older) - (keep_last - 1))]


def prune_local(ckpt_dir: Path, tag: str, keep_last: int) -> None:
    for old in stale_tags([p.name for p in ckpt_dir.glob("step_*") if p.is_dir()], tag, keep_last):
        shutil.rmtree(ckpt_dir / old, ignore_errors=True)  # another node may prune a shared disk too


def read_record(tag_dir: Path) -> dict | None:
    try:
        return json.loads((tag_dir / COMPLETE).read_text())
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8 (a corrupted file): no record
        return None


def files_read(record: dict, ranks: list[int], world_size: int, whole: bool = False) -> list[str]:
    """The files of a tag (its COMPLETE.json `record`) that `ranks` read whole when they resume on
    `world_size` ranks: at the world size that saved it, each its own (ZeRO partition, RNG state, EMA share)
    and the model states; at another, the model states (saved rank 0's under ZeRO-3) and rank 0's state,
    since the optimizer states are read in parts (`pipeline.train.reshard`) and the EMA's files as the
    rank opens them. `whole`: every file (DeepSpeed's universal conversion reads them all)."""
    if whole:
        return list(record["files"])
    if record["world_size"] != world_size:
        return [model_states(record)] + (["rank_0.pt"] if 0 in ranks else [])
    own = tuple(f"rank_{r}_" for r in ranks)
    states = {f"rank_{r}.pt" for r in ranks}
    return [n for n in record["files"] if n.startswith("mp_rank_") or n in states or any(o in n for o in own)]


def optim_files(record: dict) -> dict[int, str]:
    """Saved rank -> its ZeRO optimizer-states file, from a tag's COMPLETE.json; {} for ZeRO-0."""
    out = {}
    for name in record["files"]:
        match = OPTIM.match(name)
        if match:
            out[int(match.group(2))] = name
    return out


def model_states(record: dict) -> str:
    """The model-states file a resume on another number of ranks reads: saved rank 0's under ZeRO-3 (the
    parameters' shapes), the one file of the whole module otherwise."""
    return ZERO3_STATES if ZERO3_STATES in record["files"] else MODEL_STATES
