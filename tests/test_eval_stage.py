"""The eval stage (pipeline.eval.run): config rules, distributed == single-process, MLflow output.

    .venv/bin/python -m pytest tests/test_eval_stage.py          # about 1.5 minutes on 2 cores

Two exported vit_debug models (random weights, a non-zero head so logits differ): learned position
embedding with a class token, and relative position bias with average pooling. Two val splits of 27
images (not divisible by 2 ranks or by the batch of 8): one multi-label, one single-label. Each is
evaluated once under torchrun with 1 rank and once with 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.config import ConfigError, load_experiment, validate_config
from pipeline.tracking import RUN_ID_FILE, write_run_id

ROOT = Path(__file__).parents[1]
SCRIPT = "tests/scripts/eval_stage.py"
VAL_SIZE = 27  # 97 synthetic images at val_fraction 0.3 (the split is a hash of the key)
SOURCE_LOSSES = [(1, 9.0), (2, 7.5), (3, 6.0)]


def _stage(**extra) -> dict:
    return {"name": "e", "data": {"train": "d"}, **extra}


@pytest.mark.unit
def test_eval_stage_needs_init_from_and_a_loaded_head_for_classification():
    with pytest.raises(ConfigError, match="kind: eval needs model.init_from"):
        validate_config(_stage(kind="eval"))
    with pytest.raises(ConfigError, match="eval.classification .* needs model.init_head: true"):
        validate_config(_stage(kind="eval", model={"init_from": "x"}))
    cfg = validate_config(_stage(kind="eval", model={"init_from": "x"}, eval={"classification": False}))
    assert cfg.eval.fewshot_shots == [1, 5, 10, 25] and cfg.eval.fewshot_l2 == 2.0**10
    assert validate_config(_stage()).kind == "train"  # a train stage ignores the eval section


@pytest.mark.unit
def test_ablation_experiment_pairs_every_train_stage_with_an_eval_of_its_export(tmp_path):
    exp = load_experiment(ROOT / "configs/experiments/ablation_posemb.yaml", [f"run_dir={tmp_path}"])
    stages = dict(exp.stages)
    evals = [(n, c) for n, c in exp.stages if c.kind == "eval"]
    assert len(evals) == len(stages) - len(evals) >= 5
    for name, cfg in evals:
        source = name.removeprefix("eval_")
        assert cfg.model.init_from == str(tmp_path / source / "export")
        assert cfg.model.overrides == stages[source].model.overrides  # the same architecture


# ---------------------------------------------------------------- evaluations under torchrun


def _export(out: Path, overrides: dict, ema: bool = False) -> Path:
    """A random vit_debug export; with `ema`, a weight EMA beside it (another random head and blocks)."""
    from pipeline.models import create_model
    from pipeline.train.export import export_weights

    kwargs = {"img_size": 32, "num_classes": 8, "head_bias_init": 0.0, **overrides}
    model = create_model("vit_debug", **kwargs)
    torch.nn.init.normal_(model.head.weight, std=0.5)  # a zero head would tie every logit
    averaged = None
    if ema:
        other = create_model("vit_debug", **kwargs)
        torch.nn.init.normal_(other.head.weight, std=0.5)
        averaged = {k: v.detach() for k, v in other.named_parameters()}
    return export_weights(
        model.state_dict(), "vit_debug", kwargs, out / "export", step=3, ema=averaged, ema_decay=0.999
    ).parent


def _source_run(stage_dir: Path) -> str:
    """A tracked training run beside the export, as a train stage leaves one (its loss curve is drawn)."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{stage_dir / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("source"), run_name="source").info.run_id
    for step, loss in SOURCE_LOSSES:
        client.log_metric(run_id, "train/loss", loss, step=step)
    client.set_terminated(run_id)
    write_run_id(stage_dir / RUN_ID_FILE, run_id)
    return run_id


def _torchrun(nproc: int, out: Path, configs: list[Path]) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        SCRIPT,
        str(out),
        *map(str, configs),
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )  # minutes under a loaded full suite (309 s seen)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory) -> Path:
    """Run both eval stages with 1 and with 2 ranks: ROOT/world{1,2}/{multi,single}/eval.json."""
    from data_prep.synthetic import class_names, synthetic_samples
    from data_prep.writer import write_dataset

    root = tmp_path_factory.mktemp("eval_stage")
    torch.manual_seed(0)
    models = {
        "multi": ({"pos_embed": "learned", "pool": "cls"}, True),
        "single": ({"pos_embed": "relative", "pool": "gap"}, False),
    }
    configs = []
    for name, (overrides, multi_label) in models.items():
        data = root / f"data_{name}"
        samples = synthetic_samples(97, 8, seed=0, width=40, height=40, val_fraction=0.3)
        write_dataset(data, samples, class_names(8), multi_label, max_count=10)  # val shards: 10, 10, 7
        export = _export(root / f"train_{name}", overrides, ema=name == "single")
        if name == "multi":
            _source_run(export.parent)
        cfg = {
            "name": name,
            "kind": "eval",
            "model": {
                "name": "vit_debug",
                "init_from": str(export),
                "init_head": True,
                "overrides": overrides,
            },
            "data": {"train": str(data), "batch_size": 8, "num_workers": 1 if multi_label else 0},
            "objective": {"name": "supervised_sigmoid" if multi_label else "supervised_softmax"},
            "cluster": {"launcher": "local"},
            # One store per torchrun job: creating an MLflow SQLite schema costs seconds.
            "tracking": {"uri": f"sqlite:///{root}/mlflow_{{world}}.db", "system_metrics": False},
            "eval": {"fewshot_max_train": None},
        }
        configs.append(cfg)
    # The single export's EMA weights evaluated on their own (one rank): what its eval_ema/* must be.
    direct = {**configs[1], "name": "single_ema_direct"}
    direct["model"] = {
        **direct["model"],
        "init_from": str(root / "train_single" / "export" / "model_ema.safetensors"),
    }
    for world in (1, 2):
        paths = []
        for cfg in configs + ([direct] if world == 1 else []):
            cfg = {**cfg, "tracking": {**cfg["tracking"], "uri": cfg["tracking"]["uri"].format(world=world)}}
            path = root / f"world{world}_cfg" / f"{cfg['name']}.yaml"
            path.parent.mkdir(exist_ok=True)
            path.write_text(yaml.safe_dump(cfg))
            paths.append(path)
        _torchrun(world, root / f"world{world}", paths)
    return root


def _result(root: Path, world: int, name: str) -> dict:
    return json.loads((root / f"world{world}" / name / "eval.json").read_text())


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    "name, expected",
    [("multi", {"eval/map", "eval/precision_at_1"}), ("single", {"eval/top1", "eval/top5"})],
)
def test_two_ranks_give_the_single_process_result(evaluations, name, expected):
    one, two = _result(evaluations, 1, name), _result(evaluations, 2, name)
    assert (one["world_size"], two["world_size"]) == (1, 2)
    # Every val sample counted once, padding excluded, on either world size.
    assert one["eval_samples"] == two["eval_samples"] == VAL_SIZE
    metrics = one["metrics"]
    assert expected | {"fewshot/1shot", "fewshot/25shot", "probe/accuracy"} <= set(metrics)
    assert set(two["metrics"]) == set(metrics)
    for key, value in metrics.items():
        assert two["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    # Few-shot per seed, and on the same rows: the gathered features are put in key order.
    assert one["linear"]["train_samples"] == two["linear"]["train_samples"] > 0
    assert one["linear"]["fewshot"] == pytest.approx(two["linear"]["fewshot"], rel=1e-6, abs=1e-9)


@pytest.mark.dist
@pytest.mark.slow
def test_an_export_with_a_weight_ema_is_evaluated_twice_with_eval_ema_metrics_beside(evaluations):
    """The single export has EMA weights beside it: every metric again as eval_ema/* (fewshot/5shot ->
    eval_ema/fewshot/5shot), equal to an eval stage of the EMA weights file itself, and equal on 1 and 2 ranks
    (the loop of the test above). The multi export has none: no eval_ema/*."""
    single, direct = _result(evaluations, 1, "single"), _result(evaluations, 1, "single_ema_direct")
    raw = {k: v for k, v in single["metrics"].items() if not k.startswith("eval_ema/")}
    ema = {k: v for k, v in single["metrics"].items() if k.startswith("eval_ema/")}
    assert {"eval/top1", "eval/top5", "fewshot/5shot", "probe/accuracy"} <= set(raw)
    assert set(ema) == {"eval_ema/" + k.removeprefix("eval/") for k in raw}
    for key, value in direct["metrics"].items():
        assert ema["eval_ema/" + key.removeprefix("eval/")] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert "eval_ema/" not in "".join(direct["metrics"])  # the EMA file is not an export folder: once
    assert raw != pytest.approx({k: ema["eval_ema/" + k.removeprefix("eval/")] for k in raw})  # other weights
    assert single["ema"]["weights"].endswith("model_ema.safetensors")
    assert single["ema"]["eval_samples"] == VAL_SIZE
    assert not any(k.startswith("eval_ema/") for k in _result(evaluations, 1, "multi")["metrics"])


@pytest.mark.slow
def test_eval_stage_logs_metrics_and_figures_to_mlflow(evaluations):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{evaluations}/mlflow_1.db")
    runs = {
        r.info.run_name: r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
    }
    assert set(runs) == {"multi", "single", "single_ema_direct"}  # one run per stage: rank 0 alone writes
    multi, single = runs["multi"], runs["single"]
    for run, name in ((multi, "multi"), (single, "single")):
        assert run.info.status == "FINISHED"
        assert run.data.tags["kind"] == "eval" and run.data.params["kind"] == "eval"
        logged = {k: v for k, v in run.data.metrics.items() if not k.startswith("system/")}
        assert logged == pytest.approx(_result(evaluations, 1, name)["metrics"])
        assert [m.step for m in client.get_metric_history(run.info.run_id, "fewshot/5shot")] == [3]
    artifacts = {f.path for f in client.list_artifacts(multi.info.run_id, "figures")}
    assert artifacts == {
        "figures/pos_embed_similarity.png",
        "figures/patch_embed_components.png",
        "figures/mean_attention_distance.png",
        "figures/source_train_loss.png",
    }
    assert "config.yaml" in {f.path for f in client.list_artifacts(multi.info.run_id)}
    # A relative position bias has no absolute embedding to draw: skipped, with the reason as a tag.
    single_figures = {f.path for f in client.list_artifacts(single.info.run_id, "figures")}
    assert "figures/pos_embed_similarity.png" not in single_figures
    assert "figures/mean_attention_distance.png" in single_figures
    assert "no absolute position embedding" in single.data.tags["figure_skipped.pos_embed_similarity"]
    assert "figure_skipped.source_train_loss" in single.data.tags  # no tracked source stage
    for png in (evaluations / "world1" / "multi" / "figures").glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
