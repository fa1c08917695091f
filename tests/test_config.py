from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, flatten, load_config, load_experiment, save_resolved, validate_config

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
    assert isinstance(cfg.optim.lr, float)
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
    cfg = load_config(SMOKE, ["optim.lr=3e-4", "cluster.num_workers=3", "model.overrides.pool=gap"])
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.cluster.num_workers == 3
    assert cfg.model.overrides == {"pool": "gap"}
    with pytest.raises(ConfigError, match=r"cluster\.num_wrkers: unknown key"):
        load_config(SMOKE, ["cluster.num_wrkers=3"])
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        load_config(SMOKE, ["optim.lr"])
    with pytest.raises(ConfigError, match=r"optim\.lr is a float, not a section"):
        load_config(SMOKE, ["optim.lr.x=1"])


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
    with pytest.raises(ConfigError, match=r"(?s)stages\.b: invalid config.*optim\.stpes: unknown key"):
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
