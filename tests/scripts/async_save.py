"""Run under torchrun (2 ranks): asynchronous checkpoint saves of a real ZeRO-3 bf16 engine through S3.

    torchrun --nproc-per-node 2 tests/scripts/async_save.py go OUT STORE_URI
    torchrun --nproc-per-node 2 tests/scripts/async_save.py crash OUT STORE_URI    # ends by SIGKILL
    torchrun --nproc-per-node 2 tests/scripts/async_save.py resume OUT STORE_URI

The store is the real one (moto); `HeldStore` only holds one tag's uploads until the script lets them go
(or fails them on one rank), so that the test sees a save in flight. Each rank writes OUT/RANK-MODE.json:
what it observed, for the test to check.

go: step 1, save(1) held in its upload; `save` has returned: nothing is marked complete, and two more steps
run; released, the save completes with step 1's weights. save(3) fails on rank 1: `wait` raises on both
ranks, nothing of step 3 is marked complete, `latest` stays at step 1; resuming loads step 1 exactly.
crash: save(1) completes; save(2) is held in its upload and both ranks are killed (SIGKILL).
resume: the resume takes step 1, never the step 2 that was cut short.
"""

import json
import os
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from data_prep.storage import Store
from pipeline.config import validate_config
from pipeline.distributed import init_distributed, shutdown_distributed
from pipeline.models import create_model
from pipeline.train import checkpoint
from pipeline.train.engine import build_engine, consolidated_state_dict
from pipeline.train.saving import Checkpointer, CheckpointError
from pipeline.train.tag import COMPLETE, LATEST, tag_for


class HeldStore(Store):
    """The store, except that uploads under `hold` wait for `release` and those under `fail` are refused."""

    made: list["HeldStore"] = []

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self.hold: str | None = None
        self.fail: str | None = None
        self.holding, self.release = threading.Event(), threading.Event()
        HeldStore.made.append(self)

    @classmethod
    def release_all(cls) -> None:
        for store in cls.made:
            store.release.set()

    def upload(self, local: Path, rel: str) -> None:
        if self.fail and rel.startswith(self.fail + "/"):
            raise OSError(f"{rel}: refused (the test's fault)")
        if self.hold and rel.startswith(self.hold + "/"):
            self.holding.set()
            self.release.wait()
        super().upload(local, rel)


def main() -> None:
    mode, out, uri = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    ctx = init_distributed(False)
    cfg = validate_config(
        {
            "name": "async",
            "data": {"train": "unused", "batch_size": 2},
            "model": {"name": "vit_debug", "img_size": 32, "num_classes": 10},
            "optim": {"steps": 100, "warmup_steps": 0},
            "deepspeed": {"zero_stage": 3, "precision": "bf16"},
            "cluster": {"launcher": "local"},
        }
    )
    torch.manual_seed(0)
    engine, _, _ = build_engine(create_model("vit_debug", img_size=32, num_classes=10), cfg, ctx)
    store = HeldStore(uri)
    ckpt_dir = out / "checkpoints"
    saver = Checkpointer(engine, ckpt_dir, ctx.rank, 2, local_rank=ctx.local_rank, store=store)
    gen = torch.Generator().manual_seed(ctx.rank)

    def step() -> None:
        x = torch.randn(2, 3, 32, 32, generator=gen).to(torch.bfloat16)
        y = torch.randint(0, 10, (2,), generator=gen)
        engine.backward(torch.nn.functional.cross_entropy(engine(x).float(), y))
        engine.step()

    def complete(tag: str) -> dict:
        return {
            "local": (ckpt_dir / tag / COMPLETE).is_file(),
            "stored": store.exists(f"{tag}/{COMPLETE}"),
        }

    seen: dict = {}
    if mode == "go":
        step()
        w1 = consolidated_state_dict(engine)
        store.hold = tag_for(1)
        saver.save(1, {"step": 1})
        store.holding.wait()
        seen["in_flight"] = saver.in_flight
        seen["complete_while_held"] = complete(store.hold)
        step(), step()  # training goes on while the save waits on its upload
        w3 = consolidated_state_dict(engine)
        seen["moved"] = None if w1 is None else any(not torch.equal(w1[k], w3[k]) for k in w1)  # rank 0's
        dist.barrier()
        store.release.set()
        saver.wait()
        seen["complete_after"] = complete(tag_for(1))
        store.hold, store.fail = None, tag_for(3) if ctx.rank == 1 else None
        saver.save(3, {"step": 3})
        try:
            saver.wait()
            seen["failure"] = None
        except CheckpointError as exc:
            seen["failure"] = str(exc)
        seen["complete_failed"] = complete(tag_for(3))
        seen["latest"] = [(ckpt_dir / LATEST).read_text(), store.read_text(LATEST)]
        restored = checkpoint.resume(engine, ckpt_dir, ctx.rank, ctx.world_size, store=store)
        w = consolidated_state_dict(engine)
        seen["restored"] = [restored.step, restored.extra]
        seen["restored_is_step_1"] = None if w1 is None else all(torch.equal(w1[k], w[k]) for k in w1)
    elif mode == "crash":
        step()
        saver.save(1, {"step": 1})
        saver.wait()
        step()
        store.hold = tag_for(2)
        saver.save(2, {"step": 2})
        store.holding.wait()  # this rank's files of step 2 are on its disk, its upload under way
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        restored = checkpoint.resume(engine, ckpt_dir, ctx.rank, ctx.world_size, store=store)
        seen["restored"] = [restored.step, restored.extra]
    (out / f"{ctx.rank}-{mode}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        HeldStore.release_all()  # a held save must not keep a failed rank alive (its thread is not a daemon)
        raise
    shutdown_distributed()  # else gloo's threads may abort this rank's exit
