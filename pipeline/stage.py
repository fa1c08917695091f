"""Opening a stage, the same for training (pipeline.train.loop) and evaluation (pipeline.eval.run).

    stage = open_stage(cfg)        # every rank: join the process group, seed, rank 0 saves RUN_DIR/config.yaml
    model = create_model(cfg.model.name, **model_kwargs(cfg, num_classes))
    if cfg.model.init_from:
        init_weights(model, cfg.model.init_from, cfg.model.init_head)
    ...                            # the stage's own set-up: engine, resume, input
    with stage.tracking({"objective": cfg.objective.name}, parent_run_id) as tracker:
        ...                        # MLflow on rank 0, a no-op elsewhere; the run is FAILED on an exception

A stage's MLflow run is named by RUN_DIR/mlflow_run.json (pipeline.tracking.RUN_ID_FILE): a stage
that runs again in the same run directory (a resume, a re-run of a failed eval) continues its run,
and the job driver and the eval stage's figures find it there. A stage with a `checkpoint.uri` (object
storage) also tags its run with that URI: resumed on a node whose disk never held the run-id file, it
finds and continues the same run through MLflow (`pipeline.tracking.find_stage_run`).
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from data_prep.layout import MASK_IGNORE, DatasetError
from pipeline import objectives
from pipeline.config import StageConfig, flatten, save_resolved, validate_config
from pipeline.data.sources import DatasetInfo, dataset_info
from pipeline.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from pipeline.distributed import DistContext, init_distributed, use_accelerator
from pipeline.exported import export_preprocessing, load_exported
from pipeline.models.convert import check_published_architecture, load_timm_state_dict
from pipeline.tracking import (
    CHECKPOINT_URI_TAG,
    RUN_ID_FILE,
    Tracker,
    find_stage_run,
    read_run_id,
    write_run_id,
)

log = logging.getLogger(__name__)
STOP_FILE = "STOP"  # a stop request: in the stage's run directory, and beside its stored checkpoints
CONFIG_FILE = "config.yaml"  # the resolved config, in the run directory and as an MLflow artifact


@dataclass
class Stage:
    """One rank's view of an opened stage: its config and its place in the process group."""

    cfg: StageConfig
    ctx: DistContext

    @property
    def run_path(self) -> Path:
        return self.cfg.run_path

    def dataset(self, split: str) -> DatasetInfo:
        """The stage's dataset (`data.train`), split `split`: read by rank 0 alone (the manifest, one GET
        however many ranks) and broadcast over the control group as compact arrays (`DatasetInfo.packed`).
        An error reading it is raised on every rank."""
        cfg, ctx = self.cfg, self.ctx
        labels = dict(num_classes=cfg.data.num_classes, multi_label=cfg.data.multi_label)
        if ctx.world_size == 1:
            return dataset_info(cfg.data.train, split, **labels)
        box: list = [None]
        failure = None
        if ctx.rank == 0:
            try:
                box[0] = dataset_info(cfg.data.train, split, **labels).packed()
            except Exception as exc:  # raised before the broadcast, the other ranks would wait in it
                failure = exc
                box[0] = f"{type(exc).__name__}: {exc}"
        dist.broadcast_object_list(box, src=0, group=ctx.control_group)
        if failure is not None:
            raise failure
        if isinstance(box[0], str):
            raise DatasetError(
                f"rank {ctx.rank}: rank 0 could not read split {split!r} of the dataset: {box[0]}"
            )
        return DatasetInfo.unpacked(box[0])

    @contextmanager
    def tracking(
        self,
        tags: Mapping[str, str],
        parent_run_id: str | None = None,
        params: Mapping[str, object] | None = None,
        resumed: bool = False,
    ) -> Iterator[Tracker]:
        """The stage's MLflow run (rank 0; a no-op Tracker elsewhere), continued if RUN_DIR names one, or
        (`resumed` from a checkpoint, with a checkpoint.uri) if MLflow holds a run tagged with that URI.

        A new run gets the run-id file, the flattened config and `params` as params, and config.yaml
        as an artifact; every run gets the variant, world size and code version as tags, with `tags`.
        """
        cfg, ctx = self.cfg, self.ctx
        run_id_path = self.run_path / RUN_ID_FILE
        run_id = read_run_id(run_id_path)
        variant = cfg.model.name + "".join(f",{k}={v}" for k, v in sorted(cfg.model.overrides.items()))
        tracker, failure = None, None
        try:  # rank 0's alone; raised before the agreement below, the other ranks would wait in a collective
            found = False
            if run_id is None and resumed and ctx.is_main and cfg.checkpoint.uri:
                # This node's disk never held the run-id file (the stage started on another machine).
                run_id = find_stage_run(
                    cfg.tracking_uri, cfg.tracking.experiment or cfg.name, cfg.checkpoint.uri
                )
                found = run_id is not None
            tracker = Tracker(
                cfg.tracking_uri,
                cfg.tracking.experiment or cfg.name,
                run_name=cfg.name,
                enabled=ctx.is_main,
                tags={
                    "variant": variant,
                    "world_size": str(ctx.world_size),
                    "code_version": code_version(),
                    **({CHECKPOINT_URI_TAG: cfg.checkpoint.uri} if cfg.checkpoint.uri else {}),
                    **tags,
                },
                run_id=run_id,
                parent_run_id=parent_run_id,
                system_metrics=cfg.tracking.system_metrics,
            )
            if ctx.is_main and (run_id is None or found):
                write_run_id(run_id_path, tracker.run_id)
            if ctx.is_main and run_id is None:
                tracker.log_params(flatten(cfg))
                if params:
                    tracker.log_params(params)
                tracker.log_artifact(str(self.run_path / CONFIG_FILE))
        except Exception as exc:
            failure = exc
            if tracker is not None:
                tracker.close("FAILED")
        self._every_rank_raises(failure, f"open the stage's MLflow run at {cfg.tracking_uri}")
        with tracker:
            yield tracker

    def _every_rank_raises(self, failure: Exception | None, what: str) -> None:
        """Raise on every rank if rank 0 failed to `what` (`failure`, on rank 0): its exception there, an
        error naming it on the others, which would otherwise go on to wait in their next collective."""
        ctx = self.ctx
        box = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        if ctx.world_size > 1:
            dist.broadcast_object_list(box, src=0, group=ctx.control_group)
        if failure is not None:
            raise failure
        if box[0] is not None:
            raise RuntimeError(f"rank {ctx.rank}: rank 0 could not {what}: {box[0]}")


# The input statistics and eval resampling of each model family's published weights (timm's pretrained_cfg
# of the same models; MAE's and DeiT's repositories): a stage that starts from nothing takes its family's,
# so that its export pairs with the public weights of that family. Longest prefix first.
INCEPTION = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))  # big_vision's value_range(-1, 1); timm's AugReg ViTs
IMAGENET = (IMAGENET_MEAN, IMAGENET_STD)
FAMILY_PREPROCESSING: dict[str, tuple[tuple, tuple]] = {
    "mae_": IMAGENET,  # MAE's repository (and its timm ports)
    "simmim_": IMAGENET,  # SimMIM's repository (Swin)
    "swin_": IMAGENET,
    "cvt_": IMAGENET,
    "levit_": IMAGENET,
    "tnt_": INCEPTION,
    "mpp_vit_": INCEPTION,  # the ViT paper's self-supervision: its ViT's inputs
    "setr_": INCEPTION,  # an encoder initialised from a ViT export
    "detr_": INCEPTION,
    "vit_": INCEPTION,  # ViT paper / big_vision / AugReg; hybrids (vit_r50_*) too
}
EVAL_INTERPOLATION = "bicubic"  # every family above, as timm, DeiT and MAE evaluate


def family_preprocessing(model_name: str) -> dict:
    """{"mean", "std", "interpolation"} a model family's published weights expect (ImageNet's for a name
    no family claims)."""
    mean, std = next((v for k, v in FAMILY_PREPROCESSING.items() if model_name.startswith(k)), IMAGENET)
    return {"mean": list(mean), "std": list(std), "interpolation": EVAL_INTERPOLATION}


def resolve_preprocessing(cfg: StageConfig) -> StageConfig:
    """`cfg` with data.mean/std and eval.interpolation decided where null: as model.init_from's export
    recorded them (a timm folder's config.json too; a stage that fine-tunes an MAE export keeps its
    statistics), else as the model family's published weights expect (`family_preprocessing`)."""
    if cfg.data.mean is not None and cfg.eval.interpolation is not None:
        return cfg
    found = export_preprocessing(cfg.model.init_from) if cfg.model.init_from else None
    family = family_preprocessing(cfg.model.name)
    source = found or family
    data = cfg.model_dump(mode="json")
    if cfg.data.mean is None:
        data["data"]["mean"], data["data"]["std"] = source["mean"], source["std"]
    if cfg.eval.interpolation is None:
        data["eval"]["interpolation"] = source.get("interpolation") or family["interpolation"]
    return validate_config(
        data, source=f"{cfg.name} (preprocessing from {'model.init_from' if found else 'the model family'})"
    )


def preprocessing_of(cfg: StageConfig) -> dict:
    """What an export records of its stage's inputs (a resolved config's)."""
    return {"mean": list(cfg.data.mean), "std": list(cfg.data.std), "interpolation": cfg.eval.interpolation}


def open_stage(cfg: StageConfig) -> Stage:
    """Every rank: join the process group the launcher described, seed, and (rank 0) save the config.
    The Stage's config has `cluster.use_gpu: auto` decided (from this process's CUDA) and the input
    preprocessing (`resolve_preprocessing`): read it, not `cfg`."""
    cfg = resolve_preprocessing(cfg.on_device(torch.cuda.is_available()))
    use_accelerator(cfg.cluster.use_gpu)  # DeepSpeed's device is the stage's, or a clear error now
    ctx = init_distributed(cfg.cluster.use_gpu)
    seed_everything(cfg.seed)
    if ctx.is_main:
        save_resolved(cfg, cfg.run_path / CONFIG_FILE)
    return Stage(cfg, ctx)


def seed_everything(seed: int) -> None:
    # Same seed on every rank: identical initial weights; data order and masks take their own seeds.
    torch.manual_seed(seed)
    np.random.seed(seed)


def code_version() -> str:
    """The checkout's short commit, or "unknown" outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def model_kwargs(cfg: StageConfig, num_classes: int) -> dict:
    """The stage's `create_model` arguments: its image size, the objective's head, the config's overrides."""
    return {
        "img_size": cfg.model.img_size,
        **objectives.model_kwargs(cfg.objective, num_classes),
        **({"patch_dropout": cfg.model.patch_dropout} if cfg.model.patch_dropout else {}),
        **cfg.model.overrides,
    }


def output_classes(cfg: StageConfig, info: DatasetInfo) -> int:
    """The model's output classes: model.num_classes, else the dataset's classes, or for segmentation its
    mask classes (the manifest's segmentation_classes, which a segmentation stage needs), for detection its
    object classes (detection_classes)."""
    if cfg.objective.name == "detection":
        found = info.box_classes()
        if cfg.model.num_classes not in (None, found):
            raise DatasetError(
                f"{cfg.data.train}: model.num_classes is {cfg.model.num_classes}, but the dataset's boxes have "
                f"{found} classes ({', '.join(info.detection_classes)})"
            )
        return found
    if cfg.objective.name != "segmentation":
        return cfg.model.num_classes or info.num_classes
    found = info.mask_classes()
    if found > MASK_IGNORE:
        raise DatasetError(
            f"{cfg.data.train}: {found} segmentation_classes; masks hold 8-bit values and {MASK_IGNORE} marks "
            f"ignored pixels, so at most {MASK_IGNORE} classes"
        )
    if cfg.model.num_classes not in (None, found):
        raise DatasetError(
            f"{cfg.data.train}: model.num_classes is {cfg.model.num_classes}, but the dataset's masks have "
            f"{found} classes ({', '.join(info.segmentation_classes)})"
        )
    return found


def init_weights(
    model: nn.Module, source: str | Path, init_head: bool, model_name: str | None = None
) -> dict:
    """Load exported weights (a stage's export, or public ones in the timm layout: timm, DeiT and MAE
    .safetensors/.pth/.bin files or folders; a folder, a file or a storage URI) into `model`, the head too if
    `init_head`; returns the export's description. A public checkpoint whose published name is another
    model than `model_name` is refused first (convert.TIMM_NAMES). A model with its own
    `load_pretrained(state, init_head)` (SETR: a ViT export goes into its encoder) loads itself."""
    if model_name is not None:
        check_published_architecture(str(source), model_name)
    state, meta = load_exported(source)
    if hasattr(model, "load_pretrained"):
        model.load_pretrained(state, init_head)
    else:
        load_timm_state_dict(model, state, strict_head=init_head, reset_head=not init_head)
    log.info("initialised from %s (%s, step %s)", source, meta.get("model", "?"), meta.get("step", "?"))
    return meta
