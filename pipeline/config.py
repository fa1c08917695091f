"""The typed config tree: YAML in, a validated `StageConfig` (one stage) or `Experiment` (stages) out.

    cfg = load_config("configs/experiments/smoke.yaml", ["optim.steps=100", "cluster.num_workers=2"])
    exp = load_experiment("configs/experiments/demo.yaml", ["stages.finetune.optim.steps=100"])
    check_inputs(exp)    # entry points, before any worker or cluster resource starts: datasets exist

Every section is a pydantic model that forbids unknown keys, and so is the multi-stage file
(`ExperimentFile`), so a misspelled key or a value of the wrong type fails at load time with a
`ConfigError` naming the file, the dotted key path and what was expected (with a "did you mean").
Loading also checks `model.name` against the model registry and `model.overrides` against what that
model's constructor accepts, and makes every local path absolute against the CWD (the one place
paths are resolved: workers may start in other directories). Code reads typed fields only
(`cfg.optim.lr`), never `dict.get(key, default)`.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import pydantic
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from data_prep import atomic
from data_prep.dataset_dir import names_shards
from data_prep.layout import DatasetError, read_manifest
from data_prep.synthetic import LAYOUT_MAX_OBJECTS, LAYOUT_MIN_SIDE
from pipeline.tracking import replica_name


class ConfigError(ValueError):
    """A config file or override that does not fit the schema; the message says where and why."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _is_remote(path: str) -> bool:
    return "://" in path or path.startswith("pipe:")


def local_abspath(path: str) -> str:
    """A local path made absolute against the CWD; a URI (`s3://...`, `pipe:...`) as it is. Each part of
    a '::'-joined shard list on its own."""
    if "::" in path:
        return "::".join(local_abspath(part) for part in path.split("::"))
    if _is_remote(path):
        return path
    if path.startswith("file:"):
        return "file:" + os.path.abspath(path.removeprefix("file:"))
    return os.path.abspath(path)


def _run_dir(run_dir: str, name: str) -> str:
    try:
        return os.path.abspath(run_dir.format(name=name))
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"run_dir {run_dir!r}: only {{name}} expands here ({exc!r})") from None


class ModelConfig(_Section):
    name: str = Field(
        "vit_debug",
        description="Registered model name, see `pipeline.models.list_models()`. timm's name of a plain ViT "
        "(vit_base_patch16_384, deit_small_patch16_224) is read as ours (vit_b16, vit_s16) with its resolution "
        "as img_size unless img_size is set.",
    )
    img_size: int = Field(32, gt=0, description="Training resolution in pixels (square).")
    num_classes: int | None = Field(
        None,
        gt=0,
        description="Classifier outputs; null takes the class count from the dataset manifest (for objective "
        "segmentation: its segmentation_classes; detection: its detection_classes).",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword overrides passed to `create_model` (e.g. pos_embed, pool, drop_path_rate); "
        "checked at load against the options the named model's constructor accepts.",
    )
    init_from: str | None = Field(
        None,
        description="Start from exported weights: an export folder or .safetensors file, public weights in the "
        "timm layout (timm, DeiT and MAE .pth/.bin/.safetensors files, or a timm folder with config.json; a "
        "file so named is checked against model.name: deit_base_patch16_224-*.pth is vit_b16), or (in a "
        "multi-stage experiment) the name of an earlier stage. Position embeddings are resampled to img_size.",
    )
    init_head: bool = Field(
        False, description="Also load the classifier head from init_from (else a new zero head)."
    )
    patch_dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="FLIP patch dropout (supervised objectives, plain ViTs): in training each image keeps a "
        "random 1 - patch_dropout of its patch tokens (prefix tokens always); evaluation sees all of them. "
        "FLOPs and MFU count the kept tokens.",
    )
    compile: bool = Field(
        False,
        description="Run the model under torch.compile inside the DeepSpeed engine (every ZeRO stage); the "
        "first steps pay the compilation.",
    )
    grad_checkpointing: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Activation checkpointing: the fraction of the transformer blocks whose activations are "
        "recomputed in backward instead of kept (0 none, 1 every block, 0.5 every second block; true/false "
        "mean 1/0). A checkpointed block keeps only its input ([B, N, D]) and runs its forward again in "
        "backward: at fraction f the blocks' activation memory falls to about (1 - f) of it, plus f x one "
        "input per block, and a step costs (3 + f) instead of 3 forwards (perf/hfu counts the recompute, "
        "perf/mfu does not). Use the smallest f at which the micro-batch fits.",
    )

    @model_validator(mode="before")
    @classmethod
    def _published_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("name"), str):
            from pipeline.models.convert import TIMM_NAMES  # torch: only when a name is given

            found = re.fullmatch(r"(.+)_(\d+)", data["name"])
            if found and found.group(1) in TIMM_NAMES and found.group(1).startswith(("vit_", "deit_")):
                data = {"img_size": int(found.group(2)), **data, "name": TIMM_NAMES[found.group(1)]}
        return data

    @field_validator("grad_checkpointing", mode="before")
    @classmethod
    def _checkpointing_flag(cls, v: Any) -> Any:
        return float(v) if isinstance(v, bool) else v

    @field_validator("init_from")
    @classmethod
    def _absolute_init_from(cls, v: str | None) -> str | None:
        return None if v is None else local_abspath(v)


class SyntheticDataConfig(_Section):
    num: int = Field(320, gt=0, description="Images to generate.")
    classes: int = Field(
        8, gt=1, description="Number of classes (not with layout, which has 3 * objects + 4 classes)."
    )
    labels_per_image: float = Field(
        1.3, ge=1.0, description="Mean labels per image (multi-label corpus; not with layout)."
    )
    width: int = Field(48, gt=0, description="Generated image width in pixels.")
    height: int = Field(40, gt=0, description="Generated image height in pixels.")
    max_count: int = Field(40, gt=0, description="Samples per shard.")
    val_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="Fraction held out as the val split.")
    layout: bool = Field(
        False,
        description="Generate the layout corpus (`data_prep.synthetic`): 2-4 objects of `objects` types per "
        "image, labelled by where they are ({type}_top, {type}_bottom, {type}_left_of_{next type}, "
        "crowded_{tl,tr,bl,br}: 3 * objects + 4 classes, derived from objects; classes and labels_per_image "
        "do not apply), each image with its per-pixel object mask (KEY.seg.png; the manifest's "
        "segmentation_classes). Images need a shorter side of at least 16 px.",
    )
    objects: int = Field(
        6,
        ge=2,
        le=LAYOUT_MAX_OBJECTS,
        description="Object types of the layout corpus (a distinct shape and colour each).",
    )

    @model_validator(mode="after")
    def _layout_fits(self) -> SyntheticDataConfig:
        if self.layout and min(self.width, self.height) < LAYOUT_MIN_SIDE:
            raise ValueError(
                f"layout images of {self.width}x{self.height} px: the shorter side must be at least "
                f"{LAYOUT_MIN_SIDE} (objects are 1/5 to 1/3 of it)"
            )
        return self


class DataConfig(_Section):
    train: str = Field(
        ...,
        description="Dataset written by `vitpipe shard`: a folder (relative paths resolve against the CWD) or an "
        "object store prefix (s3://bucket/prefix, gs://...; credentials from the environment), whose train split "
        "is read with the manifest's exact counts; or a brace pattern / URL of shards (local, s3://, pipe:, http).",
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
    hflip: bool = Field(
        True,
        description="Random horizontal flips (off for digits, text, and the layout corpus, whose left_of labels "
        "a flip would swap).",
    )
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
    min_scale: float = Field(
        0.35,
        gt=0.0,
        le=1.0,
        description="RandomResizedCrop lower area bound; 1.0 keeps the whole image (the layout corpus: a crop "
        "moves objects across the halves and quadrants its labels name).",
    )
    mean: tuple[float, float, float] | None = Field(
        None,
        description="Per-channel mean (of pixels in 0..1) the model's inputs are normalised with, set with "
        "data.std. Null: what model.init_from's export recorded (a timm folder's config.json too), else the "
        "model family's, as its published weights use: 0.5 for ViT (big_vision; timm's AugReg weights), "
        "hybrid, masked patch prediction, SETR, DETR and TNT; ImageNet's (0.485, 0.456, 0.406 / 0.229, "
        "0.224, 0.225) for MAE, Swin, CvT, LeViT and SimMIM. Decided when the stage starts; exports record it.",
    )
    std: tuple[float, float, float] | None = Field(
        None, description="Per-channel standard deviation, with data.mean (null: as data.mean says)."
    )
    decode: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="Where training images are decoded. `cpu`: PIL in the loader workers. `cuda`: the workers "
        "only draw each crop and flip; JPEGs are decoded in batches on the GPU (nvJPEG, torchvision's "
        "decode_jpeg) and cropped, resized and flipped there. Needs cluster.use_gpu and the `gpu` extra; "
        "RandAugment stays CPU-only. Other formats (PNG, WebP) are decoded on the CPU either way.",
    )

    @field_validator("train")
    @classmethod
    def _absolute_train(cls, v: str) -> str:
        return local_abspath(v)

    @model_validator(mode="after")
    def _mean_with_std(self) -> DataConfig:
        if (self.mean is None) != (self.std is None):
            raise ValueError(
                "data.mean and data.std go together: set both, or neither (the model's defaults)"
            )
        if self.std is not None and min(self.std) <= 0:
            raise ValueError(f"data.std: every channel's must be > 0, got {list(self.std)}")
        return self


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

    @field_validator("weights")
    @classmethod
    def _absolute_weights(cls, v: str) -> str:
        return local_abspath(v)


class ObjectiveConfig(_Section):
    name: Literal[
        "supervised_softmax",
        "supervised_sigmoid",
        "mae",
        "simmim",
        "masked_patch_prediction",
        "distill",
        "segmentation",
        "detection",
    ] = Field(
        "supervised_softmax",
        description="Training objective; mae needs an mae_* model, simmim a simmim_* model (Swin, CvT, TNT), "
        "segmentation a setr_* model and a dataset with masks (per-pixel cross-entropy; its eval stage reports "
        "mIoU and pixel accuracy), detection a detr_* model and a dataset with boxes (DETR's set loss: "
        "Hungarian matching, class cross-entropy, L1 and GIoU, at every decoder layer; its eval stage reports "
        "COCO box AP).",
    )
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=1.0, description="Label smoothing (softmax, distill and segmentation)."
    )
    head_bias_init: float | None = Field(
        None,
        description="Classifier bias init; null means 0 for softmax and segmentation and -10 for sigmoid "
        "(big_vision).",
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
    no_object_weight: float = Field(
        0.1,
        gt=0.0,
        le=1.0,
        description="Detection: weight of the 'no object' class in the class cross-entropy (DETR's eos_coef).",
    )
    detection_weights: tuple[
        Annotated[float, Field(ge=0.0)], Annotated[float, Field(ge=0.0)], Annotated[float, Field(ge=0.0)]
    ] = Field(
        (1.0, 5.0, 2.0),
        description="Detection: weights of (class, box L1, generalized IoU) in the matching cost and the loss "
        "alike (DETR's 1, 5, 2).",
    )
    aux_loss: bool = Field(
        True,
        description="Detection: also apply the set loss to every earlier decoder layer's predictions (each "
        "matched on its own), as DETR does; false: the last layer only.",
    )

    @model_validator(mode="after")
    def _check(self) -> ObjectiveConfig:
        if self.name == "distill" and self.teacher is None:
            raise ValueError("objective.teacher is required for objective.name: distill")
        return self


class OptimConfig(_Section):
    lr: float | None = Field(
        None,
        gt=0.0,
        description="Peak learning rate (after warmup), as given, whatever the batch (timm, OpenCLIP, "
        "big_vision, torchtitan). Set lr or base_lr; neither means lr 1e-3.",
    )
    base_lr: float | None = Field(
        None,
        gt=0.0,
        description="Batch-scaled learning rate (MAE's blr): the peak is base_lr * global_batch / 256 "
        "(Goyal et al.; MAE, DeiT). Set lr or base_lr, not both.",
    )
    weight_decay: float = Field(0.05, ge=0.0, description="Decoupled weight decay (AdamW).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    steps: int = Field(40, gt=0, description="Total optimizer steps of the stage.")
    warmup_steps: int = Field(5, ge=0, description="Linear warmup steps.")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    grad_clip: float = Field(1.0, ge=0.0, description="Global gradient-norm clip; 0 disables.")
    layer_decay: float | None = Field(
        None, gt=0.0, le=1.0, description="Layer-wise lr decay (fine-tuning, e.g. 0.75); null disables."
    )
    ema_decay: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="Weight EMA (DeiT: 0.99996, big_vision): ema = decay * ema + (1 - decay) * weights after every "
        "optimizer step, in fp32, from the stage's first weights; each rank keeps its own share, checkpointed "
        "with it (resumable on any world size). Exported as export/model_ema.safetensors; an eval stage of the "
        "export logs eval_ema/* beside eval/*. Null disables.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_lr(cls, data):
        if isinstance(data, dict) and data.get("lr") is None and data.get("base_lr") is None:
            return {**data, "lr": 1e-3}
        return data

    @model_validator(mode="after")
    def _one_lr(self) -> OptimConfig:
        if self.lr is not None and self.base_lr is not None:
            raise ValueError(
                f"optim.lr ({self.lr:g}, the peak as given) and optim.base_lr ({self.base_lr:g}, scaled by "
                "global_batch / 256) are both set in one place: keep one (a preset, a stage's own section or "
                "an override that sets one replaces the other)"
            )
        return self


class DeepSpeedConfig(_Section):
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="ZeRO stage.")
    precision: Literal["fp32", "bf16", "fp16"] | None = Field(
        None,
        description="Training precision; null means bf16 on GPUs and fp32 on CPU (with cluster.use_gpu: "
        "auto, decided when the stage starts). Under bf16 "
        "gradients are reduced across ranks in fp32 (DeepSpeed's communication_data_type). fp16 is refused "
        "(see the error it gives).",
    )
    tf32: bool = Field(
        True, description="On GPU, run the remaining fp32 matmuls and convolutions on TF32 tensor cores."
    )
    overlap_comm: bool = Field(
        True,
        description="ZeRO 1-3: reduce gradients while the backward pass runs. On CUDA, ZeRO-1/2 then "
        "synchronize the device once per backward (DeepSpeed); turn off on one GPU, where nothing is reduced.",
    )
    grad_accum: int = Field(1, gt=0, description="Gradient accumulation steps.")
    global_batch_tolerance: float = Field(
        0.02,
        ge=0.0,
        lt=1.0,
        description="A resume on another number of ranks keeps the checkpoint's global batch by adjusting "
        "grad_accum. Where none keeps it exactly (16,384 on 1,016 ranks: one node of 128 lost), the nearest "
        "global batch within this fraction of it is taken and the learning rate scaled by the same ratio "
        "(the linear rule); beyond it the resume is refused, naming the numbers of ranks that fit. 0: exact only.",
    )
    offload_optimizer: bool = Field(False, description="ZeRO CPU offload of the optimizer state.")
    offload_params: bool = Field(False, description="ZeRO-3 CPU offload of the parameters.")

    @field_validator("precision")
    @classmethod
    def _no_fp16(cls, v: str | None) -> str | None:
        if v == "fp16":
            raise ValueError(
                "fp16 is not offered: DeepSpeed cannot run it on a CPU, so no test of this project covers it, "
                "and fp16 needs a loss scale that bf16 does not. Use bf16 on GPUs with bf16 tensor cores "
                "(A100, H100, H200, L40S, ...), or fp32 on GPUs without them (V100, T4)"
            )
        return v


class ClusterConfig(_Section):
    launcher: Literal["local", "ray"] = Field(
        "ray", description="`ray`: Ray Train workers; `local`: this process (or torchrun's processes)."
    )
    num_workers: int | tuple[int, int] = Field(
        2,
        description="Training workers (ranks) for the Ray launcher; [MIN, MAX] makes the stage elastic: Ray "
        "Train starts it on as many as fit and restarts it on the workers left after a node is lost, from "
        "the newest checkpoint resharded (the global batch stays micro-batch x grad_accum x MAX).",
    )
    use_gpu: bool | Literal["auto"] = Field(
        "auto",
        description="true: one GPU per worker, NCCL backend; false: CPU and gloo. `auto`: GPUs when there "
        "are some, decided where the stage starts: by the Ray launcher from the cluster's GPU resources, "
        "by the local launcher (and each torchrun rank) from torch.cuda.is_available().",
    )
    cpus_per_worker: float = Field(1.0, gt=0.0, description="CPUs reserved per worker.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement group strategy."
    )
    address: str | None = Field(
        None, description="Ray address; null uses RAY_ADDRESS or starts a local Ray instance."
    )
    max_failures: int = Field(0, ge=-1, description="Worker-group restarts Ray Train allows (-1: unlimited).")

    @field_validator("num_workers")
    @classmethod
    def _workers(cls, v: int | tuple[int, int]) -> int | tuple[int, int]:
        low, high = (v, v) if isinstance(v, int) else v
        if not 0 < low <= high:
            raise ValueError(f"expected a number of workers > 0, or [MIN, MAX] with 0 < MIN <= MAX; got {v}")
        return v

    @property
    def elastic(self) -> bool:
        return not isinstance(self.num_workers, int)

    @property
    def max_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]


class TrackingConfig(_Section):
    uri: str | None = Field(
        None, description="MLflow tracking URI; null means sqlite:///<run_dir>/mlflow.db."
    )
    experiment: str | None = Field(None, description="MLflow experiment name; null means the config's name.")
    log_every: int = Field(
        20,
        gt=0,
        description="Every N steps the ranks read their losses to the host, agree on stop requests and log; "
        "between log steps a step makes no host sync. A stop request takes effect at the next log step.",
    )
    peak_tflops: float | None = Field(
        None,
        gt=0.0,
        description="Per-device peak for MFU; null looks the GPU up by name in `pipeline.hardware.PEAK_TABLE` "
        "(dense; e.g. H100/H200 SXM bf16 989, A100 bf16 312) for the stage's precision. No peak, no MFU.",
    )
    system_metrics: bool = Field(True, description="Log CPU, memory (and GPU) use with MLflow's sampler.")


class CheckpointConfig(_Section):
    every_steps: int = Field(0, ge=0, description="Save every N steps; 0 saves only at the end.")
    keep_last: int = Field(2, gt=0, description="Checkpoints kept on disk.")
    asynchronous: bool = Field(
        True,
        description="The step waits only for a copy of the state in host memory; writing, hashing and uploading "
        "run beside training, one save at a time, and the tag is marked complete once every rank's files are "
        "written (and uploaded). False: every save completes before training goes on.",
    )
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
    nan_rank: int | None = Field(
        None,
        ge=0,
        description="Rank whose loss is made NaN at nan_at_step (tests of the non-finite-loss stop).",
    )
    nan_at_step: int | None = Field(
        None, gt=0, description="Step at which nan_rank's loss is NaN (every run)."
    )
    resume_optimizer: bool = Field(True, description="False resumes weights only (a negative control).")
    step_delay_s: float = Field(
        0.0,
        ge=0.0,
        description="Sleep after every step: a tiny run lasts long enough for a test to kill a node.",
    )


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
        "precision@1 for multi-label; needs model.init_head: true. A SETR export (objective segmentation) is "
        "evaluated per pixel instead (mIoU, pixel and mean class accuracy, a mask figure), a DETR export "
        "(objective detection) per box (COCO mAP@[.5:.95], AP50, AP75 by pycocotools, a box figure); few-shot and "
        "the probe do not apply to them.",
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
    crop_fraction: float = Field(
        0.875,
        gt=0.0,
        le=1.0,
        description="Eval images are resized so that the centre crop of this fraction of the shorter side is "
        "img_size (ImageNet's 0.875); 1.0 keeps the whole shorter side (square images: the whole image, as "
        "training with data.min_scale 1.0 sees it).",
    )
    interpolation: Literal["bilinear", "bicubic"] | None = Field(
        None,
        description="Resampling of eval images (antialiased). Null: what model.init_from's export recorded, "
        "else bicubic, as timm, DeiT and MAE evaluate every family here. Training crops stay bilinear.",
    )
    ema: bool = Field(
        True,
        description="Where model.init_from is an export folder with EMA weights (optim.ema_decay), evaluate "
        "them too, with the same passes: their metrics are logged as eval_ema/* beside eval/*.",
    )


PATCH_DROPOUT_OBJECTIVES = ("supervised_softmax", "supervised_sigmoid", "distill")


class StageConfig(_Section):
    name: str = Field(
        ...,
        min_length=1,
        description="Stage name (in a one-stage file also the experiment's); names the run directory and, "
        "unless tracking.experiment is set, the MLflow experiment.",
    )
    kind: Literal["train", "eval"] = Field(
        "train",
        description="`train`: the training loop; `eval`: evaluate model.init_from's export (section eval).",
    )
    seed: int = Field(0, description="Root seed: model init, data order, augmentation.")
    run_dir: str = Field(
        "runs/{name}",
        validate_default=True,
        description="Output folder; `{name}` expands; relative to the CWD (made absolute at load).",
    )
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
        if self.deepspeed.precision is None and self.cluster.use_gpu != "auto":
            self.deepspeed.precision = "bf16" if self.cluster.use_gpu else "fp32"
        if self.data.decode == "cuda":
            if self.cluster.use_gpu is False:
                raise ValueError("data.decode: cuda decodes on the GPU, so it needs cluster.use_gpu: true")
            if self.data.randaugment is not None:
                raise ValueError("data.decode: cuda has no RandAugment (a PIL op): set data.decode: cpu")
        if self.model.patch_dropout and self.objective.name not in PATCH_DROPOUT_OBJECTIVES:
            raise ValueError(
                f"model.patch_dropout is for supervised training ({', '.join(PATCH_DROPOUT_OBJECTIVES)}); "
                f"objective {self.objective.name} sees every patch (MAE drops its own)"
            )
        segmenter = self.model.name.startswith("setr_")
        if (self.objective.name == "segmentation") != segmenter:
            raise ValueError(
                "objective segmentation needs a SETR model (model.name: setr_pup_vit_b16, setr_naive_vit_debug, ...)"
                if not segmenter
                else f"model {self.model.name} is a segmentation model: set objective.name: segmentation"
            )
        if segmenter and self.data.synthetic is not None and not self.data.synthetic.layout:
            raise ValueError(
                "objective segmentation needs masks: data.synthetic generates them only with layout: true"
            )
        if segmenter and self.data.randaugment is not None:
            raise ValueError(
                "objective segmentation has no RandAugment (its ops would move pixels off their masks)"
            )
        if segmenter and self.data.decode == "cuda":
            raise ValueError("objective segmentation decodes its masks on the CPU: set data.decode: cpu")
        detector = self.model.name.startswith("detr_")
        if (self.objective.name == "detection") != detector:
            raise ValueError(
                "objective detection needs a DETR model (model.name: detr_vit_b16, detr_vit_debug, ...)"
                if not detector
                else f"model {self.model.name} is a detection model: set objective.name: detection"
            )
        if detector and self.data.synthetic is not None and not self.data.synthetic.layout:
            raise ValueError(
                "objective detection needs boxes: data.synthetic generates them only with layout: true"
            )
        if detector and self.data.randaugment is not None:
            raise ValueError(
                "objective detection has no RandAugment (its ops would move pixels off their boxes)"
            )
        if detector and self.data.decode == "cuda":
            raise ValueError(
                "objective detection decodes its boxes with the image on the CPU: set data.decode: cpu"
            )
        if self.deepspeed.offload_params and self.deepspeed.zero_stage != 3:
            raise ValueError("deepspeed.offload_params needs deepspeed.zero_stage: 3")
        if self.optim.warmup_steps > self.optim.steps:
            raise ValueError(
                f"optim.warmup_steps ({self.optim.warmup_steps}) exceeds optim.steps ({self.optim.steps})"
            )
        if self.cluster.elastic and self.kind == "train":
            # Ray may run the stage on any size in the range; each must make the global batch
            # micro-batch x grad_accum x MAX with a whole grad_accum, or come within the tolerance of it.
            low, high = self.cluster.num_workers
            micro, accum, tolerance = (
                self.data.batch_size,
                self.deepspeed.grad_accum,
                self.deepspeed.global_batch_tolerance,
            )
            target = micro * accum * high
            bad = [w for w in range(low, high + 1) if nearest_accum(target, micro, w)[1] > tolerance]
            if bad:
                fits = [w for w in range(low, high + 1) if w not in bad]
                raise ValueError(
                    f"cluster.num_workers [{low}, {high}]: the global batch ({micro} x grad_accum {accum} x {high}) "
                    f"cannot be kept on {', '.join(map(str, bad))} workers (grad_accum x {high} = {accum * high} "
                    f"is not a multiple of it, and the nearest global batch is more than "
                    f"deepspeed.global_batch_tolerance, {tolerance:g}, off); Ray may start the stage on any size in "
                    f"the range, so narrow it (sizes that fit: {fits}) or raise deepspeed.grad_accum"
                )
        if self.kind == "eval":
            if self.model.init_from is None:
                raise ValueError("kind: eval needs model.init_from (an export folder or an earlier stage)")
            if segmenter and not self.model.init_head:
                raise ValueError(
                    "a segmentation eval stage runs the exported SETR decoder, so it needs model.init_head: true"
                )
            if detector and not self.model.init_head:
                raise ValueError(
                    "a detection eval stage runs the exported DETR decoder, so it needs model.init_head: true"
                )
            if self.eval.classification and not self.model.init_head:
                raise ValueError(
                    "eval.classification runs the exported head, so it needs model.init_head: true "
                    "(or set eval.classification: false to evaluate features only)"
                )
        return self

    @field_validator("run_dir")
    @classmethod
    def _absolute_run_dir(cls, v: str, info: pydantic.ValidationInfo) -> str:
        return v if "name" not in info.data else _run_dir(v, info.data["name"])

    # Derived quantities, one definition each.
    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    @property
    def tracking_uri(self) -> str:
        return self.tracking.uri or f"sqlite:///{self.run_path / 'mlflow.db'}"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def on_device(self, gpu: bool) -> StageConfig:
        """This config with `cluster.use_gpu: auto` decided (`gpu`: CUDA present in this process, or GPUs in
        the Ray cluster) and a null precision resolved with it; a config that sets use_gpu is returned
        as it is. Raises ConfigError where the decision breaks a rule (data.decode: cuda without GPUs)."""
        if self.cluster.use_gpu != "auto":
            return self
        data = self.model_dump(mode="json")
        data["cluster"]["use_gpu"] = bool(gpu)
        found = "found GPUs" if gpu else "found no GPU"
        return validate_config(
            data, source=f"{self.name} (cluster.use_gpu: auto {found} where the stage starts)"
        )


# ---------------------------------------------------------------- reading and validating


def nearest_accum(global_batch: int, micro_batch: int, world_size: int) -> tuple[int, float]:
    """The grad_accum (at least 1) whose micro_batch x grad_accum x world_size comes nearest global_batch,
    and how far off that is, as a fraction of global_batch (0.0: exactly)."""
    accum = max(1, round(global_batch / (micro_batch * world_size)))
    return accum, abs(micro_batch * accum * world_size - global_batch) / global_batch


def parse_override(text: str) -> tuple[list[str], Any]:
    """`optim.lr=3e-4` -> (["optim", "lr"], 0.0003); the value is parsed as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: expected KEY.PATH=VALUE, e.g. optim.lr=3e-4")
    return key.split("."), yaml.safe_load(value) if value != "" else ""


# Two ways to give one setting: a layer (a preset, the file, a stage's own section, an override) that sets
# one of them replaces the other from the layers under it; one layer that sets both is an error.
_ONE_OF = {("optim", "lr"): "base_lr", ("optim", "base_lr"): "lr"}


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
        other = _ONE_OF.get(tuple(path[-2:]))
        if other is not None and value is not None:
            node.pop(other, None)
    return raw


def _inner(ann: Any) -> Any:
    """The section type behind an annotation: a BaseModel subclass, `dict` for a mapping of sections
    (then `_inner` of its value type follows), or None for a plain value."""
    origin = typing.get_origin(ann)
    if origin in (Union, types.UnionType):
        return next((t for t in map(_inner, typing.get_args(ann)) if t is not None), None)
    if origin is dict and _inner(typing.get_args(ann)[1]) is not None:
        return ann
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _allowed_keys(schema: type[BaseModel], loc: tuple) -> list[str]:
    """The field names valid at the section that holds `loc[-1]`."""
    node: Any = schema
    parts = list(loc[:-1])
    while parts:
        if typing.get_origin(node) is dict:  # a mapping of sections (`stages`): skip the key
            parts.pop(0)
            node = _inner(typing.get_args(node)[1])
            continue
        field = node.model_fields.get(str(parts.pop(0)))
        node = _inner(getattr(field, "annotation", None))
        if node is None:
            return []
    return list(node.model_fields) if isinstance(node, type) else []


# Keys a stage of a multi-stage file may not set: the experiment sets them for every stage.
_EXPERIMENT_WIDE = {
    "name": "a stage's name is its key under stages",
    "seed": "set seed once at the top of the file: every stage gets the experiment's seed",
    "seeds": "set seeds once at the top of the file: every stage runs once per seed",
    "run_dir": "set run_dir once at the top of the file: stage STAGE runs in RUN_DIR/STAGE",
}
# Top-level keys of a multi-stage file that a one-stage file does not have.
_MULTI_STAGE_KEYS = ("stages", "defaults", "storage", "seeds")


# Keys that moved: (section, key) -> what to write now.
_MOVED_KEYS = {
    ("deepspeed", "activation_checkpointing"): "moved to model.grad_checkpointing: a fraction of the blocks "
    "(true is 1.0, every block)",
    ("optim", "scale_lr"): "removed: optim.lr is now the peak learning rate as given; for lr = x * "
    "global_batch / 256 write optim.base_lr: x instead of optim.lr (MAE's blr)",
}


def _unknown_key(schema: type[BaseModel], loc: tuple) -> str:
    key = str(loc[-1])
    if tuple(map(str, loc[-2:])) in _MOVED_KEYS:
        return _MOVED_KEYS[tuple(map(str, loc[-2:]))]
    if (
        schema is ExperimentFile
        and len(loc) in (2, 3)
        and loc[0] in ("defaults", "stages")
        and key in _EXPERIMENT_WIDE
    ):
        return f"not a stage key here: {_EXPERIMENT_WIDE[key]}"
    allowed = _allowed_keys(schema, loc)
    one_stage_top = schema is StageConfig and len(loc) == 1
    if one_stage_top and key == "seeds":  # else "did you mean 'seed'", which is not what was meant
        return (
            "seeds repeats the stages of a multi-stage experiment file (one with `stages`, run by "
            "`vitpipe run`); a one-stage file has one `seed`"
        )
    candidates = allowed + (list(_MULTI_STAGE_KEYS) if one_stage_top else [])
    close = difflib.get_close_matches(key, candidates, n=1)
    hint = ""
    if close:
        multi = close[0] not in allowed
        hint = f"; did you mean {close[0]!r}{' (a key of multi-stage experiment files)' if multi else ''}?"
    return f"unknown key{hint} allowed keys here: {', '.join(allowed)}"


def _header(source: str, count: int) -> str:
    return f"{source}: invalid config ({count} problem{'s' * (count > 1)})"


def _describe(err: ValidationError, source: str, schema: type[BaseModel]) -> str:
    lines = [_header(source, err.error_count())]
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: {_unknown_key(schema, loc)}")
        elif e["type"] == "missing":
            lines.append(f"  {key}: required key is missing")
        elif not loc:  # a cross-field rule: the message names its keys; the input would be the whole file
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {key}: {e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})")
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


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    if isinstance(out.get("optim"), dict) and isinstance(top.get("optim"), dict):
        given = [k for (_, k) in _ONE_OF if top["optim"].get(k) is not None]
        if len(given) == 1:  # the top layer's choice replaces the other way from below
            out["optim"] = {k: v for k, v in out["optim"].items() if k != _ONE_OF[("optim", given[0])]}
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
    """The schema alone (types, unknown keys, cross-field rules; local paths made absolute). `load_config`
    and `load_experiment` also check the model name and options against the registry."""
    try:
        return StageConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err, source, StageConfig)) from None


def raw_config(path: str | os.PathLike, overrides: list[str] | None = None) -> dict:
    """A config file as written: its `base:` presets merged under it and the overrides applied, nothing
    validated or resolved (relative paths stay relative). For checks of what the user wrote."""
    path = Path(path)
    raw = _with_bases(_read_yaml(path), path, seen=(path.resolve(),))
    return apply_overrides(raw, list(overrides or []))


def written_relative(raw: dict) -> list[tuple[str, str]]:
    """(setting, value) of the run folder and SQLite store a raw config (`raw_config`) names by a relative
    path, the default `runs/{name}` included: they resolve against the directory the config is loaded in."""
    run_dir = raw.get("run_dir")
    found = [] if run_dir is not None and os.path.isabs(run_dir) else [("run_dir", run_dir or "runs/{name}")]
    uri = (raw.get("tracking") or {}).get("uri")
    if isinstance(uri, str):
        if uri.startswith("sqlite:///"):
            path = uri.removeprefix("sqlite:///")  # sqlite:////abs/m.db is absolute
            relative = not path.startswith("/")
        else:  # an MLflow file store: a path, or file:PATH (not a server URI, nor databricks)
            path = uri.removeprefix("file://").removeprefix("file:")
            relative = ":" not in uri.removeprefix("file:") and not uri.startswith("databricks")
            relative = relative and not os.path.isabs(path)
        if relative:
            found.append(("tracking.uri", uri))
    return found


def datasets_written_relative(raw: dict) -> list[tuple[str, str]]:
    """(setting, value) of every `data.train` a raw config (`raw_config`) reads by a relative local path:
    a stage's own, or for the stages without one, the experiment's default. URIs (s3://..., pipe:) and
    absolute paths pass."""

    def train(section) -> str | None:
        data = section.get("data") if isinstance(section, dict) else None
        return data.get("train") if isinstance(data, dict) else None

    stages = raw.get("stages") or {}
    default = ("defaults.data.train", train(raw.get("defaults"))) if stages else ("data.train", train(raw))
    read = [
        (f"stages.{n}.data.train", train(s)) if train(s) is not None else default
        for n, s in stages.items()
        if s is not None  # a dropped stage (stages.NAME=null) reads nothing
    ]
    found = []
    for key, value in read or [default]:
        relative = isinstance(value, str) and not (":" in value.split("/")[0] or os.path.isabs(value))
        if relative and (key, value) not in found:
            found.append((key, value))
    return found


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> StageConfig:
    """Read a one-stage YAML file (and its `base:` presets), apply dotted overrides, validate, check the
    model. Relative paths resolve against the CWD."""
    raw = raw_config(path, overrides)
    return _checked(validate_config(raw, source=str(path)), source=str(path))


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


# ---------------------------------------------------------------- models: names and options per family


def _one_of(names: list[str]) -> str:
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _models() -> types.ModuleType:
    """The model registry, imported when a config is first checked: it loads torch (seconds), which the
    commands that import this module only for its types (`vitpipe --help`, `jobs`, `compare`) skip."""
    import pipeline.models  # heavy (torch), and needed only to check a loaded config: see the docstring

    return pipeline.models


def _build_on_meta(name: str, **kwargs: Any) -> Any:
    """Build registered model `name` on the meta device: every constructor check runs, no memory, no init."""
    import torch  # heavy: see _models

    with torch.device("meta"):
        return _models().create_model(name, **kwargs)


@functools.cache
def model_options(name: str) -> dict[str, inspect.Parameter]:
    """The keyword options `create_model(name, **options)` accepts, annotations resolved to types.

    Read from the constructor of the class `name` builds (found by building the default model once on
    the meta device: no memory, no init work) and, where that constructor passes `**kwargs` on to its
    `encoder` (masked-patch prediction's ViT, SimMIM's encoder), from the encoder's constructor too.
    """
    model = _build_on_meta(name)
    options: dict[str, inspect.Parameter] = {}
    while True:
        cls = type(model)
        params = inspect.signature(cls).parameters
        try:
            hints = typing.get_type_hints(cls.__init__)
        except (NameError, TypeError):  # an annotation that does not resolve: the options stay untyped
            hints = {}
        for p in params.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in options:
                options[p.name] = p.replace(annotation=hints.get(p.name, p.annotation))
        inner = getattr(model, "encoder", None)
        if inner is None or not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            return options
        model = inner


@functools.cache
def _adapter(annotation: Any) -> TypeAdapter | None:
    try:
        return TypeAdapter(annotation)
    except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticUserError, TypeError, NameError):
        return None  # an annotation pydantic cannot check (a tensor, a callable): the build below still runs


def model_problems(
    name: str,
    img_size: int | None,
    overrides: dict[str, Any],
    where: str,
    name_key: str = "name",
    num_classes: int | None = None,
) -> list[str]:
    """What is wrong with building registered model `name` with these options, one line per problem.

    The name must be registered (close matches are suggested); each override must be an option of that
    model's constructor (`model_options`) of the annotated type (a Literal lists its choices); then the
    model is built once on the meta device (no memory, no init work), so a combination its constructor
    refuses (an image size the patch size does not divide, a pooling the distillation token cannot use)
    fails here rather than in every worker.
    """
    models = _models().list_models()
    if name not in models:
        close = difflib.get_close_matches(name, models, n=4, cutoff=0.6)
        hint = f"did you mean {_one_of(close)}?" if close else f"registered: {', '.join(models)}"
        return [f"{where}.{name_key}: unknown model {name!r}; {hint}"]
    try:
        options = model_options(name)
    except Exception:  # the default model does not build (a future family): the build below says why
        options = {key: inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY) for key in overrides}
    problems = []
    for key, value in overrides.items():
        if key not in options:
            close = difflib.get_close_matches(str(key), list(options), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(
                f"{where}.overrides.{key}: not an option of {name}{hint} options: {', '.join(options)}"
            )
            continue
        adapter = _adapter(options[key].annotation)
        if adapter is None:
            continue
        try:
            adapter.validate_python(value)
        except ValidationError as err:
            first = err.errors()[0]
            at = "".join(f"[{p}]" for p in first["loc"])
            problems.append(f"{where}.overrides.{key}{at}: {first['msg']} (got {value!r})")
    if problems:
        return problems
    kwargs = {
        **({} if img_size is None else {"img_size": img_size}),
        **({} if num_classes is None else {"num_classes": num_classes}),
        **overrides,
    }
    try:
        _build_on_meta(name, **kwargs)
    except Exception as exc:  # whatever the constructor raises is the user's answer, with the keys named
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        return [f"{where}: {name}({shown}) cannot be built: {type(exc).__name__}: {exc}"]
    return []


def _checked(cfg: StageConfig, source: str) -> StageConfig:
    """`cfg` if its model (and distillation teacher) can be built as configured, else a ConfigError."""
    m, t = cfg.model, cfg.objective.teacher
    overrides = dict(m.overrides)
    problems = []
    if m.patch_dropout:
        if m.name in _models().list_models() and "patch_dropout" not in model_options(m.name):
            problems.append(
                f"model.patch_dropout: {m.name} has no patch dropout (the plain ViTs, vit_*, have)"
            )
        else:
            overrides["patch_dropout"] = m.patch_dropout
    problems += model_problems(m.name, m.img_size, overrides, "model", num_classes=m.num_classes)
    if t is not None:
        problems += model_problems(
            t.model,
            t.img_size or m.img_size,
            t.overrides,
            "objective.teacher",
            name_key="model",
            num_classes=m.num_classes,
        )
    if problems:
        raise ConfigError("\n  ".join([_header(source, len(problems)), *problems]))
    return cfg


# ---------------------------------------------------------------- multi-stage experiments


@functools.cache
def _partial(model: type[BaseModel], drop: tuple[str, ...] = (), name: str | None = None) -> type[BaseModel]:
    """`model`'s keys, every one optional, nested sections partial too: a section as written under
    `defaults` or a stage, checked for unknown keys before the stage is merged and validated whole."""
    fields: dict[str, Any] = {}
    for key, field in model.model_fields.items():
        if key in drop:
            continue
        sub = _inner(field.annotation)
        fields[key] = (
            (_partial(sub) | None) if sub is not None else Any,
            Field(None, description=field.description),
        )
    partial = pydantic.create_model(name or model.__name__, __base__=_Section, __module__=__name__, **fields)
    _PARTIAL_OF[partial] = model
    return partial


_PARTIAL_OF: dict[type[BaseModel], type[BaseModel]] = {}
# One stage's own keys in a multi-stage file: the experiment sets name, seed and run_dir for every stage.
StageSettings = _partial(StageConfig, drop=tuple(_EXPERIMENT_WIDE), name="StageSettings")
# Stage sections written at the top of a multi-stage file (e.g. by a `base:` preset) act as defaults.
TOP_LEVEL_STAGE_SECTIONS = ("model", "data", "objective", "optim", "deepspeed", "checkpoint", "eval", "debug")


class _ExperimentKeys(_Section):
    name: str = Field(
        ..., min_length=1, description="Experiment name: the run directory and MLflow experiment."
    )
    seed: int | None = Field(None, description="Root seed of every stage; null means 0 (or `seeds`).")
    seeds: list[pydantic.StrictInt] | None = Field(
        None,
        min_length=1,
        description="Run every stage once per seed (distinct ints, e.g. [0, 1, 2]) instead of one `seed`: "
        "stage STAGE becomes STAGE_s0, STAGE_s1, ... (all stages of the first seed, then the next seed), "
        "each with that seed and its own RUN_DIR/STAGE_sK; `init_from: STAGE` and `teacher.weights: STAGE` "
        "read the same seed's replica. Not with `seed` (override a file's: `seed=null seeds=[0,1,2]`). "
        "`vitpipe compare --over-seeds` shows the mean and standard error over the replicas.",
    )
    run_dir: str = Field(
        "runs/{name}",
        description="The experiment's folder (`{name}` expands); stage STAGE runs in RUN_DIR/STAGE.",
    )
    storage: str | None = Field(
        None,
        description="Object storage (e.g. `s3://bucket/runs/{name}`) for every stage's checkpoints and export, "
        "under STORAGE/STAGE/ (each stage's `checkpoint.uri`), for nodes without a shared file system; "
        "`init_from: STAGE` then reads STORAGE/STAGE/export.",
    )
    base: list[str] | str | None = Field(
        None, description="Preset files (relative to this file) merged under it, e.g. a deepspeed preset."
    )
    cluster: _partial(ClusterConfig) | None = Field(
        None, description="`cluster` keys for every stage (a stage's own `cluster` keys win)."
    )
    tracking: _partial(TrackingConfig) | None = Field(
        None,
        description="`tracking` keys for every stage; the experiment sets each stage's uri and experiment.",
    )
    defaults: StageSettings | None = Field(None, description="Stage keys merged under every stage.")
    stages: dict[str, StageSettings] = Field(
        ...,
        min_length=1,
        description="Stage name -> that stage's own keys (any stage key but name, seed and run_dir, which the "
        "experiment sets), run in this order; overrides read `stages.NAME.optim.steps=100` (with `seeds`, the "
        "name as written: the override applies to every replica); `stages.NAME=null` (or `NAME: null` in a "
        "file over a `base:`) drops a stage, and a stage that reads a dropped one is refused.",
    )

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, v: list[int] | None) -> list[int] | None:
        repeated = sorted({s for s in (v or []) if v.count(s) > 1})
        if repeated:
            raise ValueError(f"seeds must be distinct; repeated: {', '.join(map(str, repeated))}")
        return v

    @model_validator(mode="after")
    def _seed_or_seeds(self) -> _ExperimentKeys:
        if self.seed is not None and self.seeds is not None:
            raise ValueError(
                f"seed ({self.seed}) and seeds ({self.seeds}) are both set: keep one (seeds runs every stage "
                "once per seed); to replace a file's seed on the command line, pass seed=null seeds=[...]"
            )
        return self


ExperimentFile = pydantic.create_model(
    "ExperimentFile",
    __base__=_ExperimentKeys,
    __module__=__name__,
    __doc__="""A multi-stage experiment file as written: experiment-wide keys, `defaults` and `stages`.

    Each stage is `defaults` (under it, any stage section written at the top of the file, e.g. by a
    `base:` preset) deep-merged with `stages.NAME`, then validated as a whole stage. A file without
    `stages` is a one-stage experiment (a stage file).

    With `seeds: [0, 1, 2]` every stage runs once per seed, as stage STAGE_sK in RUN_DIR/STAGE_sK with
    seed K: every stage of seed 0 in file order, then every stage of seed 1, and so on, so a stage
    always runs after the stages it reads (`init_from` and `teacher.weights` naming a stage read that
    seed's replica), and the first seed's results are complete first. A finished replica is skipped
    on resubmission like any stage (RUN_DIR/STAGE_sK/DONE.json), so adding a seed later runs only the
    new replicas.""",
    **{
        s: (
            StageSettings.model_fields[s].annotation,
            Field(None, description=f"`{s}` defaults for every stage."),
        )
        for s in TOP_LEVEL_STAGE_SECTIONS
    },
)


class Experiment(BaseModel):
    """An experiment of stages run in order (pretrain -> fine-tune -> evaluate), each a full `StageConfig`."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    name: str
    run_path: Path
    tracking_uri: str
    stages: list[tuple[str, StageConfig]]
    source: str

    @property
    def parent_run_file(self) -> Path:
        return self.run_path / "parent_run.json"


def _dropped_stages(raw: dict, written: list[str], path: Path) -> set[str]:
    """Removes the stages set to null (`stages.NAME=null` on the command line, or `NAME: null` in a file
    over its `base:`), so the rest run as the experiment; returns their names. A null for a stage the
    experiment does not have is an error naming the ones it has."""
    stages = raw.get("stages")
    if not isinstance(stages, dict):
        return set()
    dropped = {name for name, settings in stages.items() if settings is None}
    unknown = sorted(dropped - set(written))
    if unknown:
        raise ConfigError(
            f"{path}: stages.{unknown[0]}=null drops a stage the experiment does not have "
            f"(its stages: {', '.join(written)})"
        )
    for name in dropped:
        del stages[name]
    if written and not stages:
        raise ConfigError(f"{path}: every stage is dropped (stages.NAME=null): nothing would run")
    return dropped


def _given(section: BaseModel | None) -> dict:
    """The keys a partial section was given (an explicit null included), as plain data."""
    return {} if section is None else section.model_dump(exclude_unset=True)


def _replaced(d: dict, keys: tuple[str, ...], value: Any) -> dict:
    """`d` with d[k0][k1]... = value, copying along the path (the dicts may be shared with other stages)."""
    head, *rest = keys
    return {**d, head: _replaced(d[head], tuple(rest), value) if rest else value}


def load_experiment(path: str | os.PathLike, overrides: list[str] | None = None) -> Experiment:
    """Read an experiment file (one stage, or `stages`), apply dotted overrides, validate every stage;
    with `seeds`, every stage once per seed (see `ExperimentFile`)."""
    path = Path(path)
    raw = _read_yaml(path)
    if "stages" not in raw:
        cfg = load_config(path, overrides)
        return Experiment(
            name=cfg.name,
            run_path=cfg.run_path,
            tracking_uri=cfg.tracking_uri,
            stages=[(cfg.name, cfg)],
            source=str(path),
        )
    raw = _with_bases(raw, path, seen=(path.resolve(),))
    written = list(raw["stages"]) if isinstance(raw.get("stages"), dict) else []
    raw = apply_overrides(raw, list(overrides or []))
    dropped = _dropped_stages(raw, written, path)
    try:
        f = ExperimentFile.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err, str(path), ExperimentFile)) from None
    try:
        run_path = Path(_run_dir(f.run_dir, f.name))
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    # storage: object storage for every stage's checkpoints and export (STORAGE/STAGE/...), so stages may
    # run on machines that share no filesystem; run_dir stays the node-local scratch and MLflow file.
    storage = None if f.storage is None else f.storage.format(name=f.name)

    def stored(*parts: str) -> str:  # storage/parts, keeping a ?query (s3 endpoint options) at the end
        base, _, query = storage.partition("?")
        joined = "/".join([base.rstrip("/"), *parts])
        return f"{joined}?{query}" if query else joined

    def export_of(stage: str) -> str:
        return stored(stage, "export") if storage else str(run_path / stage / "export")

    tracking = _given(f.tracking)
    uri = tracking.get("uri") or f"sqlite:///{run_path / 'mlflow.db'}"
    top = {s: _given(getattr(f, s)) for s in TOP_LEVEL_STAGE_SECTIONS if getattr(f, s) is not None}
    defaults = _deep_merge(top, _given(f.defaults))
    resolved: list[tuple[str, StageConfig]] = []

    def run_name(stage: str, seed: int) -> str:
        return stage if f.seeds is None else replica_name(stage, seed)

    # Seed-major: every stage of one seed before the next seed's, so a stage's inputs (earlier stages of
    # its seed) are resolved before it, and a stopped experiment leaves whole seeds finished.
    for seed in f.seeds or [f.seed or 0]:
        for stage_name, settings in f.stages.items():
            name = run_name(stage_name, seed)
            merged = _deep_merge({"cluster": _given(f.cluster)}, _deep_merge(defaults, _given(settings)))
            merged.update(
                name=name,
                seed=seed,
                run_dir=str(run_path / name),
                tracking={**tracking, **(merged.get("tracking") or {}), "uri": uri, "experiment": f.name},
            )
            if storage is not None:
                merged["checkpoint"] = {"uri": stored(name), **(merged.get("checkpoint") or {})}
            # An earlier stage named where weights are read means its export (that seed's replica's).
            for keys in (("model", "init_from"), ("objective", "teacher", "weights")):
                node: Any = merged
                for k in keys:
                    node = node.get(k) if isinstance(node, dict) else None
                if isinstance(node, str) and node in dropped:
                    raise ConfigError(
                        f"{path}: stages.{stage_name}.{'.'.join(keys)}: stage {node!r} is dropped "
                        f"(stages.{node}=null): drop stages.{stage_name} too, or name an export folder"
                    )
                if isinstance(node, str) and node in f.stages:
                    if run_name(node, seed) not in [n for n, _ in resolved]:
                        raise ConfigError(
                            f"{path}: stages.{stage_name}.{'.'.join(keys)}: stage {node!r} does not run "
                            "before it"
                        )
                    merged = _replaced(merged, keys, export_of(run_name(node, seed)))
            source = f"{path} stages.{stage_name}" + ("" if f.seeds is None else f" (seed {seed})")
            resolved.append((name, _checked(validate_config(merged, source=source), source)))
    return Experiment(name=f.name, run_path=run_path, tracking_uri=uri, stages=resolved, source=str(path))


# ---------------------------------------------------------------- inputs, before anything starts


def _dataset_problem(source: str, splits: list[str], masks: bool = False, boxes: bool = False) -> str | None:
    """Why the loader could not read `source` (a dataset folder or object store prefix, or local shard
    files), else None; `masks`: the stage needs per-pixel masks (segmentation), `boxes` objects' boxes
    (detection). Shard URLs are not checked here (the loader reports what it cannot open)."""
    if names_shards(source):
        from webdataset.shardlists import expand_urls  # heavy (it imports torch): see _models

        urls = [u.removeprefix("file:") for u in expand_urls(source) if not _is_remote(u)]
        missing = [u for u in urls if not os.path.isfile(u)]
        if missing:
            return f"{len(missing)} of {len(urls)} local shard files not found, the first: {missing[0]}"
        return None
    root = source if _is_remote(source) else Path(source)  # a folder, or an object store prefix
    if not _is_remote(source) and not root.exists():
        return (
            f"{root} does not exist: write a dataset there with `vitpipe shard`, or set data.synthetic "
            "to generate one"
        )
    try:
        manifest = read_manifest(root)
    except DatasetError as exc:
        return str(exc)
    present = sorted({s.split for s in manifest.shards})
    for split in splits:
        if not manifest.split_shards(split):
            shown = source.split("?", 1)[0]  # an object store URI's query (endpoint) is not worth showing
            return f"{shown}: the manifest lists no shards for split {split!r} (it has: {', '.join(present)})"
    if masks and manifest.segmentation_classes is None:
        return (
            f"{source.split('?', 1)[0]}: objective segmentation needs per-pixel masks, and this dataset has none "
            "(its manifest lists no segmentation_classes); write one with masks, e.g. vitpipe shard synthetic --layout"
        )
    if boxes and manifest.detection_classes is None:
        return (
            f"{source.split('?', 1)[0]}: objective detection needs boxes, and this dataset has none (its manifest "
            "lists no detection_classes); write one with boxes: vitpipe shard synthetic --layout, or vitpipe shard "
            "manifest with boxes and box_labels columns"
        )
    return None


def input_problems(target: Experiment | StageConfig) -> list[str]:
    """Every stage's dataset that is missing, one line each: a local dataset folder needs its manifest
    and the splits the stage reads (train; an eval stage's eval_split, and train_split for few-shot or the
    probe), on local disk or object storage; local shard files must exist. Skipped: shard URLs, and a
    folder a stage generates (data.synthetic)."""
    stages = target.stages if isinstance(target, Experiment) else [(target.name, target)]
    generated = {cfg.data.train for _, cfg in stages if cfg.data.synthetic is not None}
    stages_with: dict[str, list[str]] = {}  # problem -> the stages it stops, in order
    for name, cfg in stages:
        if cfg.data.train in generated:
            continue
        e = cfg.eval
        splits = ["train"] if cfg.kind == "train" else [e.eval_split]
        segmentation = cfg.objective.name == "segmentation"  # evaluated per pixel: no few-shot, no probe
        detection = cfg.objective.name == "detection"  # evaluated per box: likewise
        if cfg.kind == "eval" and (e.fewshot_shots or e.linear_probe) and not (segmentation or detection):
            splits.append(e.train_split)
        problem = _dataset_problem(cfg.data.train, splits, masks=segmentation, boxes=detection)
        if problem:
            stages_with.setdefault(problem, []).append(name)
    return [
        f"stage{'s' * (len(names) > 1)} {', '.join(names)}: data.train: {problem}"
        for problem, names in stages_with.items()
    ]


def check_inputs(target: Experiment | StageConfig) -> None:
    """Raise a ConfigError listing every missing dataset. Entry points call it after loading the config
    and before any worker, engine or cluster resource starts."""
    problems = input_problems(target)
    if problems:
        source = target.source if isinstance(target, Experiment) else target.name
        count = len(problems)
        head = f"{source}: {count} input{'s' * (count > 1)} missing (checked before anything starts)"
        raise ConfigError("\n  ".join([head, *problems]))


# ---------------------------------------------------------------- the reference (docs/config.md)


def _type_name(ann: Any) -> str:
    """An annotation as the reader writes it: `int | None`, `Literal['a', 'b']`, `ModelConfig`."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if ann is type(None):
        return "None"
    if ann is Any:
        return "Any"
    if ann in _PARTIAL_OF:
        return "stage keys" if ann is StageSettings else f"{_PARTIAL_OF[ann].__name__} keys"
    return getattr(ann, "__name__", str(ann))


def reference() -> str:
    """Every section and field with its type, default and description (docs/config.md is this text)."""
    out = [
        "# Configuration reference",
        "",
        "Generated by `python -m pipeline.config > docs/config.md` (a test checks it matches); the schema is",
        "`pipeline/config.py`. A stage file (`vitpipe train`) holds the keys of one stage; an experiment file",
        "(`vitpipe run`, `vitpipe submit`) holds `stages`, see the end.",
        "",
    ]

    def table(title: str, model: type[BaseModel], recurse: bool = True) -> None:
        out.extend([f"## `{title}`", "", "| key | type | default | meaning |", "|---|---|---|---|"])
        nested = []
        for name, field in model.model_fields.items():
            sub = _inner(field.annotation)
            default = (
                "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
            )
            if recurse and isinstance(sub, type) and sub not in _PARTIAL_OF:
                nested.append((f"{title}.{name}" if title != "stage" else name, sub))
                default = "see below"
            cells = [f"`{name}`", f"`{_type_name(field.annotation)}`", default, field.description or ""]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
        for t, m in nested:
            table(t, m)

    table("stage", StageConfig)
    doc = inspect.cleandoc(ExperimentFile.__doc__ or "")
    out.extend(["# Multi-stage experiments", "", doc, ""])
    table("experiment file", ExperimentFile, recurse=False)
    return "\n".join(out).rstrip("\n")


# Names that changed to say stage vs experiment: the old one is refused with the new one.
_RENAMED = {"ExperimentConfig": "StageConfig (one stage's config; an experiment of stages is Experiment)"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:  # ImportError, so `from pipeline.config import ExperimentConfig` shows this text
        raise ImportError(f"pipeline.config.{name} is now {_RENAMED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    print(reference())
