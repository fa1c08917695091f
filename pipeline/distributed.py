"""The process group a stage's ranks share: joining it from what the launcher (Ray Train, torchrun or
launch_local) set in the environment, leaving it, and DeepSpeed imported the way every rank needs it.
Below `train/` and `eval/`, which both start from it (`pipeline.stage`)."""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.config import ConfigError


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    # A gloo group for control flags (stop requests, checkpoint agreement): a CPU all-reduce that
    # never synchronises the GPU stream, whatever backend the training collectives use.
    control_group: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


ACCELERATOR_ENV = "DS_ACCELERATOR"


class AcceleratorMismatch(ConfigError):
    """DeepSpeed's accelerator names another device than the stage runs on."""


def use_accelerator(use_gpu: bool) -> None:
    """DeepSpeed's accelerator for this process: the stage's device (its resolved `cluster.use_gpu`).

    DeepSpeed reads DS_ACCELERATOR once, when it is imported, and moves the model to that accelerator's
    device whatever the process group's: a `cluster.use_gpu: false` stage on a CUDA host, or a GPU stage
    under a DS_ACCELERATOR=cpu left in the environment, put the model on one device and the batches on
    the other, and failed at the first step. So each rank sets it from its stage before DeepSpeed is
    imported (pipeline.train.launch.run_rank; the launchers import the training loop only then). A
    DS_ACCELERATOR set for the process, or a DeepSpeed already imported, that names the other device is
    refused here, naming both."""
    wanted = "cuda" if use_gpu else "cpu"
    if "deepspeed" in sys.modules:
        from deepspeed.accelerator import get_accelerator

        have = get_accelerator().device_name().split(":")[0]
        where = f"DeepSpeed was imported with its {have} accelerator"
    else:
        have = os.environ.get(ACCELERATOR_ENV)
        where = f"{ACCELERATOR_ENV}={have} is set"
        if have is None:
            os.environ[ACCELERATOR_ENV] = wanted
            return
    if have != wanted:
        device = "a GPU" if use_gpu else "the CPU"
        raise AcceleratorMismatch(
            f"{where}, but this stage runs on {device} (cluster.use_gpu: {str(use_gpu).lower()}): DeepSpeed "
            f"would put the model on {have}. Unset {ACCELERATOR_ENV} (each rank sets it from its stage), or "
            f"set cluster.use_gpu={str(have == 'cuda').lower()}"
        )


def deepspeed_module():
    # Set by use_accelerator where a stage runs; this default serves code that builds an engine by itself.
    os.environ.setdefault(ACCELERATOR_ENV, "cuda" if torch.cuda.is_available() else "cpu")
    if "deepspeed" not in sys.modules and "mlflow" not in sys.modules:
        # `import deepspeed` imports its autotuner, which imports mlflow where it is installed (0.9 s of CPU
        # here) for autotuning runs that training never starts. Ranks other than 0 never use mlflow
        # (pipeline.tracking); rank 0 imports it for tracking after this. A None entry makes that one
        # import fail (the autotuner catches it); it is removed at once, so a later `import mlflow` works.
        sys.modules["mlflow"] = None
        try:
            import deepspeed
        finally:
            if sys.modules.get("mlflow", ...) is None:
                del sys.modules["mlflow"]
    import deepspeed
    import deepspeed.ops

    if os.environ[ACCELERATOR_ENV] == "cpu" and "__compatible_ops__" not in vars(deepspeed.ops):
        # DeepSpeed's CPU communication backend JIT-compiles its shared-memory all-reduce op
        # (deepspeed_shm_comm, C++) at every process-group start, after probing every op's compatibility
        # with compiler subprocesses. Only `inference_all_reduce` (DeepSpeed inference) uses the op; training
        # reduces over gloo. The compile took minutes on a fresh machine with every other DeepSpeed process
        # waiting on its lock (and forever, if the compiling process was killed). deepspeed.ops caches the
        # probe in this dict, which comm/torch.py alone reads: answer "not compatible" without probing.
        deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    return deepspeed


def init_distributed(use_gpu: bool) -> DistContext:
    """Join the process group that the launcher (Ray Train, torchrun or launch_local) described in env vars."""
    backend = "nccl" if use_gpu else "gloo"
    if not dist.is_initialized():
        deepspeed_module().init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_gpu:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"rank {rank}: cluster.use_gpu is true but CUDA is not available on this worker"
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return DistContext(rank, world, local_rank, device, control)


def shutdown_distributed() -> None:
    """Leave the process group at the end of a process that joined it (torchrun, launch_local).

    Without it gloo's worker threads can outlive the interpreter and abort the exit on some rank
    (SIGABRT, "terminate called without an active exception": pytorch issue 190489), which torchrun
    reports as a failed job after a finished stage. Call it on success only: after an exception other
    ranks may still wait in a collective, and the destroy would hang (torchtitan PR 1342). Ray Train
    destroys its workers' groups itself.
    """
    if dist.is_initialized():
        # Reference cycles (a caught exception's traceback and its frames) can hold the group past the
        # destroy; collected first, the destroy drops its last reference and the group joins its threads
        # here, not while the interpreter finalizes.
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
