"""The typed config tree: YAML in, a validated `StageConfig` out.

    cfg = load_config("configs/experiments/smoke.yaml", ["optim.lr=3e-4", "cluster.num_workers=2"])

Every section is a pydantic model that forbids unknown keys, so a misspelled key or a value of the
wrong type fails at load time with a `ConfigError` naming the file, the dotted key path and what was
expected. Code reads typed fields only (`cfg.optim.lr`), never `dict.get(key, default)`.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from data_prep import atomic


class ConfigError(ValueError):
    """A config file or override that does not fit the schema; the message says where and why."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    name: str = Field("vit_debug", description="Registered model name, see `pipeline.models.list_models()`.")
    img_size: int = Field(32, gt=0, description="Training resolution in pixels (square).")
    num_classes: int | None = Field(
        None, gt=0, description="Classifier outputs; null takes the class count from the dataset manifest."
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword overrides passed to `create_model` (e.g. pos_embed, pool, drop_path_rate).",
    )
    init_from: str | None = Field(
        None,
        description="Start from exported weights: an export folder or .safetensors file, or (in a multi-stage "
        "experiment) the name of an earlier stage. Position embeddings are resampled to img_size.",
    )
    init_head: bool = Field(
        False, description="Also load the classifier head from init_from (else a new zero head)."
    )


class SyntheticDataConfig(_Section):
    num: int = Field(320, gt=0, description="Images to generate.")
    classes: int = Field(8, gt=1, description="Number of classes.")
    labels_per_image: float = Field(1.3, ge=1.0, description="Mean labels per image (multi-label corpus).")
    width: int = Field(48, gt=0, description="Generated image width in pixels.")
    height: int = Field(40, gt=0, description="Generated image height in pixels.")
    max_count: int = Field(40, gt=0, description="Samples per shard.")
    val_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="Fraction held out as the val split.")


class DataConfig(_Section):
    train: str = Field(
        ...,
        description="Dataset folder written by `vitpipe shard` (its train split is read; relative paths resolve "
        "against the CWD), or a brace pattern / URL of shards webdataset opens (local, pipe:, http).",
    )
    num_classes: int | None = Field(None, gt=0, description="Classes of a URL input without a manifest.")
    multi_label: bool | None = Field(
        None, description="Whether a URL input without a manifest is multi-label."
    )
    resampled: bool = Field(
        False, description="Draw shards with replacement, endlessly (JFT-scale streaming)."
    )
    randaugment: tuple[int, float] | None = Field(
        None, description="RandAugment (num_ops, magnitude), e.g. [2, 9]."
    )
    hflip: bool = Field(True, description="Random horizontal flips (off for digits, text).")
    max_skip_fraction: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="Stop with an error naming the shard past this fraction of corrupt samples.",
    )
    synthetic: SyntheticDataConfig | None = Field(
        None,
        description="If set and `train` holds no dataset yet, generate this synthetic corpus there first.",
    )
    batch_size: int = Field(16, gt=0, description="Per-rank micro-batch size.")
    num_workers: int = Field(1, ge=0, description="Loader worker processes per rank.")
    shuffle_buffer: int = Field(256, ge=0, description="Samples held in the in-worker shuffle buffer.")
    min_scale: float = Field(0.35, gt=0.0, le=1.0, description="RandomResizedCrop lower area bound.")


class TeacherConfig(_Section):
    model: str = Field(..., description="Registered teacher model name.")
    weights: str = Field(
        ...,
        description="Teacher weights: an export folder or its .safetensors file (local or a storage URI), or in "
        "a multi-stage experiment the name of an earlier stage, whose export is used.",
    )
    img_size: int | None = Field(None, gt=0, description="Teacher resolution; null means the student's.")
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="create_model overrides for the teacher."
    )


class ObjectiveConfig(_Section):
    name: Literal["supervised_softmax", "supervised_sigmoid", "mae", "simmim", "masked_patch_prediction",
                  "distill"] = Field(
        "supervised_softmax",
        description="Training objective; mae needs an mae_* model, simmim a simmim_* model (Swin, CvT, TNT).",
    )  # fmt: skip
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0, description="Label smoothing (softmax and distill).")
    head_bias_init: float | None = Field(
        None, description="Classifier bias init; null means 0 for softmax and -10 for sigmoid (big_vision)."
    )
    mixup_alpha: float = Field(
        0.0, ge=0.0, description="Mixup Beta(alpha, alpha); 0 disables (softmax only)."
    )
    cutmix_alpha: float = Field(
        0.0, ge=0.0, description="CutMix Beta(alpha, alpha); 0 disables (softmax only)."
    )
    mixup_switch_prob: float = Field(
        0.5, ge=0.0, le=1.0, description="With both on, chance of CutMix per batch."
    )
    teacher: TeacherConfig | None = Field(None, description="Distillation teacher (objective distill).")
    distill_type: Literal["hard", "soft"] = Field(
        "hard", description="DeiT hard (teacher argmax) or soft (KL)."
    )
    distill_alpha: float = Field(0.5, ge=0.0, le=1.0, description="Weight of the distillation term.")
    distill_tau: float = Field(1.0, gt=0.0, description="Soft distillation temperature.")

    @model_validator(mode="after")
    def _check(self) -> ObjectiveConfig:
        if self.name == "distill" and self.teacher is None:
            raise ValueError("objective.teacher is required for objective.name: distill")
        return self


class OptimConfig(_Section):
    lr: float = Field(1e-3, gt=0.0, description="Base learning rate, scaled by global_batch / 256.")
    scale_lr: bool = Field(True, description="Apply lr = lr * global_batch / 256.")
    weight_decay: float = Field(0.05, ge=0.0, description="Decoupled weight decay (AdamW).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    steps: int = Field(40, gt=0, description="Total optimizer steps of the stage.")
    warmup_steps: int = Field(5, ge=0, description="Linear warmup steps.")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    grad_clip: float = Field(1.0, ge=0.0, description="Global gradient-norm clip; 0 disables.")
    layer_decay: float | None = Field(
        None, gt=0.0, le=1.0, description="Layer-wise lr decay (fine-tuning, e.g. 0.75); null disables."
    )


class DeepSpeedConfig(_Section):
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="ZeRO stage.")
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Training precision.")
    grad_accum: int = Field(1, gt=0, description="Gradient accumulation steps.")
    offload_optimizer: bool = Field(False, description="ZeRO CPU offload of the optimizer state.")
    offload_params: bool = Field(False, description="ZeRO-3 CPU offload of the parameters.")
    activation_checkpointing: bool = Field(
        False, description="Recompute each block's activations in backward."
    )


class ClusterConfig(_Section):
    launcher: Literal["local", "ray"] = Field(
        "ray", description="`ray`: Ray Train workers; `local`: this process (or torchrun's processes)."
    )
    num_workers: int = Field(2, gt=0, description="Training workers (ranks) for the Ray launcher.")
    use_gpu: bool = Field(False, description="One GPU per worker, NCCL backend; else CPU and gloo.")
    cpus_per_worker: float = Field(1.0, gt=0.0, description="CPUs reserved per worker.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement group strategy."
    )
    address: str | None = Field(
        None, description="Ray address; null uses RAY_ADDRESS or starts a local Ray instance."
    )
    max_failures: int = Field(0, ge=-1, description="Worker-group restarts Ray Train allows (-1: unlimited).")


class TrackingConfig(_Section):
    uri: str | None = Field(
        None, description="MLflow tracking URI; null means sqlite:///<run_dir>/mlflow.db."
    )
    experiment: str | None = Field(None, description="MLflow experiment name; null means the config's name.")
    log_every: int = Field(1, gt=0, description="Log metrics every N steps.")
    peak_tflops: float = Field(
        989.0, gt=0.0, description="Per-device peak for MFU (H100/H200 dense bf16: 989)."
    )
    system_metrics: bool = Field(True, description="Log CPU, memory (and GPU) use with MLflow's sampler.")


class CheckpointConfig(_Section):
    every_steps: int = Field(0, ge=0, description="Save every N steps; 0 saves only at the end.")
    keep_last: int = Field(2, gt=0, description="Checkpoints kept on disk.")
    export: bool = Field(True, description="Export consolidated fp32 weights (safetensors) at the end.")
    uri: str | None = Field(
        None,
        description="Object storage for checkpoints and the export (s3://bucket/prefix, gs://..., any pyarrow "
        "or fsspec URI): every rank uploads its shards after a save, resume downloads them, so nodes need no "
        "shared filesystem. Credentials come from the environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS). "
        "In a multi-stage experiment the top-level `storage` sets it per stage.",
    )


class DebugConfig(_Section):
    stop_at_step: int | None = Field(
        None, gt=0, description="Checkpoint and stop after this step (resume tests)."
    )
    kill_rank: int | None = Field(
        None, ge=0, description="Rank whose process is killed (fault-injection tests)."
    )
    kill_at_step: int | None = Field(
        None, gt=0, description="Step at which kill_rank dies (once per run dir)."
    )
    resume_optimizer: bool = Field(True, description="False resumes weights only (a negative control).")


class EvalConfig(_Section):
    train_split: str = Field(
        "train",
        description="Split of data.train whose features fit the few-shot and linear-probe classifiers.",
    )
    eval_split: str = Field(
        "val",
        description="Split of data.train that is evaluated (classification, few-shot and probe test set).",
    )
    classification: bool = Field(
        True,
        description="Run the model's own head on eval_split: top-1/top-5 for single-label data, mAP and "
        "precision@1 for multi-label; needs model.init_head: true.",
    )
    fewshot_shots: list[Annotated[int, Field(gt=0)]] = Field(
        default_factory=lambda: [1, 5, 10, 25],
        description="Few-shot ridge regression on frozen pre-logits: train samples per class; [] disables.",
    )
    fewshot_seeds: list[int] = Field(
        default_factory=lambda: [0, 1, 2],
        min_length=1,
        description="Seeds of the few-shot subsets; the mean over them is reported.",
    )
    fewshot_l2: float = Field(2.0**10, gt=0.0, description="Ridge l2 regularisation (big_vision: 2^10).")
    fewshot_max_train: int | None = Field(
        50_000,
        gt=0,
        description="At most this many train_split samples are embedded for few-shot and probe (whole "
        "batches per rank: when the cap bites, which samples depends on the world size); null: all.",
    )
    linear_probe: bool = Field(
        True, description="Also fit a logistic-regression probe (L-BFGS) on the train_split features."
    )
    figures: bool = Field(
        True,
        description="Log PNGs: source-stage loss curve, position-embedding similarity, patch-embedding "
        "principal components, mean attention distance per layer.",
    )
    batch_size: int | None = Field(None, gt=0, description="Per-rank eval batch size; null: data.batch_size.")


class StageConfig(_Section):
    name: str = Field(
        ..., min_length=1, description="Experiment name; names the run directory and MLflow experiment."
    )
    kind: Literal["train", "eval"] = Field(
        "train",
        description="`train`: the training loop; `eval`: evaluate model.init_from's export (section eval).",
    )
    seed: int = Field(0, description="Root seed: model init, data order, augmentation.")
    run_dir: str = Field("runs/{name}", description="Output folder; `{name}` expands; relative to the CWD.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    debug: DebugConfig = Field(default_factory=DebugConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _check(self) -> StageConfig:
        if self.deepspeed.offload_params and self.deepspeed.zero_stage != 3:
            raise ValueError("deepspeed.offload_params needs deepspeed.zero_stage: 3")
        if self.optim.warmup_steps > self.optim.steps:
            raise ValueError(
                f"optim.warmup_steps ({self.optim.warmup_steps}) exceeds optim.steps ({self.optim.steps})"
            )
        if self.kind == "eval":
            if self.model.init_from is None:
                raise ValueError("kind: eval needs model.init_from (an export folder or an earlier stage)")
            if self.eval.classification and not self.model.init_head:
                raise ValueError(
                    "eval.classification runs the exported head, so it needs model.init_head: true "
                    "(or set eval.classification: false to evaluate features only)"
                )
        return self

    # Derived quantities, one definition each.
    @property
    def run_path(self) -> Path:
        return Path(self.run_dir.format(name=self.name)).absolute()

    @property
    def tracking_uri(self) -> str:
        return self.tracking.uri or f"sqlite:///{self.run_path / 'mlflow.db'}"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# ---------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """`optim.lr=3e-4` -> (["optim", "lr"], 0.0003); the value is parsed as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: expected KEY.PATH=VALUE, e.g. optim.lr=3e-4")
    return key.split("."), yaml.safe_load(value) if value != "" else ""


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override {text!r}: {'.'.join(path[: i + 1])} is a {type(child).__name__}, not a section"
                )
            node = child
        node[path[-1]] = value
    return raw


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names valid at the section that holds `loc[-1]`."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        candidates = [ann, *getattr(ann, "__args__", ())]
        nxt = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nxt is None:
            return []
        model = nxt
    return list(model.model_fields)


def _describe(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid config ({err.error_count()} problem{'s' * (err.error_count() > 1)})"]
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(StageConfig, loc)
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            lines.append(f"  {key}: unknown key{hint} allowed keys here: {', '.join(allowed)}")
        elif e["type"] == "missing":
            lines.append(f"  {key}: required key is missing")
        elif not loc:  # a cross-field rule: the message names its keys; the input would be the whole file
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    return raw


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> StageConfig:
    """Read YAML, apply dotted overrides, validate. Relative `data.train` resolves against the CWD."""
    path = Path(path)
    raw = _read_yaml(path)
    raw = _with_bases(raw, path, seen=(path.resolve(),))
    raw = apply_overrides(raw, list(overrides or []))
    return validate_config(raw, source=str(path))


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _with_bases(raw: dict, path: Path, seen: tuple[Path, ...]) -> dict:
    """`base: [a.yaml, ...]` (paths relative to this file) are merged under this file's own values."""
    bases = raw.pop("base", []) or []
    if isinstance(bases, str):
        bases = [bases]
    merged: dict = {}
    for b in bases:
        bpath = (path.parent / b).resolve()
        if not bpath.is_file():
            raise ConfigError(f"{path}: base {b!r} not found (looked for {bpath})")
        if bpath in seen:
            raise ConfigError(f"{path}: base {b!r} includes itself")
        braw = yaml.safe_load(bpath.read_text()) or {}
        if not isinstance(braw, dict):
            raise ConfigError(f"{bpath}: expected a mapping at the top level")
        merged = _deep_merge(merged, _with_bases(braw, bpath, (*seen, bpath)))
    return _deep_merge(merged, raw)


def validate_config(raw: dict, source: str = "<config>") -> StageConfig:
    try:
        return StageConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err, source)) from None


def save_resolved(cfg: StageConfig, path: Path) -> Path:
    """Write the resolved config atomically (every run keeps the exact config it ran with)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, cfg.to_yaml())
    return path


def flatten(cfg: StageConfig) -> dict[str, str]:
    """Dotted key -> string value, for MLflow params."""
    out: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            if not node:
                out[prefix] = "{}"
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = str(node)

    walk("", cfg.model_dump(mode="json"))
    return out


# ---------------------------------------------------------------- multi-stage experiments


class Experiment(BaseModel):
    """An experiment of stages run in order (pretrain -> fine-tune -> evaluate), each a full stage config.

    YAML: `name`, `seed`, `run_dir`, `cluster`, `tracking` for the whole experiment, `defaults` merged
    under every stage, and `stages`, a mapping from stage name to that stage's own keys (so overrides
    read `stages.finetune.optim.lr=1e-3`). A file without `stages` is a one-stage experiment.
    `storage` (optional, e.g. `s3://bucket/runs/{name}`) puts every stage's checkpoints and export on
    object storage under STORAGE/STAGE/ (each stage's `checkpoint.uri`), for nodes without a shared
    file system; `init_from: STAGE` then reads STORAGE/STAGE/export.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)
    name: str
    run_path: Path
    tracking_uri: str
    stages: list[tuple[str, StageConfig]]
    source: str

    @property
    def parent_run_file(self) -> Path:
        return self.run_path / "parent_run.json"


EXPERIMENT_KEYS = ("name", "seed", "run_dir", "storage", "cluster", "tracking", "defaults", "stages", "base")
# Stage sections written at the top of a multi-stage file (e.g. by a `base:` preset) act as defaults.
STAGE_SECTIONS = ("model", "data", "objective", "optim", "deepspeed", "checkpoint", "eval", "debug")


def load_experiment(path: str | os.PathLike, overrides: list[str] | None = None) -> Experiment:
    path = Path(path)
    raw = _read_yaml(path)
    if "stages" not in raw:
        cfg = load_config(path, overrides)
        return Experiment(name=cfg.name, run_path=cfg.run_path, tracking_uri=cfg.tracking_uri,
                          stages=[(cfg.name, cfg)], source=str(path))  # fmt: skip
    raw = _with_bases(raw, path, seen=(path.resolve(),))
    top = {k: raw.pop(k) for k in STAGE_SECTIONS if k in raw}
    raw["defaults"] = _deep_merge(top, raw.get("defaults") or {})
    raw = apply_overrides(raw, list(overrides or []))
    unknown = sorted(set(raw) - set(EXPERIMENT_KEYS))
    if unknown:
        raise ConfigError(
            f"{path}: unknown top-level key(s) {', '.join(unknown)} in a multi-stage experiment; allowed: "
            f"{', '.join(EXPERIMENT_KEYS + STAGE_SECTIONS)} (other stage settings go under defaults or stages.NAME)"
        )
    stages = raw["stages"]
    if not isinstance(stages, dict) or not stages:
        raise ConfigError(f"{path}: stages must be a non-empty mapping of stage name to settings")
    name = raw.get("name")
    if not name:
        raise ConfigError(f"{path}: name: required key is missing")
    run_path = Path(str(raw.get("run_dir", "runs/{name}")).format(name=name)).absolute()
    # storage: object storage for every stage's checkpoints and export (STORAGE/STAGE/...), so stages may
    # run on machines that share no filesystem; run_dir stays the node-local scratch and MLflow file.
    storage = raw.get("storage")
    storage = None if storage is None else str(storage).format(name=name)

    def stored(*parts: str) -> str:  # storage/parts, keeping a ?query (s3 endpoint options) at the end
        base, _, query = storage.partition("?")
        joined = "/".join([base.rstrip("/"), *parts])
        return f"{joined}?{query}" if query else joined

    tracking = dict(raw.get("tracking") or {})
    uri = tracking.get("uri") or f"sqlite:///{run_path / 'mlflow.db'}"
    resolved: list[tuple[str, StageConfig]] = []
    for stage_name, stage_raw in stages.items():
        if not isinstance(stage_raw, dict):
            raise ConfigError(f"{path}: stages.{stage_name} must be a mapping")
        merged = _deep_merge(raw.get("defaults") or {}, stage_raw)
        merged = _deep_merge({"cluster": raw.get("cluster") or {}}, merged)
        merged.update(name=stage_name, seed=raw.get("seed", 0), run_dir=str(run_path / stage_name),
                      tracking={**tracking, **(merged.get("tracking") or {}), "uri": uri, "experiment": name})  # fmt: skip
        if storage is not None:
            merged["checkpoint"] = {"uri": stored(stage_name), **(merged.get("checkpoint") or {})}
        init = (merged.get("model") or {}).get("init_from")
        if init is not None and init in stages:
            if init not in [n for n, _ in resolved]:
                raise ConfigError(
                    f"{path}: stages.{stage_name}.model.init_from: stage {init!r} does not run before it"
                )
            merged["model"]["init_from"] = (
                stored(init, "export") if storage else str(run_path / init / "export")
            )
        teacher = ((merged.get("objective") or {}).get("teacher") or {}).get("weights")
        if teacher is not None and teacher in stages:
            if teacher not in [n for n, _ in resolved]:
                raise ConfigError(
                    f"{path}: stages.{stage_name}.objective.teacher.weights: stage {teacher!r} does not run "
                    "before it"
                )
            merged["objective"]["teacher"]["weights"] = (
                stored(teacher, "export") if storage else str(run_path / teacher / "export")
            )
        resolved.append((stage_name, validate_config(merged, source=f"{path} stages.{stage_name}")))
    return Experiment(name=name, run_path=run_path, tracking_uri=uri, stages=resolved, source=str(path))


def reference() -> str:
    """Every section and field with its type, default and description (docs/config.md is this text)."""
    out = [
        "# Configuration reference",
        "",
        "Generated by `python -m pipeline.config`; the schema is `pipeline/config.py`.",
        "",
    ]

    def section(title: str, model: type[BaseModel]) -> None:
        out.extend([f"## `{title}`", "", "| key | type | default | meaning |", "|---|---|---|---|"])
        nested = []
        for name, field in model.model_fields.items():
            ann = field.annotation
            sub = next(
                (
                    a
                    for a in (ann, *getattr(ann, "__args__", ()))
                    if isinstance(a, type) and issubclass(a, BaseModel)
                ),
                None,
            )
            type_name = ann.__name__ if isinstance(ann, type) else str(ann).replace("typing.", "")
            type_name = type_name.replace("|", "\\|")  # inside a Markdown table cell
            default = (
                "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
            )
            if sub is not None:
                nested.append((f"{title}.{name}" if title != "experiment" else name, sub))
                default = "see below"
            desc = (field.description or "").replace("|", "\\|")
            out.append(f"| `{name}` | `{type_name}` | {default.replace('|', chr(92) + '|')} | {desc} |")
        out.append("")
        for t, m in nested:
            section(t, m)

    section("experiment", StageConfig)
    out.extend(["## Multi-stage experiments", "", Experiment.__doc__ or ""])
    return "\n".join(out)


if __name__ == "__main__":
    print(reference())
