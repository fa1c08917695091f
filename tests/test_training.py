"""The training loop on 2 gloo ranks: exact resume per ZeRO stage, checkpoint safety, MLflow contents."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (  # shared with the other torchrun tests
    assert_loss_fell,
    ema_weights,
    history,
    torchrun,
    weights,
)
from mlflow.tracking import MlflowClient

ROOT = Path(__file__).parents[1]


@pytest.mark.dist
@pytest.mark.slow
def test_resume_is_bitwise_exact_per_zero_stage(smoke_dataset, tmp_path):
    stages = (0, 2, 3)
    torchrun("tests/scripts/resume_exactness.py", str(tmp_path), str(smoke_dataset), *map(str, stages))
    for stage in stages:
        base = tmp_path / f"zero{stage}"
        straight, resumed, control = (history(base / n) for n in ("straight", "resumed", "no_optimizer"))
        assert [s for s, _ in straight] == list(range(1, 9))
        # The resumed stage continued its MLflow run and logged each step exactly once.
        assert [s for s, _ in resumed] == list(range(1, 9)), f"ZeRO-{stage}: steps logged {resumed}"
        assert resumed == straight, f"ZeRO-{stage}: losses differ after resume"
        w_straight, w_resumed = weights(base / "straight"), weights(base / "resumed")
        assert w_straight.keys() == w_resumed.keys()
        assert all(torch.equal(w_straight[k], w_resumed[k]) for k in w_straight), (
            f"ZeRO-{stage}: weights differ"
        )
        # The weight EMA (decay 0.9) went on from its checkpointed share: the uninterrupted one, bit for bit,
        # and not the weights themselves.
        e_straight, e_resumed = ema_weights(base / "straight"), ema_weights(base / "resumed")
        assert e_straight.keys() == w_straight.keys()
        assert all(torch.equal(e_straight[k], e_resumed[k]) for k in e_straight), f"ZeRO-{stage}: EMA differs"
        assert any(not torch.equal(e_straight[k], w_straight[k]) for k in e_straight)
        # Negative control: dropping the optimizer state at resume must change the result.
        assert control[:4] == straight[:4]
        assert control[4:] != straight[4:], f"ZeRO-{stage}: the negative control did not differ"
        assert any(not torch.equal(w_straight[k], v) for k, v in weights(base / "no_optimizer").items())


@pytest.mark.dist
@pytest.mark.slow
def test_every_objective_trains_and_its_loss_falls(every_step_dataset, tmp_path):
    # 32 images seen at every step, whole-image crops, lr 0.05: each objective ends at 0.25-0.66 of its
    # first loss, far past the bar of 0.9 on any CPU, while lr 1e-9 stays at 1.0 (tests/scripts/
    # objectives.py gives the measurements). On the 320-image smoke corpus the Mixup/CutMix softmax
    # run ended at 0.92-0.95, too close to a bar for another machine's rounding.
    names = ["supervised_softmax", "supervised_sigmoid", "mae", "masked_patch_prediction", "distill"]
    torchrun("tests/scripts/objectives.py", str(tmp_path), str(every_step_dataset), *names)
    for name in names:
        losses = [v for _, v in history(tmp_path / name)]
        assert len(losses) == 40
        assert_loss_fell(losses, name)
    # The distillation student really looked at its teacher.
    agreement = [v for _, v in history(tmp_path / "distill", "train/teacher_agreement")]
    assert len(agreement) == 40
    # MAE exports its encoder as a plain ViT that fine-tuning loads.
    exported = weights(tmp_path / "mae")
    assert "pos_embed" in exported and not any(k.startswith(("decoder", "encoder.")) for k in exported)


def _flip_byte(path: Path, offset: int = 200) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.dist
def test_a_loss_gone_nan_stops_every_rank_before_a_checkpoint_holds_it(smoke_dataset, tmp_path):
    """bf16 under ZeRO-2, where DeepSpeed checks no overflow and a NaN gradient makes the weights NaN. Rank 1's
    loss made NaN at step 6 (`debug.nan_*`), a save step between log steps (every 4): both ranks stop there,
    each naming what it found (rank 0 its NaN weights) and what to change; step_3 stays the newest checkpoint
    and the run is FAILED. Resumed with the NaN at step 8 (a log step, the last): from step_3, step 6 saved,
    the NaN loss logged at step 8, and neither its checkpoint nor the export written. In fp32, where
    DeepSpeed skips such a step and the weights stay finite, a NaN at step 5 (neither a log nor a save step)
    stops the stage at the save of step 6 all the same."""
    run_dir = tmp_path / "run"
    # torchrun checks its ranks every 5 s (not 0.1): rank 0 ends by itself, not stopped for rank 1's exit
    args = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--monitor-interval=5",
        "-m", "pipeline.train.launch", "configs/experiments/smoke.yaml", "cluster.launcher=local",
        f"data.train={smoke_dataset}", "optim.steps=8", "tracking.log_every=4", "checkpoint.every_steps=3",
        "checkpoint.keep_last=3", "tracking.system_metrics=false", "debug.nan_rank=1",
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}

    def stage(*extra: str) -> tuple[str, dict[int, str]]:
        """The run's output, and each rank's NonFiniteLoss message."""
        proc = subprocess.run([*args, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out[-3000:]
        found = re.findall(r"\[rank(\d)\]: pipeline\.train\.loop\.NonFiniteLoss: \[smoke\] (.*)", out)
        return out, {int(rank): message for rank, message in found}

    bf16 = [f"run_dir={run_dir}", "deepspeed.precision=bf16"]
    out, errors = stage(*bf16, "debug.nan_at_step=6")
    assert errors[1].startswith("step 6: rank 1's training loss is nan"), out[-5000:]
    assert "rank 1's share of the fp32 weights is not finite" in errors[1], errors[1]
    assert errors[0].startswith("step 6: the gradient norm is inf"), out[-5000:]
    assert "rank 0's share of the fp32 weights is not finite" in errors[0], errors[0]
    assert "lower the learning rate (optim.base_lr or optim.lr)" in errors[0] and "steps 5-6" in errors[0]
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000003"], out[-3000:]
    assert (ckpts / "latest").read_text() == "step_00000003"
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [4]

    out, errors = stage(*bf16, "debug.nan_at_step=8")
    assert "resumed from step_00000003" in out, out[-5000:]
    for rank in (0, 1):
        assert errors[rank].startswith(
            "step 8: the training loss summed over the step's micro-batches and the 2 ranks is nan"
        ), out[-5000:]
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000003", "step_00000006"]
    assert not (run_dir / "export").exists()
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert run.info.status == "FAILED" and sorted(loss) == [4, 8], loss
    assert math.isfinite(loss[4]) and math.isnan(loss[8]), loss

    fp32 = tmp_path / "fp32"
    out, errors = stage(f"run_dir={fp32}", "deepspeed.precision=fp32", "debug.nan_at_step=5")
    for rank in (0, 1):
        assert (
            errors[rank].startswith("step 6: ")
            and "DeepSpeed skipped 1 of the steps after step 4" in errors[rank]
        ), out[-5000:]
        assert "weights" not in errors[rank].split(".")[0], errors[rank]  # they stayed finite
    assert sorted(p.name for p in (fp32 / "checkpoints").glob("step_*")) == ["step_00000003"]
    assert not (fp32 / "export").exists()
    client = MlflowClient(f"sqlite:///{fp32 / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FAILED"


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_falls_back_past_a_corrupt_checkpoint(smoke_dataset, tmp_path):
    """SIGTERM mid-run leaves a checkpoint; a corrupted newest checkpoint is skipped; MLflow stays one run."""
    run_dir = tmp_path / "run"
    # Two ranks under torchrun, launched from the same config as every other launcher.
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "pipeline.train.launch",
        "configs/experiments/smoke.yaml",
        "cluster.launcher=local",
        f"run_dir={run_dir}",
        f"data.train={smoke_dataset}",
        "optim.steps=40",
        "checkpoint.every_steps=3",
        "checkpoint.keep_last=3",
        "data.num_workers=1",
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1"}
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.time() + 300
    for line in proc.stdout:
        # Progress lines come every 1/20 of the steps (2 here): stop at the first one at or past step 7.
        if (line.startswith("step ") and int(line.split()[1].split("/")[0]) >= 7) or time.time() > deadline:
            proc.send_signal(signal.SIGTERM)
            break
    out = proc.stdout.read()
    # torchrun forwards SIGTERM to both ranks; they agree, checkpoint, and exit 143 (torchrun reports 1).
    assert proc.wait(timeout=120) != 0, out[-3000:]
    stopped = int(out.split("stopped at step ")[1].split(":")[0])
    assert stopped >= 7
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert ckpts[-1] == f"step_{stopped:08d}" and len(ckpts) == 3  # keep_last
    assert (run_dir / "checkpoints" / "latest").read_text() == ckpts[-1]
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "KILLED"

    # Corrupt the newest checkpoint: resume must fall back to the one before, with a warning.
    _flip_byte(run_dir / "checkpoints" / ckpts[-1] / "mp_rank_00_model_states.pt")
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert (
        f"skipping checkpoint {run_dir / 'checkpoints' / ckpts[-1]}" in log
        and "does not match its sha256" in log
    )
    assert f"resumed from {ckpts[-2]}" in log

    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == list(range(1, 41))  # each step once, though steps after the fallback point ran twice
    metrics = set(run.data.metrics)
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/images_per_s",
        "perf/tflops_per_device",
        "data/skipped_samples",
        "data/wait_fraction",
        "train/precision_at_1",
    } <= metrics
    assert "perf/mfu" not in metrics  # a CPU has no peak in the table, and none was configured
    assert any(m.startswith("system/") for m in metrics), sorted(metrics)
    tags = run.data.tags
    assert (
        tags["objective"] == "supervised_sigmoid"
        and tags["world_size"] == "2"
        and tags["variant"] == "vit_debug"
    )
    assert tags["code_version"] and tags["checkpoint"].endswith("step_00000040")
    assert Path(tags["export"]).is_file() and tags["export"].endswith("model.safetensors")
    assert run.data.params["optim.steps"] == "40" and int(run.data.params["derived.flops_per_image"]) > 0


@pytest.mark.unit
def test_tracker_marks_a_failed_stage_failed(tmp_path):
    from pipeline.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(RuntimeError), Tracker(uri, "exp", "stage", enabled=True) as t:
        t.log_metrics({"train/loss": 1.0}, step=1)
        raise RuntimeError("boom")
    client = MlflowClient(uri)
    assert client.get_run(t.run_id).info.status == "FAILED"
    # Off rank 0 nothing is written.
    quiet = Tracker(uri, "exp", "stage", enabled=False)
    quiet.log_metrics({"x": 1.0}, step=1)
    assert (
        quiet.run_id is None
        and len(client.search_runs([client.get_experiment_by_name("exp").experiment_id])) == 1
    )


def test_a_stage_run_is_found_by_its_checkpoint_uri(tmp_path):
    """A stage resumed on a node that never held its run-id file (or the driver on the head) finds its
    MLflow run through the checkpoint URI the run is tagged with."""
    from pipeline.tracking import CHECKPOINT_URI_TAG, Tracker, find_stage_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for stage in ("pretrain", "finetune"):
        with Tracker(uri, "exp", stage, enabled=True, tags={CHECKPOINT_URI_TAG: f"s3://b/exp/{stage}"}) as t:
            t.log_metrics({"train/loss": 1.0}, step=1)
        if stage == "pretrain":
            pretrain = t.run_id
    assert find_stage_run(uri, "exp", "s3://b/exp/pretrain") == pretrain
    assert find_stage_run(uri, "exp", "s3://b/exp/other") is None
    assert find_stage_run(uri, "no_such_experiment", "s3://b/exp/pretrain") is None


@pytest.mark.unit
def test_progress_lines_come_at_a_readable_rate():
    from pipeline.train.loop import PROGRESS_LINES, PROGRESS_MAX_SILENCE_S, progress_due

    def printed(total: int, start: int = 0, seconds_per_step: float = 0.1) -> list[int]:
        lines, last = [], None
        for done in range(start + 1, total + 1):  # log_every 1: every step is a log step
            since = (done - last) * seconds_per_step if last else 0.0
            if progress_due(done, total, last, since):
                lines.append(done)
                last = done
        return lines

    # About PROGRESS_LINES per stage (plus the first), the last step always; short runs print every step.
    assert len(printed(1000)) == PROGRESS_LINES + 1 and printed(1000)[:3] == [1, 50, 100]
    assert printed(1000)[-1] == 1000 and printed(15) == list(range(1, 16))
    assert printed(1000, start=730)[:2] == [731, 750]  # a resumed stage says so at once
    # A long, slow run still prints at least once every PROGRESS_MAX_SILENCE_S.
    slow = printed(100_000, seconds_per_step=PROGRESS_MAX_SILENCE_S / 10)
    assert slow[:3] == [1, 11, 21]


@pytest.mark.dist
@pytest.mark.slow
def test_export_is_assembled_in_memory_and_equals_zero_to_fp32(smoke_dataset, tmp_path):
    """The export needs no checkpoint file of another rank (on a cluster they lie on other nodes): every rank
    assembles the fp32 weights by collectives; the result equals DeepSpeed's zero_to_fp32 over the files."""
    out = tmp_path / "report.json"
    torchrun(
        "tests/scripts/export_consolidation.py",
        str(out),
        str(smoke_dataset),
        str(tmp_path / "runs"),
        "1",
        "2",
        "3",
    )
    report = json.loads(out.read_text())
    assert set(report) == {"1", "2", "3"}
    for stage, r in report.items():
        assert r["keys"] > 50 and not r["missing"] and not r["unexpected"], (stage, r)
        assert r["max_abs_diff"] == 0.0, (stage, r)
