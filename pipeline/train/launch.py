"""Run a stage without Ray: in this process, or in each process torchrun starts.

vitpipe train configs/experiments/smoke.yaml cluster.launcher=local
torchrun --nproc-per-node 2 -m pipeline.train.launch configs/experiments/smoke.yaml
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from data_prep.layout import has_dataset, read_manifest
from data_prep.synthetic import (
    class_names,
    layout_class_names,
    layout_type_names,
    segmentation_class_names,
    synthetic_samples,
)
from data_prep.writer import write_dataset
from pipeline.config import ConfigError, StageConfig, check_inputs, load_config
from pipeline.distributed import shutdown_distributed, use_accelerator
from pipeline.eval.run import evaluate  # light: matplotlib loads only when a figure is drawn

if TYPE_CHECKING:
    from pipeline.train.loop import StageResult


def prepare_data(cfg: StageConfig) -> None:
    """Generate the configured synthetic corpus once, before any rank starts (no-op if present); the
    layout corpus (`layout: true`) with its masks and boxes and the manifest's segmentation_classes and
    detection_classes."""
    syn = cfg.data.synthetic
    if syn is None:
        return
    if has_dataset(cfg.data.train):
        # A dataset generated earlier with other settings would be trained on silently: refuse it.
        made = read_manifest(cfg.data.train).options
        wanted = syn.model_dump()
        differ = sorted(k for k in wanted if k in made and made[k] != wanted[k])
        if differ:
            shown = ", ".join(f"{k} {made[k]!r} there, {wanted[k]!r} configured" for k in differ)
            raise ConfigError(
                f"data.train: {cfg.data.train} holds a synthetic corpus generated with other data.synthetic "
                f"settings ({shown}); delete it to generate the configured one, or point data.train elsewhere"
            )
        return
    samples = synthetic_samples(
        syn.num,
        syn.classes,
        seed=cfg.seed,
        labels_per_image=syn.labels_per_image,
        width=syn.width,
        height=syn.height,
        val_fraction=syn.val_fraction,
        layout=syn.layout,
        objects=syn.objects,
    )
    write_dataset(
        cfg.data.train,
        samples,
        layout_class_names(syn.objects) if syn.layout else class_names(syn.classes),
        multi_label=True,
        max_count=syn.max_count,
        options=syn.model_dump(),
        segmentation_classes=segmentation_class_names(syn.objects) if syn.layout else None,
        detection_classes=layout_type_names(syn.objects) if syn.layout else None,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(
    cfg: StageConfig, report: Callable[..., None] | None = None, parent_run_id: str | None = None
) -> StageResult | dict[str, float]:
    """This rank's part of the stage, in a process group the launcher set up (torchrun, Ray Train, or
    launch_local): the training loop's result, or an eval stage's metrics (`kind: eval`).

    DeepSpeed's accelerator is chosen here, from the stage's device, before the training loop (and with it
    DeepSpeed) is imported: this module and cluster.run import neither (pipeline.distributed.use_accelerator)."""
    use_accelerator(cfg.on_device(torch.cuda.is_available()).cluster.use_gpu)  # auto: as open_stage decides
    if cfg.kind == "eval":
        return evaluate(cfg, report=report, parent_run_id=parent_run_id)
    from pipeline.train.loop import train

    return train(cfg, report=report, parent_run_id=parent_run_id)


def _loopback_interface() -> str | None:
    """The loopback device's name ("lo" on Linux, "lo0" on macOS), or None where none is named so."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((n for n in names if n in ("lo", "lo0")), None)


def _single_process_group() -> None:
    """A process group of one that listens on loopback only: its store is in memory (env:// would start
    a TCP store listening on every interface, whatever MASTER_ADDR says), and gloo's sockets are on the
    loopback device (its default is the address the host name resolves to). GLOO_SOCKET_IFNAME stays set
    for the process's lifetime: groups created later (DeepSpeed makes some) read it when they start."""
    loopback = _loopback_interface()
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def launch_local(cfg: StageConfig) -> StageResult | dict[str, float]:
    """One process, or one rank of a torchrun job (torchrun sets RANK/WORLD_SIZE/MASTER_*)."""
    cfg = cfg.on_device(torch.cuda.is_available())  # cluster.use_gpu: auto
    use_accelerator(cfg.cluster.use_gpu)  # refused now, before a process group or data generation
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        if not cfg.cluster.use_gpu and not dist.is_initialized():
            _single_process_group()
    if os.environ.get("RANK", "0") == "0":
        prepare_data(cfg)
    return run_rank(cfg)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit("usage: python -m pipeline.train.launch CONFIG [KEY=VALUE ...]")
    try:
        cfg = load_config(argv[0], argv[1:])
        check_inputs(cfg)  # the dataset, before the process group and the engine start
    except ConfigError as exc:
        sys.exit(f"pipeline.train.launch: {exc}")
    if (
        int(os.environ.get("WORLD_SIZE", "1")) > 1
        and cfg.data.synthetic is not None
        and not has_dataset(cfg.data.train)
    ):
        sys.exit(
            f"{cfg.data.train}: generate the dataset first (vitpipe shard synthetic) when running under torchrun"
        )
    try:
        launch_local(cfg)
    except ConfigError as exc:  # found where the rank starts (DeepSpeed's accelerator), before any collective
        sys.exit(f"pipeline.train.launch: {exc}")
    shutdown_distributed()


if __name__ == "__main__":
    main()
