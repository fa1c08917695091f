"""The demo's results as README states them: `python -m cluster.demo` run whole, its numbers read back.

    .venv/bin/python bench/demo.py --out bench/results/demo.json     # about 5 minutes on 2 cores

Runs the demo (shards, a local two-node Ray cluster, the five stages, the compare table) in a fresh
temporary folder, then reads from its MLflow store each eval stage's top-1 and few-shot accuracy, each
training stage's final loss and the preprocessing every stage ran with, and the position-embedding
similarity range of the fine-tuned model's figure. README's demo paragraph quotes these numbers and
tests/test_doc_numbers.py checks it against this file, so a change that moves them cannot leave README
stale. Wall time: the whole command, shards and cluster start included.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient
from provenance import write_result  # bench/provenance.py, beside this file

REPO = Path(__file__).resolve().parents[1]
EVAL_STAGES = {"eval_finetune": "finetune", "eval_scratch": "finetune_scratch"}
TRAIN_STAGES = ("pretrain", "finetune", "finetune_scratch")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the result JSON here (bench/results/demo.json)")
    p.add_argument("--size", default="full", help="cluster.demo --size (README quotes the full demo)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="vitpipe-bench-demo-") as tmp:
        run_dir, data = Path(tmp) / "runs", Path(tmp) / "data"
        cmd = [sys.executable, "-m", "cluster.demo", "--size", args.size, "--run-dir", str(run_dir)]
        t0 = time.perf_counter()
        done = subprocess.run([*cmd, "--data-dir", str(data)], cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            sys.exit(f"the demo failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
        client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
        experiment = client.get_experiment_by_name("demo")
        runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
        stages = {}
        for name in (*TRAIN_STAGES, *EVAL_STAGES):
            metrics, params = runs[name].data.metrics, runs[name].data.params
            saved = yaml.safe_load((run_dir / name / "config.yaml").read_text())
            stages[name] = {
                **{k: v for k, v in metrics.items() if k.startswith(("eval/", "fewshot/", "figures/"))},
                **({"final_loss": metrics["train/loss"]} if "train/loss" in metrics else {}),
                "data_mean": saved["data"]["mean"],
                "eval_interpolation": saved["eval"]["interpolation"],
                **({"steps": int(params["optim.steps"])} if name in TRAIN_STAGES else {}),
            }
    result = {
        "bench": "demo",
        "size": args.size,
        "wall_s": round(wall, 1),
        "stages": stages,
        "top1": {source: stages[name]["eval/top1"] for name, source in EVAL_STAGES.items()},
        "fewshot_10shot": {
            source: stages[name].get("fewshot/10shot") for name, source in EVAL_STAGES.items()
        },
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
