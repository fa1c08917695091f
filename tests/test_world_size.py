"""A stage checkpointed by N ranks continues on M (2 -> 1 and 1 -> 2), for ZeRO 0, 1, 2 and 3, with the real
DeepSpeed engine under torchrun: weights and optimizer states resharded exactly, the global batch and the
learning-rate schedule kept, the data stream re-dealt (its per-sample accounting: tests/test_redeal.py),
and the loss going on where it was.

    .venv/bin/python -m pytest tests/test_world_size.py -q
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ema_weights, history, torchrun, weights
from safetensors import safe_open

from pipeline.config import load_config
from pipeline.train import checkpoint
from pipeline.train.engine import lr_multiplier, peak_lr
from pipeline.train.loop import keep_global_batch, lr_rescale
from pipeline.train.tag import COMPLETE, tag_for

STAGES = (0, 1, 2, 3)
TAG = tag_for(4)


def moments(tag_dir: Path) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 weights and Adam moments in a tag, whatever number of ranks saved it.

    Converted with a killed conversion's leftover in the tag, as another node on a shared disk leaves it (its
    copy of the model states): DeepSpeed read its input folder recursively and failed on the second copy."""
    if any(tag_dir.glob("*optim_states.pt")) and not (tag_dir / "universal").exists():
        leftover = tag_dir / "universal.partial-othernode-1"
        leftover.mkdir(exist_ok=True)
        for f in tag_dir.glob("*model_states.pt"):
            shutil.copy(f, leftover)
    universal = checkpoint.to_universal(tag_dir)
    out = {}
    if universal is None:  # ZeRO-0: weights and optimizer whole in the model states
        state = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)
        out.update({f"{k}/fp32": v for k, v in state["module"].items()})
        optimizer = state["optimizer"]
        if "optimizer_state_dict" in optimizer:  # bf16/fp16: DeepSpeed's wrapper holds fp32 master copies
            out.update(
                {
                    f"group{g}/{i}/master": t
                    for g, ts in enumerate(optimizer["fp32_groups"])
                    for i, t in enumerate(ts)
                }
            )
            optimizer = optimizer["optimizer_state_dict"]
        for i, s in optimizer["state"].items():
            out.update({f"{i}/{k}": v for k, v in s.items() if torch.is_tensor(v)})
        return out
    for param in sorted(p for p in (universal / "zero").iterdir() if p.is_dir()):
        for f in ("fp32", "exp_avg", "exp_avg_sq"):
            saved = torch.load(param / f"{f}.pt", weights_only=False)
            out[f"{param.name}/{f}"] = saved["param"] if isinstance(saved, dict) else saved
    return out


def hyperparameters(tag_dir: Path) -> list[dict]:
    """Each optimizer parameter group's settings (weight decay, betas, learning rate) in rank 0's file."""
    files = sorted(tag_dir.glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    if not files:  # ZeRO-0: the optimizer lies in the model states
        state = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)["optimizer"]
        groups = state.get("optimizer_state_dict", state)["param_groups"]
    else:
        state = torch.load(files[0], weights_only=False)["optimizer_state_dict"]
        inner = state.get("base_optimizer_state") or state["optimizer_state_dict"]
        groups = inner["param_groups"]
    out = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in groups]
    assert len(out) == 2 and out[0]["weight_decay"] != out[1]["weight_decay"], out  # no-decay, decay
    return out


def adam_steps(tag_dir: Path) -> list[float]:
    """Adam's step count of every optimizer state in rank 0's file (a group's, a sub-group's or, ZeRO-0, a
    parameter's): a step count shared by several loses count (each increments it)."""
    files = sorted(tag_dir.glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    if not files:
        state = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)["optimizer"]
        states = state.get("optimizer_state_dict", state)["state"]
    else:
        state = torch.load(files[0], weights_only=False)["optimizer_state_dict"]
        states = (state.get("base_optimizer_state") or state["optimizer_state_dict"])["state"]
    return [float(s["step"]) for s in states.values()]


def assembled(files: list[Path]) -> dict[str, torch.Tensor]:
    """The whole weight EMA from every rank's file of a tag: each holds [start, stop) of some parameters."""
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name, (start, stop, numel) in json.loads(f.metadata()["ranges"]).items():
                out.setdefault(name, torch.full((numel,), float("nan")))[start:stop] = f.get_tensor(name)
    assert not any(t.isnan().any() for t in out.values()), "the ranks' files leave elements out"
    return out


def check(out: Path, stage: int, ranks_after: int, accum_after: int) -> None:
    root = out / f"zero{stage}"
    saved = root / "switch/checkpoints" / TAG
    resaved = root / "at4/checkpoints" / TAG
    assert json.loads((saved / COMPLETE).read_text())["world_size"] != ranks_after
    assert json.loads((resaved / COMPLETE).read_text())["world_size"] == ranks_after

    # Weights and optimizer moments loaded on the new world size are the saved ones, bit for bit.
    before, after = moments(saved), moments(resaved)
    # So are each parameter group's hyperparameters (DeepSpeed's ZeRO-3 universal loader gave every group
    # the first's: no weight decay anywhere).
    assert hyperparameters(saved) == hyperparameters(resaved)
    assert before.keys() == after.keys() and len(before) > 20
    for key in before:
        assert torch.equal(before[key], after[key]), f"ZeRO-{stage}: {key} changed in the reshard"
    exported = weights(root / "at4")
    # The weight EMA saved by the other world size, loaded on this one, exported at once: the saved one.
    ema_files = sorted(saved.glob("ema_rank_*_fp32.safetensors"))
    assert len(ema_files) == json.loads((saved / COMPLETE).read_text())["world_size"]
    assert len(list(resaved.glob("ema_rank_*_fp32.safetensors"))) == ranks_after
    saved_ema, ema = assembled(ema_files), ema_weights(root / "at4")
    assert saved_ema.keys() <= ema.keys() and len(saved_ema) > 20
    for name, tensor in saved_ema.items():
        assert torch.equal(ema[name].reshape(-1), tensor), (
            f"ZeRO-{stage}: EMA of {name} changed in the reshard"
        )
    fp32 = {k.removesuffix("/fp32"): v for k, v in before.items() if k.endswith("/fp32")}
    for name, tensor in exported.items():
        if name in fp32:
            # The export holds the fp32 master weights. ZeRO-0 under bf16 saves the module's bf16 weights,
            # which are those masters rounded (DeepSpeed copies them in after every step).
            reference = fp32[name].reshape(tensor.shape)
            assert torch.equal(tensor.to(reference.dtype), reference), name

    # The stream was re-dealt at step 4 with grad_accum adjusted: the global batch stays 32.
    final = root / "switch/checkpoints" / tag_for(8)
    record = json.loads((final / COMPLETE).read_text())
    assert (record["world_size"], record["grad_accum"], record["global_batch"]) == (
        ranks_after,
        accum_after,
        32,
    )
    # Four steps after the resume, every state's count is four more (ZeRO-0 under bf16 counts one more
    # throughout: DeepSpeed's wrapper initialises Adam's states with a step of zero gradients).
    (at4,) = set(adam_steps(saved))
    assert set(adam_steps(final)) == {at4 + 4}, (
        f"ZeRO-{stage}: Adam's steps {adam_steps(final)}, {at4} at step 4"
    )
    deal = torch.load(final / "rank_0.pt", weights_only=False)["extra"]["data"]
    assert (deal["world_size"], deal["grad_accum"], deal["base_step"]) == (ranks_after, accum_after, 4)
    for r in range(1, ranks_after):  # the stream's position is written once per checkpoint, by rank 0
        assert torch.load(final / f"rank_{r}.pt", weights_only=False)["extra"] == {}

    # The learning rate follows the schedule of the uninterrupted run; the loss goes on from where it was.
    lr = dict(history(root / "switch", "train/lr"))
    cfg = load_config("configs/experiments/smoke.yaml", ["optim.steps=8", "optim.warmup_steps=2"])
    peak = peak_lr(cfg, 2)  # global batch 32 either way
    for step in range(1, 9):
        assert math.isclose(lr[step], peak * lr_multiplier(step, 2, 8, "cosine"), rel_tol=1e-9), step
    loss = dict(history(root / "switch"))
    assert sorted(loss) == list(range(1, 9))
    assert all(math.isfinite(v) for v in loss.values())
    # Per-step losses of this tiny run swing by 15% with the batch; over the 4 steps after the switch the
    # mean stays with the uninterrupted run's (a reshard that broke the weights would not). One stage per
    # test runs the uninterrupted run (the weights check above is the exact one).
    if (root / "straight").is_dir():
        straight = dict(history(root / "straight"))
        mean = sum(loss[s] for s in range(5, 9)) / 4
        expected = sum(straight[s] for s in range(5, 9)) / 4
        assert abs(mean - expected) < 0.15 * expected, (mean, expected)


def read_in_parts(log: str, saved: int, ranks: int, stages: int = 3) -> None:
    """ZeRO 1-3 (the stages with partitioned optimizer states) each resumed twice in the log, every time by
    reading each rank's part, never by DeepSpeed's whole-tag conversion."""
    said = f"saved by {saved} ranks; resharding it for {ranks} (each rank reading its part)"
    assert log.count(said) == 2 * stages and "cannot be read in parts" not in log, log[-3000:]


def copy_stopped(out: Path, stages=STAGES) -> None:
    for stage in stages:
        shutil.copytree(out / f"zero{stage}/switch", out / f"zero{stage}/at4")


@pytest.mark.timeout(1800)
def test_two_ranks_resume_on_one_per_zero_stage(smoke_dataset, tmp_path):
    torchrun("tests/scripts/world_size.py", "save", str(tmp_path), str(smoke_dataset), *map(str, STAGES))
    copy_stopped(tmp_path)
    out = torchrun(
        "tests/scripts/world_size.py", "resume", str(tmp_path), str(smoke_dataset), *map(str, STAGES), nproc=1
    )
    read_in_parts(out.stdout + out.stderr, 2, 1)
    for stage in STAGES:
        check(tmp_path, stage, ranks_after=1, accum_after=2)


@pytest.mark.timeout(1800)
def test_one_rank_resumes_on_two_per_zero_stage_in_bf16(smoke_dataset, tmp_path):
    """The other way, in the GPU recipe's precision (bf16 weights; fp32 master copies and moments)."""
    args = [str(tmp_path), str(smoke_dataset), *map(str, (3, 0, 1, 2)), "deepspeed.precision=bf16"]
    torchrun("tests/scripts/world_size.py", "save", *args, "deepspeed.grad_accum=2", nproc=1)
    copy_stopped(tmp_path)
    out = torchrun("tests/scripts/world_size.py", "resume", *args)
    read_in_parts(out.stdout + out.stderr, 1, 2)
    assert (tmp_path / "zero3/straight").is_dir()
    for stage in STAGES:
        check(tmp_path, stage, ranks_after=2, accum_after=1)


def test_a_global_batch_the_new_world_cannot_make_names_the_numbers():
    cfg = load_config("configs/experiments/smoke.yaml", ["deepspeed.grad_accum=1"])
    saved = {"step": 40, "world_size": 2, "global_batch": 32}
    assert keep_global_batch(cfg, saved, 2) == (cfg, 32)
    assert keep_global_batch(cfg, saved, 1)[0].deepspeed.grad_accum == 2
    with pytest.raises(
        ValueError,
        match=r"on 2 ranks, keeping a global batch of 32; on 3 ranks .* 3 x 16 does not divide 32, and the "
        r"nearest, 48, is 50.00% off \(deepspeed.global_batch_tolerance: 0.02\). Resume on a number of ranks "
        r"that does \(1-2\)$",
    ):
        keep_global_batch(cfg, saved, 3)


def test_one_node_of_128_lost_keeps_the_global_batch_within_the_tolerance_and_scales_the_lr(caplog):
    """16,384 on 1,016 ranks (micro-batch 16): no grad_accum makes it; grad_accum 1 makes 16,256 (-0.78%),
    within the default 2%, and optim.lr scales by 16,256 / 16,384 (optim.base_lr scales by itself). The
    checkpoint of that run keeps 16,384 as its target: back on 1,024 ranks, or on 1,016 again, the same."""
    cfg = load_config("configs/experiments/smoke.yaml", ["deepspeed.grad_accum=1", "optim.lr=0.004"])
    saved = {"step": 900, "world_size": 1024, "global_batch": 16384, "grad_accum": 1, "config_grad_accum": 1}
    with caplog.at_level("WARNING", logger="pipeline.train.loop"):
        run, target = keep_global_batch(cfg, saved, 1016)
    assert (run.deepspeed.grad_accum, target) == (1, 16384)
    assert math.isclose(run.optim.lr, 0.004 * 16256 / 16384, rel_tol=1e-12)
    assert "16 x 1 x 1016 = 16256 (-0.78%) runs, the learning rate scaled by 0.99219" in caplog.text
    again = {**saved, "world_size": 1016, "global_batch": 16256, "target_global_batch": 16384}
    assert keep_global_batch(cfg, again, 1016)[0].optim.lr == run.optim.lr  # its own shape again
    back, target = keep_global_batch(cfg, again, 1024)
    assert (back.deepspeed.grad_accum, back.optim.lr, target) == (1, 0.004, 16384)
    # a grad_accum changed in the config since: the config's global batch, as on any same-size resume
    changed = load_config("configs/experiments/smoke.yaml", ["deepspeed.grad_accum=2"])
    assert keep_global_batch(changed, again, 1016) == (changed, 16 * 2 * 1016)
    blr = load_config("configs/experiments/smoke.yaml", ["optim.base_lr=0.001"])
    run, _ = keep_global_batch(blr, {**saved, "config_grad_accum": 1}, 1016)
    assert math.isclose(peak_lr(run, 1016), 0.001 * 16256 / 256) and run.optim.base_lr == 0.001
    assert keep_global_batch(cfg, saved, 512)[0].optim.lr == 0.004  # half the nodes: grad_accum 2, exactly
    with pytest.raises(
        ValueError, match=r"the nearest, 11200, is 31.64% off .* that does \(335-348, 502-522, 1004-1044\)$"
    ):
        keep_global_batch(cfg, saved, 700)


def test_lr_rescale_moves_a_restored_schedule_with_the_global_batch():
    """A schedule restored from a checkpoint saved at global batch 20, run at 16: its base, its current rate
    and the optimizer's initial_lr all x 0.8, and the steps after follow the scaled schedule."""
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.AdamW([{"params": params, "lr": 1e-3}, {"params": [], "lr": 5e-4}])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s, 2, 8, "cosine"))
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert lr_rescale(scheduler, {"global_batch": 16}, 16) == 1.0
    assert lr_rescale(scheduler, {"global_batch": 20}, 16) == 0.8
    assert [g["initial_lr"] for g in optimizer.param_groups] == pytest.approx([8e-4, 4e-4])
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(
        [8e-4 * lr_multiplier(4, 2, 8, "cosine"), 4e-4 * lr_multiplier(4, 2, 8, "cosine")]
    )
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(8e-4 * lr_multiplier(5, 2, 8, "cosine"))


@pytest.mark.timeout(900)
def test_a_world_size_no_grad_accum_fits_runs_the_nearest_global_batch_with_the_lr_scaled(
    smoke_dataset, tmp_path
):
    """One node lost, in small, with the real engine: a global batch of 20 (micro-batch 4 x grad_accum 5 on
    1 rank) has no grad_accum on 2 ranks (20 / 8 = 2.5). With the tolerance at 25% steps 5-6 run on 2 ranks
    at 16 with the learning rate x 0.8; steps 7-8, back on 1 rank, at 20 with the rate as scheduled."""
    args = ["tests/scripts/world_size.py", "go", str(tmp_path), str(smoke_dataset), "2", "data.batch_size=4"]
    args += ["deepspeed.grad_accum=5", "deepspeed.global_batch_tolerance=0.25", "checkpoint.keep_last=3"]
    torchrun(*args, "debug.stop_at_step=4", nproc=1)
    torchrun(*args, "debug.stop_at_step=6", nproc=2)
    torchrun(*args, nproc=1)
    run = tmp_path / "zero2/go"
    records = {s: json.loads((run / "checkpoints" / tag_for(s) / COMPLETE).read_text()) for s in (4, 6, 8)}
    shape = {
        s: tuple(r[k] for k in ("world_size", "grad_accum", "global_batch", "target_global_batch"))
        for s, r in records.items()
    }
    assert shape == {4: (1, 5, 20, 20), 6: (2, 2, 16, 20), 8: (1, 5, 20, 20)}
    lr = dict(history(run, "train/lr"))
    peak = peak_lr(
        load_config("configs/experiments/smoke.yaml", ["data.batch_size=4", "deepspeed.grad_accum=5"]), 1
    )
    scale = {5: 0.8, 6: 0.8}
    for step in range(1, 9):
        expected = peak * scale.get(step, 1.0) * lr_multiplier(step, 2, 8, "cosine")
        assert math.isclose(lr[step], expected, rel_tol=1e-9), (step, lr[step], expected)
    loss = dict(history(run))
    assert sorted(loss) == list(range(1, 9)) and all(math.isfinite(v) for v in loss.values())


def test_an_elastic_stage_keeps_the_global_batch_of_its_largest_size():
    smoke = "configs/experiments/smoke.yaml"  # micro-batch 16
    with pytest.raises(ValueError, match=r"cannot be kept on 3 workers .*sizes that fit: \[1, 2, 4\]"):
        load_config(smoke, ["cluster.num_workers=[1,4]"])  # 16 x 1 x 4 = 64: not on 3 workers
    cfg = load_config(smoke, ["cluster.num_workers=[1,4]", "deepspeed.grad_accum=3"])  # 192 on every size
    assert [keep_global_batch(cfg, None, w)[0].deepspeed.grad_accum for w in (1, 2, 3, 4)] == [12, 6, 4, 3]
    # 1,016 to 1,024 workers: each within the tolerance of 16 x 1 x 1,024
    elastic = load_config(smoke, ["cluster.num_workers=[1016,1024]"])
    assert [keep_global_batch(elastic, None, w)[0].deepspeed.grad_accum for w in (1016, 1020, 1024)] == [
        1,
        1,
        1,
    ]
    saved = {"step": 8, "world_size": 1, "global_batch": 192, "grad_accum": 12}
    assert keep_global_batch(cfg, saved, 1)[0].deepspeed.grad_accum == 12  # the same size again: still 192
    assert keep_global_batch(cfg, saved, 2)[0].deepspeed.grad_accum == 6
