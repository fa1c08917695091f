"""The training step makes no host read between log steps: every tensor-to-host read of a real 2-rank
DeepSpeed run is counted per step (tests/scripts/host_sync.py) and traced to its call site.

On a GPU each such read stalls the host until the device catches up. Our code (the loop, objectives,
models, the data path) makes none between log steps. What remains is DeepSpeed's and torch's, each
named here with why it stays:
- DeepSpeed's ZeRO optimizers check that the gradient norm is finite before the step
  (`deepspeed/runtime/utils.py` `is_invalid_grad_norm`, in the step and in gradient clipping): a
  host decision DeepSpeed 0.19 makes every step; at most three reads per step (two under bf16, where
  engine.py turns DeepSpeed's overflow check off);
- torch's AdamW reads its step count (`torch/optim/optimizer.py` `_get_value`), a CPU tensor in the
  for-each implementation CPUs run; the fused kernel that GPUs run (engine.py) reads none;
- ZeRO-3 checks that every rank recorded the same parameter-fetch trace (`deepspeed/runtime/zero/utils.py`)
  while it records it: the first steps only.

DeepSpeed's accelerator `synchronize` is counted too (a no-op on CPU): its throughput timer called it
twice a step until engine.py turned the timer off. One it makes only on CUDA cannot show here: with
`overlap_comm`, ZeRO-1/2 synchronize once per backward (`deepspeed.overlap_comm: false` avoids it).

What Python cannot see: syncs inside torch's C++ (boolean-mask indexing, `nonzero`, a pageable
host-to-device copy). The step path avoids those by construction (torch.where and weighted means in
masked patch prediction, normalisation constants copied once), and `bench/gpu.py` runs its training
steps under `torch.cuda.set_sync_debug_mode("warn")` and reports every sync the GPU saw.
"""

import json
from collections import Counter
from pathlib import Path

import pytest
from conftest import torchrun  # shared with the other torchrun tests

# library file -> (most reads per step, the last step where any is allowed or None for every step)
ALLOWED = {
    "deepspeed/runtime/utils.py": (
        3,
        None,
    ),  # is_invalid_grad_norm: the norm checks (fp32: one more) and the clip
    "torch/optim/optimizer.py": (2, None),  # _get_value(step) per parameter group, CPU AdamW only
    "deepspeed/runtime/zero/utils.py": (None, 2),  # ZeRO-3's trace check while the trace is recorded
}
CASES = {
    "sigmoid_zero2_bf16": ["deepspeed.zero_stage=2", "deepspeed.precision=bf16"],
    "mixup_zero1_bf16": [
        "deepspeed.zero_stage=1",
        "deepspeed.precision=bf16",
        "objective.name=supervised_softmax",
        "objective.mixup_alpha=0.8",
        "objective.cutmix_alpha=1.0",
    ],
    "mae_zero3_fp32": ["deepspeed.zero_stage=3", "model.name=mae_vit_debug", "objective.name=mae"],
    "mpp_zero2_fp32": [
        "deepspeed.zero_stage=2",
        "model.name=mpp_vit_debug",
        "objective.name=masked_patch_prediction",
        "model.grad_checkpointing=1.0",
    ],
}


def _library(site: str) -> str | None:
    return next((lib for lib in ALLOWED if lib in site), None)


@pytest.fixture(scope="module")
def reads(smoke_dataset, tmp_path_factory) -> Path:
    """Every case's counts, from one 2-rank launch: OUT/CASE.json."""
    root = tmp_path_factory.mktemp("host_sync")
    out = root / "reads"
    out.mkdir()
    torchrun("tests/scripts/host_sync.py", str(out), str(smoke_dataset), str(root / "run"), json.dumps(CASES))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_host_read_between_log_steps(case, reads):
    report = json.loads((reads / f"{case}.json").read_text())
    log_every, steps = report["log_every"], report["steps"]
    assert [s[0] for s in steps] == list(range(1, 13)), steps

    for done, in_step, after in steps:
        sites = report["where"].get(str(done), [])
        assert len(sites) == in_step, f"{case}: step {done}: {in_step} reads, {len(sites)} sites recorded"
        ours = sorted(set(s for s in sites if _library(s) is None))
        assert not ours, f"{case}: step {done} read the host outside the known library sites: {ours}"
        summary = dict(Counter(sites))
        for lib, count in Counter(_library(s) for s in sites).items():
            most, last_step = ALLOWED[lib]
            assert most is None or count <= most, f"{case}: step {done}: {count} reads in {lib}: {summary}"
            assert last_step is None or done <= last_step, f"{case}: step {done} read in {lib}: {summary}"
        if done % log_every and done != len(steps):  # not a log step: the loop body reads nothing
            assert after == 0, f"{case}: {after} host reads after step {done}, not a log step"
    # The log steps do read (the loss, the metrics): the counter sees reads where there are some.
    assert steps[log_every - 1][2] > 0, f"{case}: the log step after step {log_every} read nothing: {steps}"
