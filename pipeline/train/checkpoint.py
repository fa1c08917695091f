"""DeepSpeed checkpoints: every rank saves into one tag folder, rank 0 prunes old tags.

ckpt_dir/step_00000040/   mp_rank_00_model_states.pt, zero_pp_rank_{r}_mp_rank_00_optim_states.pt, ...
ckpt_dir/latest           the newest complete tag (written by DeepSpeed after its barrier)
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch.distributed as dist

log = logging.getLogger(__name__)


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def save(engine, ckpt_dir: Path, step: int, keep_last: int, is_main: bool) -> Path:
    """Collective: every rank must call it (rank-0-only saving hangs, DeepSpeed issue 2993)."""
    tag = tag_for(step)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step})
    dist.barrier()  # every rank's files are on disk before anything is pruned
    if is_main:
        tags = sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir())
        for old in tags[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return ckpt_dir / tag


def resume(engine, ckpt_dir: Path) -> int:
    """Load the newest checkpoint if there is one; returns the step to continue from (0 if none)."""
    if not (ckpt_dir / "latest").is_file():
        return 0
    path, client_state = engine.load_checkpoint(str(ckpt_dir))
    if path is None:
        raise RuntimeError(
            f"{ckpt_dir}: `latest` names {(ckpt_dir / 'latest').read_text()!r} but it did not load"
        )
    log.info("resumed from %s", path)
    return int(client_state["step"])
