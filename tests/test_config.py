from pathlib import Path

import pytest
import torch
import yaml

from pipeline.config import ConfigError, flatten, load_config, load_experiment, save_resolved, validate_config
from pipeline.models import create_model
from pipeline.train.engine import peak_lr

pytestmark = pytest.mark.unit
SMOKE = Path(__file__).parents[1] / "configs/experiments/smoke.yaml"


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


def test_smoke_config_is_valid_and_typed():
    cfg = load_config(SMOKE)
    assert cfg.name == "smoke"
    assert cfg.deepspeed.zero_stage == 2
    assert cfg.cluster.num_workers == 2
    assert (cfg.optim.lr, cfg.optim.base_lr) == (None, 0.02)  # batch-scaled: 2.5e-3 at 2 x 16
    assert cfg.data.synthetic is not None and cfg.data.synthetic.num == 320


def test_misspelled_key_names_file_path_and_allowed_keys(tmp_path):
    p = write(tmp_path, "name: x\ndata: {train: d}\noptim: {lrr: 0.1}\n")
    with pytest.raises(ConfigError) as err:
        load_config(p)
    msg = str(err.value)
    assert str(p) in msg
    assert "optim.lrr: unknown key" in msg
    assert "did you mean 'lr'" in msg
    assert "weight_decay" in msg  # the allowed keys are listed


def test_wrong_type_names_key_and_expectation(tmp_path):
    p = write(tmp_path, "name: x\ndata: {train: d, batch_size: many}\n")
    with pytest.raises(ConfigError, match=r"data\.batch_size: .*integer.*'many'"):
        load_config(p)


def test_wrong_literal_lists_choices(tmp_path):
    p = write(tmp_path, "name: x\ndata: {train: d}\ndeepspeed: {zero_stage: 4}\n")
    with pytest.raises(ConfigError, match=r"deepspeed\.zero_stage: .*0, 1, 2 or 3"):
        load_config(p)


def test_missing_required_key(tmp_path):
    p = write(tmp_path, "name: x\n")
    with pytest.raises(ConfigError, match=r"data: required key is missing"):
        load_config(p)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_nested_overrides_are_parsed_and_validated():
    cfg = load_config(SMOKE, ["optim.base_lr=3e-4", "cluster.num_workers=3", "model.overrides.pool=gap"])
    assert cfg.optim.base_lr == pytest.approx(3e-4)
    assert cfg.cluster.num_workers == 3
    assert cfg.model.overrides == {"pool": "gap"}
    with pytest.raises(ConfigError, match=r"cluster\.num_wrkers: unknown key"):
        load_config(SMOKE, ["cluster.num_wrkers=3"])
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        load_config(SMOKE, ["optim.lr"])
    with pytest.raises(ConfigError, match=r"optim\.base_lr is a float, not a section"):
        load_config(SMOKE, ["optim.base_lr.x=1"])


def test_lr_is_the_peak_as_given_and_base_lr_scales_with_the_global_batch(tmp_path):
    """optim.lr is taken as given, whatever the batch (timm, OpenCLIP, big_vision); optim.base_lr is MAE's
    blr, lr = base_lr * global_batch / 256; neither is lr 1e-3; both, or the old scale_lr, is an error that
    says what to write."""
    # The smoke config's base_lr 0.02 at batch 16 per rank: 2.5e-3 on 2 ranks, 5e-3 on 4 (or 2 x accum 2).
    smoke = load_config(SMOKE)
    assert peak_lr(smoke, 2) == pytest.approx(2.5e-3) and peak_lr(smoke, 4) == pytest.approx(5e-3)
    assert peak_lr(load_config(SMOKE, ["deepspeed.grad_accum=2"]), 2) == pytest.approx(5e-3)
    given = load_config(SMOKE, ["optim.lr=3e-4", "optim.base_lr=null"])
    assert (given.optim.lr, given.optim.base_lr) == (3e-4, None)
    assert peak_lr(given, 2) == peak_lr(given, 1024) == 3e-4
    default = load_config(write(tmp_path, "name: x\ndata: {train: d}\n"))
    assert default.optim.lr == 1e-3 and peak_lr(default, 8) == 1e-3
    # A more specific layer's choice replaces the other way: an override, a stage's own section.
    override = load_config(SMOKE, ["optim.lr=3e-4"])
    assert (override.optim.lr, override.optim.base_lr) == (3e-4, None)
    exp = write(
        tmp_path,
        "name: e\ndefaults: {data: {train: d}, optim: {base_lr: 0.1}}\n"
        "stages:\n  a: {}\n  b: {optim: {lr: 0.001}}\n",
    )
    stages = dict(load_experiment(exp, ["stages.a.optim.steps=30"]).stages)
    assert (stages["a"].optim.base_lr, stages["a"].optim.lr, stages["b"].optim.lr) == (0.1, None, 0.001)
    assert stages["b"].optim.base_lr is None
    assert dict(load_experiment(exp, ["stages.a.optim.lr=0.5"]).stages)["a"].optim.lr == 0.5
    both = write(tmp_path, "name: x\ndata: {train: d}\noptim: {lr: 3.0e-4, base_lr: 0.02}\n")
    with pytest.raises(
        ConfigError, match=r"optim\.lr \(0\.0003, the peak as given\) and optim\.base_lr \(0\.02"
    ):
        load_config(both)
    with pytest.raises(
        ConfigError, match=r"optim\.scale_lr: removed: optim\.lr is now the peak .* optim\.base_lr"
    ):
        load_config(write(tmp_path, "name: x\ndata: {train: d}\noptim: {lr: 0.1, scale_lr: true}\n"))


def test_the_readme_experiment_is_the_vit_h14_config_file_and_valid():
    """README's "Write an experiment" example is configs/experiments/vit_h14_jft.yaml (after its header
    comment), and loads: ViT-H/14 at resolutions its 14 px patches divide, big_vision's lr as given."""
    root = Path(__file__).parents[1]
    path = root / "configs/experiments/vit_h14_jft.yaml"
    text = path.read_text()
    body = text[text.index("name: my_pretraining") :]
    assert f"```yaml\n{body}```" in (root / "README.md").read_text()
    exp = dict(load_experiment(path).stages)
    pretrain, finetune = exp["pretrain"], exp["finetune"]
    assert (pretrain.model.name, pretrain.model.img_size, finetune.model.img_size) == ("vit_h14", 224, 518)
    assert (pretrain.deepspeed.zero_stage, pretrain.deepspeed.precision) == (3, "bf16")
    assert peak_lr(pretrain, 16) == 1e-3 and peak_lr(finetune, 16) == pytest.approx(4e-3)
    assert pretrain.data.batch_size * 16 == 4096
    for cfg in (pretrain, finetune):  # builds (shapes only): each size a multiple of the patch
        with torch.device("meta"):
            model = create_model(cfg.model.name, img_size=cfg.model.img_size, **cfg.model.overrides)
        assert model.pos_embed.shape[1] == (cfg.model.img_size // 14) ** 2


def test_cross_field_validation(tmp_path):
    p = write(tmp_path, "name: x\ndata: {train: d}\ndeepspeed: {zero_stage: 2, offload_params: true}\n")
    with pytest.raises(ConfigError, match="offload_params needs deepspeed.zero_stage: 3"):
        load_config(p)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(SMOKE, ["optim.steps=7"])
    path = save_resolved(cfg, tmp_path / "run" / "config.yaml")
    again = load_config(path)
    assert again == cfg
    flat = flatten(cfg)
    assert flat["optim.steps"] == "7" and flat["deepspeed.zero_stage"] == "2"


def test_base_presets_merge_under_the_file(tmp_path):
    exp = tmp_path / "exp.yaml"
    preset = Path(__file__).parents[1] / "configs/deepspeed/zero3_offload.yaml"
    exp.write_text(f"base: [{preset}]\nname: x\ndata: {{train: d}}\ndeepspeed: {{precision: fp32}}\n")
    cfg = load_config(exp)
    assert cfg.deepspeed.zero_stage == 3 and cfg.deepspeed.offload_params  # from the preset
    assert cfg.deepspeed.precision == "fp32"  # the file's own value wins
    exp.write_text("base: [missing.yaml]\nname: x\ndata: {train: d}\n")
    with pytest.raises(ConfigError, match="base 'missing.yaml' not found"):
        load_config(exp)


def test_every_deepspeed_preset_validates():
    presets = sorted((Path(__file__).parents[1] / "configs/deepspeed").glob("*.yaml"))
    assert len(presets) >= 4
    for preset in presets:
        raw = {"name": "x", "data": {"train": "d"}, **yaml.safe_load(preset.read_text())}
        validate_config(raw, source=str(preset))


def test_multistage_experiment_takes_presets_and_names_stage_keys(tmp_path):
    from pipeline.config import load_experiment

    preset = Path(__file__).parents[1] / "configs/deepspeed/zero3_bf16.yaml"
    exp = tmp_path / "exp.yaml"
    exp.write_text(
        f"base: [{preset}]\nname: e\ndefaults: {{data: {{train: d}}}}\n"
        "stages:\n  a: {optim: {steps: 3, warmup_steps: 1}}\n  b: {model: {init_from: a}, deepspeed: {zero_stage: 2}}\n"
    )
    e = load_experiment(exp, ["stages.a.optim.lr=0.5"])
    (a_name, a), (_, b) = e.stages
    assert a_name == "a" and a.deepspeed.zero_stage == 3 and a.optim.lr == 0.5  # preset + override
    assert b.deepspeed.zero_stage == 2 and b.model.init_from == str(e.run_path / "a" / "export")
    assert a.tracking.experiment == "e" and a.run_path == e.run_path / "a"
    # Caught in the file as written (the stage's key path), before any stage is merged.
    with pytest.raises(
        ConfigError,
        match=r"exp\.yaml: invalid config.*\n  stages\.b\.optim\.stpes: unknown key; did you mean 'steps'",
    ):
        load_experiment(exp, ["stages.b.optim.stpes=1"])


@pytest.mark.unit
def test_a_distillation_teacher_may_name_an_earlier_stage(tmp_path):
    cfg = tmp_path / "exp.yaml"
    stages = "stages:\n  cvt: {data: {train: d}}\n  deit:\n    data: {train: d}\n    objective: {name: distill, teacher: {model: cvt_debug, weights: cvt}}\n"
    cfg.write_text("name: exp\nrun_dir: " + str(tmp_path / "runs") + "\n" + stages)
    (_, _), (_, deit) = load_experiment(cfg).stages
    assert deit.objective.teacher.weights == str(tmp_path / "runs" / "cvt" / "export")
    # A later stage cannot teach an earlier one.
    cfg.write_text(
        "name: exp\n" + stages.replace("  cvt: {data: {train: d}}\n", "") + "  cvt: {data: {train: d}}\n"
    )
    with pytest.raises(ConfigError, match="teacher.weights: stage 'cvt' does not run before it"):
        load_experiment(cfg)


# ---------------------------------------------------------------- the multi-stage file, typed


def test_multistage_file_typos_name_the_key_path_with_did_you_mean(tmp_path):
    p = write(
        tmp_path,
        "name: e\nstorge: s3://b\ndefaults: {data: {train: d}, optim: {stpes: 3}}\n"
        "stages:\n  a: {seed: 3, modle: {name: vit_debug}}\n",
    )
    with pytest.raises(ConfigError) as err:
        load_experiment(p)
    msg = str(err.value)
    assert msg.startswith(f"{p}: invalid config (4 problems)")
    assert "  storge: unknown key; did you mean 'storage'?" in msg
    assert "  defaults.optim.stpes: unknown key; did you mean 'steps'?" in msg
    assert "  stages.a.modle: unknown key; did you mean 'model'?" in msg
    assert "  stages.a.seed: not a stage key here: set seed once at the top of the file" in msg
    # An override is checked the same way, and a misspelled `stages` in a file says what it may mean.
    with pytest.raises(ConfigError, match=r"stages\.a\.optim\.lrr: unknown key; did you mean 'lr'"):
        load_experiment(
            write(tmp_path, "name: e\nstages:\n  a: {data: {train: d}}\n"), ["stages.a.optim.lrr=1"]
        )
    with pytest.raises(
        ConfigError, match=r"stagse: unknown key; did you mean 'stages' \(a key of multi-stage"
    ):
        load_experiment(write(tmp_path, "name: e\ndata: {train: d}\nstagse: {a: {}}\n"))
    with pytest.raises(ConfigError, match=r"stages: Dictionary should have at least 1 item"):
        load_experiment(write(tmp_path, "name: e\nstages: {}\n"))
    with pytest.raises(ConfigError, match=r"name: required key is missing"):
        load_experiment(write(tmp_path, "stages: {a: {data: {train: d}}}\n"))


def test_top_level_stage_sections_and_cluster_act_as_defaults(tmp_path):
    p = write(
        tmp_path,
        "name: e\nseed: 7\ncluster: {num_workers: 3}\noptim: {steps: 9, warmup_steps: 1}\n"
        "defaults: {data: {train: d}, optim: {lr: 0.5}}\n"
        "stages:\n  a: {}\n  b: {optim: {steps: 4}, cluster: {num_workers: 1}}\n",
    )
    (_, a), (_, b) = load_experiment(p).stages
    assert (a.seed, a.optim.steps, a.optim.lr, a.cluster.num_workers) == (7, 9, 0.5, 3)
    assert (b.seed, b.optim.steps, b.optim.lr, b.cluster.num_workers) == (7, 4, 0.5, 1)


# ---------------------------------------------------------------- models, per family, at load


def test_unknown_model_name_fails_at_load_with_close_matches(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(SMOKE, ["model.name=vit_b17"])
    msg = str(err.value)
    assert f"{SMOKE}: invalid config" in msg
    assert "model.name: unknown model 'vit_b17'; did you mean 'vit_b16'" in msg
    p = write(
        tmp_path,
        "name: e\nstages:\n  a: {data: {train: d}, objective: {name: distill, teacher: {model: cvt_dbg, weights: w}}}\n",
    )
    with pytest.raises(
        ConfigError,
        match=r"stages\.a: invalid config.*\n  objective\.teacher\.model: unknown model 'cvt_dbg'; did you mean 'cvt_debug'",
    ):
        load_experiment(p)


def test_model_overrides_are_checked_against_the_family(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(SMOKE, ["model.overrides.pool=gapp", "model.overrides.pos_embd=none"])
    msg = str(err.value)
    assert "model.overrides.pool: Input should be 'cls' or 'gap' (got 'gapp')" in msg
    assert "model.overrides.pos_embd: not an option of vit_debug; did you mean 'pos_embed'?" in msg
    # Options of the family: a Swin option is no ViT option; the encoder's options pass through SimMIM.
    with pytest.raises(ConfigError, match=r"model\.overrides\.window_size: not an option of vit_debug"):
        load_config(SMOKE, ["model.overrides.window_size=4"])
    cfg = load_config(SMOKE, ["model.name=simmim_swin_debug", "model.overrides.window_size=2"])
    assert cfg.model.overrides == {"window_size": 2}
    # A combination the constructor refuses fails at load, naming the model and its arguments.
    with pytest.raises(ConfigError, match=r"model: vit_debug\(img_size=30\) cannot be built: .*patch_size 8"):
        load_config(SMOKE, ["model.img_size=30"])
    with pytest.raises(
        ConfigError, match=r"model: vit_debug\(img_size=32, pool='gap', distilled=True\) cannot"
    ):
        load_config(SMOKE, ["model.overrides={pool: gap, distilled: true}"])


# ---------------------------------------------------------------- paths, resolved once at load


def test_local_paths_are_absolute_after_load_and_uris_stay(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(SMOKE, ["run_dir=out/{name}", "model.init_from=exports/a"])
    assert cfg.run_dir == str(tmp_path / "out" / "smoke") and cfg.run_path == tmp_path / "out" / "smoke"
    assert cfg.data.train == str(tmp_path / "data" / "smoke")
    assert cfg.model.init_from == str(tmp_path / "exports" / "a")
    # A worker started in another directory reads the same paths back.
    monkeypatch.chdir(tmp_path.parent)
    assert validate_config(cfg.model_dump(mode="json")) == cfg
    for uri in ("s3://bucket/ds", "pipe:aws s3 cp s3://b/x.tar -", "https://h/shard-{0..3}.tar"):
        assert validate_config({"name": "x", "data": {"train": uri}}).data.train == uri
    both = validate_config({"name": "x", "data": {"train": "a.tar::s3://b/c.tar"}}).data.train
    assert both == f"{tmp_path.parent / 'a.tar'}::s3://b/c.tar"


# ---------------------------------------------------------------- inputs, before anything starts


def test_missing_dataset_is_reported_before_anything_starts(tmp_path, smoke_dataset):
    from pipeline.config import check_inputs, input_problems

    cfg = load_config(SMOKE, [f"data.train={tmp_path / 'nope'}", "data.synthetic=null"])
    with pytest.raises(
        ConfigError, match=r"(?s)1 input missing.*stage smoke: data\.train: .*nope does not exist"
    ):
        check_inputs(cfg)
    assert input_problems(load_config(SMOKE, [f"data.train={tmp_path / 'nope'}"])) == []  # generated later
    # a bucket dataset is checked too (its manifest read; tests/test_dataset_storage.py has a real one)
    unreachable = "s3://bucket/ds?endpoint_override=127.0.0.1:9&scheme=http&region=us-east-1"
    (problem,) = input_problems(load_config(SMOKE, [f"data.train={unreachable}", "data.synthetic=null"]))
    assert "s3://bucket/ds/manifest.json: cannot read the manifest" in problem
    check_inputs(load_config(SMOKE, [f"data.train={smoke_dataset}", "data.synthetic=null"]))
    shards = f"{smoke_dataset}/train/shard-{{000000..000009}}.tar"  # 8 of the 10 exist
    problems = input_problems(load_config(SMOKE, [f"data.train={shards}", "data.synthetic=null"]))
    assert problems and "2 of 10 local shard files not found" in problems[0]
    # Every stage at once: the dataset lacks the val split an eval stage reads; a folder one stage
    # generates (data.synthetic) counts as present for the others.
    p = write(
        tmp_path,
        f"name: e\nrun_dir: {tmp_path / 'runs'}\nstages:\n"
        f"  gen: {{data: {{train: {tmp_path / 'gen'}, synthetic: {{num: 32}}}}}}\n"
        f"  a: {{data: {{train: {tmp_path / 'gen'}}}}}\n"
        f"  b: {{data: {{train: {smoke_dataset}}}}}\n"
        f"  ev: {{kind: eval, model: {{init_from: b, init_head: true}}, data: {{train: {smoke_dataset}}}}}\n",
    )
    with pytest.raises(ConfigError) as err:
        check_inputs(load_experiment(p))
    msg = str(err.value)
    assert msg.count("\n  ") == 1 and "stage ev: data.train:" in msg
    assert "the manifest lists no shards for split 'val'" in msg


# ---------------------------------------------------------------- the reference


def test_docs_config_md_is_the_generated_reference():
    from pipeline.config import reference

    doc = Path(__file__).parents[1] / "docs/config.md"
    assert doc.read_text() == reference() + "\n", (
        "regenerate: .venv/bin/python -m pipeline.config > docs/config.md"
    )
    assert "__main__" not in doc.read_text() and "FieldInfo" not in doc.read_text()


def test_the_old_name_of_the_stage_config_is_refused_with_the_new_one():
    with pytest.raises(ImportError, match=r"ExperimentConfig is now StageConfig"):
        from pipeline.config import ExperimentConfig  # noqa: F401


def test_entry_points_refuse_a_missing_dataset_or_model_before_ray_starts(tmp_path, monkeypatch, capsys):
    import cluster.run
    import vitpipe

    def no_ray(address):  # nothing may start: the config and its inputs fail first
        raise AssertionError("Ray was started")

    monkeypatch.setattr(cluster.run, "connect", no_ray)
    missing = [f"data.train={tmp_path / 'nope'}", "data.synthetic=null"]
    assert vitpipe.main(["train", str(SMOKE), *missing]) == 2
    assert "stage smoke: data.train:" in capsys.readouterr().err
    assert vitpipe.main(["run", str(SMOKE), *missing]) == 2
    assert cluster.run.main([str(SMOKE), *missing]) == 2
    assert vitpipe.main(["train", str(SMOKE), "model.name=vit_b17"]) == 2
    assert "unknown model 'vit_b17'" in capsys.readouterr().err


# ---------------------------------------------------------------- seeds: every stage once per seed

TWO_STAGE = Path(__file__).parents[1] / "configs/experiments/two_stage_tiny.yaml"


def test_seeds_repeat_every_stage_per_seed_reading_the_same_seeds_replicas(tmp_path):
    p = write(
        tmp_path,
        f"name: e\nseeds: [0, 1, 2]\nrun_dir: {tmp_path / 'runs'}\nstorage: s3://b/{{name}}?region=x\n"
        "defaults: {data: {train: d}}\nstages:\n  pretrain: {}\n  finetune: {model: {init_from: pretrain}}\n"
        "  distill: {objective: {name: distill, teacher: {model: vit_debug, weights: finetune}}}\n",
    )
    e = load_experiment(p, ["stages.finetune.optim.lr=0.5"])  # the name as written: every replica
    runs = tmp_path / "runs"
    # Seed-major: all stages of seed 0, then seed 1, ...; each stage after the stages it reads.
    assert [n for n, _ in e.stages] == [
        f"{s}_s{k}" for k in range(3) for s in ("pretrain", "finetune", "distill")
    ]
    for name, cfg in e.stages:
        stage, k = name.rsplit("_s", 1)
        assert cfg.name == name and cfg.seed == int(k)
        assert cfg.run_path == runs / name  # its own DONE.json, checkpoints and mlflow_run.json
        assert cfg.checkpoint.uri == f"s3://b/e/{name}?region=x"
        assert cfg.tracking.experiment == "e" and cfg.tracking_uri == f"sqlite:///{runs / 'mlflow.db'}"
        assert cfg.optim.lr == (0.5 if stage == "finetune" else 1e-3)
        if stage == "finetune":
            assert cfg.model.init_from == f"s3://b/e/pretrain_s{k}/export?region=x"
        if stage == "distill":
            assert cfg.objective.teacher.weights == f"s3://b/e/finetune_s{k}/export?region=x"
        flat = flatten(cfg)  # the MLflow params vitpipe compare --over-seeds groups by
        assert flat["seed"] == k and flat["name"] == name
    assert e.run_path == runs and e.parent_run_file == runs / "parent_run.json"
    # Without storage an earlier stage is its replica's export folder; a later stage is still refused.
    p.write_text(p.read_text().replace("storage: s3://b/{name}?region=x\n", ""))
    finetune = dict(load_experiment(p).stages)["finetune_s2"]
    assert finetune.model.init_from == str(runs / "pretrain_s2" / "export")
    with pytest.raises(ConfigError, match="stages.pretrain.model.init_from: stage 'finetune' does not run"):
        load_experiment(p, ["stages.pretrain.model.init_from=finetune"])


def test_seed_and_seeds_together_name_both_and_the_override_that_replaces_a_seed(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_experiment(TWO_STAGE, ["seeds=[0,1]"])  # the file sets seed: 0
    msg = str(err.value)
    assert msg.startswith(f"{TWO_STAGE}: invalid config (1 problem)")
    assert "seed (0) and seeds ([0, 1]) are both set" in msg and "seed=null seeds=[...]" in msg
    e = load_experiment(TWO_STAGE, ["seed=null", "seeds=[0,1]"])
    assert [(n, c.seed) for n, c in e.stages] == [
        ("pretrain_s0", 0),
        ("finetune_s0", 0),
        ("pretrain_s1", 1),
        ("finetune_s1", 1),
    ]
    # Without seeds nothing changes: the stage names as written, the file's seed.
    assert [(n, c.seed) for n, c in load_experiment(TWO_STAGE).stages] == [("pretrain", 0), ("finetune", 0)]
    stages = "stages: {a: {data: {train: d}}}\n"
    for seeds, expected in [
        ("[1, 2, 1]", r"seeds: seeds must be distinct; repeated: 1"),
        ("[]", r"seeds: List should have at least 1 item"),
        ("[0, x]", r"seeds\.1: Input should be a valid integer"),
        ("3", r"seeds: Input should be a valid list"),
    ]:
        with pytest.raises(ConfigError, match=expected):
            load_experiment(write(tmp_path, f"name: e\nseeds: {seeds}\n{stages}"))
    with pytest.raises(
        ConfigError, match=r"stages\.a\.seeds: not a stage key here: set seeds once at the top"
    ):
        load_experiment(write(tmp_path, "name: e\nstages: {a: {data: {train: d}, seeds: [0]}}\n"))
    with pytest.raises(
        ConfigError, match=r"seeds: seeds repeats the stages of a multi-stage experiment file"
    ):
        load_config(SMOKE, ["seeds=[0,1]"])


DETECTION = Path(__file__).parents[1] / "configs/experiments/detection.yaml"


def test_a_stage_set_to_null_is_dropped_and_a_stage_that_reads_it_is_named(tmp_path):
    """`stages.NAME=null` runs the experiment without that stage (a file over a `base:` can do the same
    with `NAME: null`); every other stage resolves as before."""
    whole = load_experiment(DETECTION, ["seeds=[0]"])
    names = [n for n, _ in whole.stages]
    assert {"det_scratch_s0", "eval_det_scratch_s0"} <= set(names)
    part = load_experiment(
        DETECTION, ["seeds=[0]", "stages.det_scratch=null", "stages.eval_det_scratch=null"]
    )
    assert [n for n, _ in part.stages] == [n for n in names if "scratch" not in n]
    kept = dict(whole.stages)
    for name, cfg in part.stages:  # the same resolved stage as in the whole experiment
        assert cfg.model_dump() == kept[name].model_dump(), name
    # A stage whose weights come from a dropped stage: refused, naming both.
    with pytest.raises(
        ConfigError,
        match=r"stages\.eval_det_scratch\.model\.init_from: stage 'det_scratch' is dropped "
        r"\(stages\.det_scratch=null\): drop stages\.eval_det_scratch too",
    ):
        load_experiment(DETECTION, ["stages.det_scratch=null"])
    with pytest.raises(
        ConfigError, match=r"stages\.det_scracth=null drops a stage the experiment does not have"
    ):
        load_experiment(DETECTION, ["stages.det_scracth=null"])
    derived = write(tmp_path, f"base: {DETECTION}\nstages: {{det_scratch: null, eval_det_scratch: null}}\n")
    assert [n for n, _ in load_experiment(derived).stages] == [
        n for n, _ in load_experiment(DETECTION).stages if "scratch" not in n
    ]
    every = [f"stages.{n}=null" for n in yaml.safe_load(DETECTION.read_text())["stages"]]
    with pytest.raises(ConfigError, match="every stage is dropped"):
        load_experiment(DETECTION, every)
