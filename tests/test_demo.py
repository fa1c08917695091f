"""The reduced demo: the same journey as `make demo` (shards, local Ray, ray job submit, compare), shorter."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

ROOT = Path(__file__).parents[1]
# A worker's progress line as the job log shows it: "(RayTrainWorker pid=N) step 3/8 loss ..." (ANSI inside).
PROGRESS_LINE = re.compile(r"RayTrainWorker pid=\d+.* step \d+/\d+ loss")


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(3600)  # a hang guard only: under the suite's full load the first run has taken 26 min
def test_reduced_demo_runs_end_to_end(tmp_path):
    run_dir, data = tmp_path / "runs", tmp_path / "data"
    cmd = [
        sys.executable,
        "-m",
        "cluster.demo",
        "--size",
        "small",
        "--run-dir",
        str(run_dir),
        "--data-dir",
        str(data),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for stage in ("pretrain", "finetune", "eval_finetune", "finetune_scratch", "eval_scratch"):
        assert (run_dir / stage / "DONE.json").is_file(), stage
    # The compare table, the figures and the MLflow UI command are printed.
    assert "eval/top1" in out and "MLflow UI:" in out and "figures:" in out
    # A log a user can read: each worker line once, no Ray start-up error, a table that fits 120 columns.
    progress = [line for line in proc.stdout.splitlines() if PROGRESS_LINE.search(line)]
    assert progress and len(progress) == len(set(progress)), "\n".join(progress)
    assert "PreemptionWatcher" not in out and "core_worker.cc" not in out, out[-6000:]
    assert "multiple active Ray instances" not in out, out[-6000:]  # other local clusters (the suite's)
    table = proc.stdout.split("$ vitpipe compare")[1].split("\nfigures:")[0].strip().splitlines()[1:]
    assert table and max(map(len, table)) <= 120, "\n".join(table)
    assert list((run_dir / "eval_finetune" / "figures").glob("*.png"))
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("demo")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert (
        runs["demo"].info.status == "FINISHED"
        and 0.0 <= runs["eval_finetune"].data.metrics["eval/top1"] <= 1.0
    )
    # Input statistics: MAE's (ImageNet) through its export into the fine-tuning and its evaluation; the
    # scratch ViT's own family's (0.5, as big_vision and timm's AugReg weights); each export records them.
    imagenet, half = [0.485, 0.456, 0.406], [0.5, 0.5, 0.5]
    for stage, mean in (("pretrain", imagenet), ("finetune", imagenet), ("finetune_scratch", half)):
        recorded = json.loads((run_dir / stage / "export" / "model.json").read_text())["preprocessing"]
        assert recorded["mean"] == mean and recorded["interpolation"] == "bicubic", (stage, recorded)
    for stage, mean in (("eval_finetune", imagenet), ("eval_scratch", half)):
        saved = yaml.safe_load((run_dir / stage / "config.yaml").read_text())
        assert saved["data"]["mean"] == mean and saved["eval"]["interpolation"] == "bicubic", stage
        assert runs[stage].data.params["data.mean"] == str(mean)  # logged as the run's params
    # Re-running reuses the shards and the finished stages, and starts no Ray cluster for them.
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert "$ vitpipe shard" not in again.stdout and again.stdout.count("already finished") == 5
    assert "starting a local Ray cluster" not in again.stdout and "eval/top1" in again.stdout


@pytest.mark.unit
def test_the_demo_runs_on_the_cpu_where_the_gpus_are_fewer_than_its_workers():
    """cluster.local offers a machine's GPUs on its head only: the demo's two workers use GPUs with two or
    more, the CPU with none (use_gpu: auto) or one (set, else auto would wait for a second GPU)."""
    from cluster.demo import CONFIG, device_overrides
    from pipeline.config import load_experiment

    assert device_overrides(0, 2) == [] and device_overrides(2, 2) == [] and device_overrides(8, 2) == []
    assert device_overrides(1, 2) == ["cluster.use_gpu=false"]
    stages = load_experiment(ROOT / CONFIG, device_overrides(1, 2)).stages
    assert stages and all(cfg.cluster.use_gpu is False and cfg.cluster.max_workers == 2 for _, cfg in stages)
