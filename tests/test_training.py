"""The training loop on 2 gloo ranks: exact resume per ZeRO stage, checkpoint safety, MLflow contents."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from data_prep.synthetic import class_names, synthetic_samples
from data_prep.writer import write_dataset

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def smoke_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("smokedata")
    write_dataset(root, synthetic_samples(320, 8, seed=0, width=48, height=40), class_names(8), True, 40)
    return root


def torchrun(*args: str, nproc: int = 2, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def history(run_dir: Path, metric: str = "train/loss") -> list[tuple[int, float]]:
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, f"{run_dir}: expected one MLflow run, found {len(runs)}"
    return [(m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, metric)]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "export" / "model.safetensors"))


@pytest.mark.dist
@pytest.mark.slow
def test_resume_is_bitwise_exact_per_zero_stage(smoke_data, tmp_path):
    stages = (0, 2, 3)
    torchrun("tests/scripts/resume_exactness.py", str(tmp_path), str(smoke_data), *map(str, stages))
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
        # Negative control: dropping the optimizer state at resume must change the result.
        assert control[:4] == straight[:4]
        assert control[4:] != straight[4:], f"ZeRO-{stage}: the negative control did not differ"
        assert any(not torch.equal(w_straight[k], v) for k, v in weights(base / "no_optimizer").items())
