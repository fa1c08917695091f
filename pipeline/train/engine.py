"""The one place DeepSpeed appears: our config -> a DeepSpeed config -> an engine.

On CPU DeepSpeed needs `DS_ACCELERATOR=cpu` before it is imported, the gloo backend, and torch's
AdamW (`torch_adam`), since FusedAdam needs CUDA; on GPU torch's fused AdamW kernel is used.

GPU defaults (`deepspeed_config`, `build_engine`):
- precision bf16 (the config resolves `deepspeed.precision: null` to bf16 with `cluster.use_gpu`), and TF32
  for the matmuls and convolutions that stay fp32 (`deepspeed.tf32`);
- gradients reduced across ranks in fp32 under bf16 (`communication_data_type`): a bf16
  all-reduce or reduce-scatter sums N ranks' gradients with 8 mantissa bits, the error torchtitan and
  FSDP's `reduce_dtype=float32` avoid; it doubles the reduction's bytes, which `overlap_comm` hides
  behind the backward pass (on for ZeRO 1-3). The reduced gradients are kept, and summed over the
  micro-steps of `deepspeed.grad_accum`, in the weights' dtype (bf16). DeepSpeed's fp32 accumulation
  (`data_types.grad_accum_dtype`) is not set: under ZeRO-2/3 it costs 2 more bytes per parameter spread
  over the ranks (estimated, not measured: bench/zero_memory.py's ZeRO-3 ratio from 0.53 to about 0.59, over
  its 0.55 goal), ZeRO-1 would change optimizer (and checkpoint layout) and ZeRO-0 refuses it. It matters
  where grad_accum is large: prefer more ranks or a larger micro-batch to a long accumulation in bf16;
- `model.compile` compiles each transformer block (`compile_blocks`), for every ZeRO stage; it pays where
  a block's parameters are whole (ZeRO 0-2): ZeRO-3's gathering hooks on every submodule are
  `torch.compiler.disable`d, so they break a compiled block into pieces.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from pipeline.config import StageConfig
from pipeline.distributed import DistContext, deepspeed_module
from pipeline.models.layers import set_grad_checkpointing, transformer_blocks
from pipeline.models.param_groups import param_groups


def peak_lr(cfg: StageConfig, world_size: int) -> float:
    """The peak learning rate: optim.lr as given, or optim.base_lr * global_batch / 256 (Goyal et al.;
    MAE's blr, DeiT)."""
    if cfg.optim.base_lr is None:
        return cfg.optim.lr
    global_batch = cfg.data.batch_size * cfg.deepspeed.grad_accum * world_size
    return cfg.optim.base_lr * global_batch / 256


def bucket_elements(num_params: int) -> int:
    """ZeRO communication bucket size in elements: num_params / 8, within [1e7, 5e8], and never more
    than the model (one bucket then holds every gradient).

    DeepSpeed's default (5e8 elements) allocates a 2 GB fp32 gradient bucket per rank under ZeRO-3
    whatever the model size: 2.3x the whole model state of ViT-B on 2 ranks (bench/zero_memory.py).
    The floor, 1e7 elements, is 40 MB in fp32 (the gradients are reduced in fp32 under bf16): above
    PyTorch DDP's 25 MB default bucket, about one ViT-B block. It was 2e7, 80 MB in fp32: a fixed 40 MB
    more per rank that moved ViT-B's ZeRO-3/ZeRO-0 model state on 2 ranks from 0.529 to 0.558 when the
    reduction went to fp32. Models over 8e7 parameters (ViT-L and up) are sized by num_params / 8.
    Rounded up to a multiple of 64: ZeRO-1/2 need a multiple of their alignment (2 elements in bf16).
    """
    elements = int(min(5e8, max(min(num_params, 1e7), num_params // 8)))
    return -(-elements // 64) * 64


def deepspeed_config(cfg: StageConfig, world_size: int, use_gpu: bool, num_params: int) -> dict:
    ds = cfg.deepspeed
    bucket = bucket_elements(num_params)
    zero: dict = {"stage": ds.zero_stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if ds.zero_stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=bucket,
            stage3_max_live_parameters=bucket,
            stage3_max_reuse_distance=bucket,
        )
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": use_gpu}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": use_gpu}
    if ds.zero_stage > 0:
        # Reduce gradients bucket by bucket while the backward pass still runs, from contiguous buffers.
        # On CUDA, ZeRO-1/2 then synchronize the device once per backward (DeepSpeed's epilogue, before it
        # frees the reduced buckets): the price of the overlap, worth it when the reduction crosses nodes.
        zero.update(overlap_comm=ds.overlap_comm, contiguous_gradients=True)
    half = ds.precision == "bf16"  # fp16 is refused by the config
    return {
        "train_micro_batch_size_per_gpu": cfg.data.batch_size,
        # Gradients summed over ranks in fp32 (see the module docstring); the default is the model's dtype.
        **({"communication_data_type": "fp32"} if half else {}),
        "gradient_accumulation_steps": ds.grad_accum,
        "train_batch_size": cfg.data.batch_size * ds.grad_accum * world_size,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        # Offloading keeps torch's AdamW (DeepSpeedCPUAdam would need a C++ op build on every machine).
        **({"zero_force_ds_cpu_optimizer": False} if ds.offload_optimizer or ds.offload_params else {}),
        # bf16 has fp32's exponent range: no loss scale, so no overflow to check. ZeRO-1/2 honour this
        # (one host read fewer per step); ZeRO-0's bf16 wrapper and ZeRO-3 check all the same.
        "bf16": {"enabled": ds.precision == "bf16", "check_grad_overflow": False},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": peak_lr(cfg, world_size),
                "betas": list(cfg.optim.betas),
                "weight_decay": cfg.optim.weight_decay,
                # torch's AdamW everywhere: DeepSpeed's FusedAdam needs a CUDA op build; torch's own
                # fused kernel (fused=True) is as fast on GPU and needs nothing built.
                "torch_adam": True,
                "adam_w_mode": True,
                **({"fused": True} if use_gpu else {}),
            },
        },
        "steps_per_print": 2**31 - 1,  # our loop prints progress; keep DeepSpeed quiet
        # DeepSpeed's throughput timer synchronizes the device at the start and end of every step (its
        # default); the loop measures throughput itself, between log steps.
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
        "wall_clock_breakdown": False,
    }


def compile_blocks(module: nn.Module, backend: str = "inductor") -> int:
    """torch.compile each transformer block in place (`nn.Module.compile`); returns how many.

    Per block, as torchtitan does, not the whole model: identical blocks share one compiled graph (torch
    2.5+ treats a module's parameters and buffers as graph inputs, and DropPath keeps its rate in a buffer), so
    ViT-H's 32 blocks compile once (twice: the first has no drop path); the code between
    blocks (embedding, masking, heads) stays eager, where shapes and Python control flow change per step
    (MAE's masking, patch dropout) and would recompile. Activation checkpointing wraps the compiled block.
    State dict keys do not change.
    """
    blocks = transformer_blocks(module)
    for block in blocks:
        block.compile(backend=backend)
    return len(blocks)


def lr_multiplier(step: int, warmup: int, total: int, schedule: str) -> float:
    """Linear warmup from 0, then cosine / linear decay to 0, or constant."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress


MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_muon_uncompiled() -> None:
    """DeepSpeed's ZeRO and bf16 optimizers import its Muon optimizer (for type checks) when they are built or
    first reduce; the import decorates Muon's kernels with `torch.compile`, which loads inductor: 1.1 s of CPU
    per rank here. The pipeline never runs Muon: it is imported with dynamo off, so those decorators are
    no-ops (Muon would run eagerly). Nothing else compiles meanwhile (`model.compile` compiles after the
    engine is built). Eval stages build no optimizer and never import it."""
    if MUON in sys.modules:
        return
    before = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        importlib.import_module(MUON)
    except ImportError:  # a DeepSpeed without Muon
        pass
    finally:
        if before is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before


def build_engine(model: nn.Module, cfg: StageConfig, ctx: DistContext):
    deepspeed = deepspeed_module()
    import_muon_uncompiled()
    use_gpu = ctx.device.type == "cuda"
    o = cfg.optim

    if use_gpu:  # fp32 matmuls (and convolutions) on TF32 tensor cores, or exact fp32
        torch.set_float32_matmul_precision("high" if cfg.deepspeed.tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = cfg.deepspeed.tf32
    if cfg.model.grad_checkpointing and not set_grad_checkpointing(model, cfg.model.grad_checkpointing):
        raise ValueError(
            f"model.grad_checkpointing: {cfg.model.name} ({type(model).__name__}) has no block "
            "that can recompute its activations"
        )
    groups = param_groups(model, o.weight_decay, o.layer_decay)
    base_lr = peak_lr(cfg, ctx.world_size)
    for g in groups:
        g["lr"] = base_lr * g.pop("lr_scale")  # layer-wise decay: the scheduler scales each group's own lr

    def scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_multiplier(s, o.warmup_steps, o.steps, o.schedule)
        )

    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model.to(ctx.device),
        model_parameters=groups,
        config=deepspeed_config(cfg, ctx.world_size, use_gpu, sum(p.numel() for p in model.parameters())),
        lr_scheduler=scheduler,
        dist_init_required=False,
    )
    if cfg.model.compile:
        compiled = compile_blocks(engine.module)
        if not compiled:
            raise ValueError(f"model.compile: {cfg.model.name} has no transformer blocks to compile")
    return engine, optimizer, lr_scheduler


def consolidated_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Full fp32 weights on rank 0 (None elsewhere), from any ZeRO stage; every rank must call it.

    Stages 1-3 hold the fp32 master weights partitioned across ranks: each parameter is assembled in
    memory by a collective over the ranks (DeepSpeed's `safe_get_full_fp32_param`), not read back from
    checkpoint files, which on a cluster lie on each rank's own node and not all on rank 0's. Stage 0
    keeps full weights in the module, and under bf16 fp32 master copies in DeepSpeed's wrapper, which are taken.
    """
    rank0 = dist.get_rank() == 0
    module = engine.module
    if engine.zero_optimization_stage() == 0:
        if not rank0:
            return None
        masters = _stage0_fp32_masters(engine)
        state = {k: masters.get(id(p), p) for k, p in module.named_parameters()}
        state.update((k, v) for k, v in module.state_dict().items() if k not in state)
        return {k: v.detach().float().cpu().clone() for k, v in state.items()}
    from deepspeed.utils import safe_get_full_fp32_param

    state: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():  # the same order on every rank: one collective each
        full = safe_get_full_fp32_param(param)
        if full is None:
            raise RuntimeError(f"rank {dist.get_rank()}: ZeRO holds no fp32 master copy of {name}")
        if rank0:
            state[name] = full.detach().float().cpu().clone()
    if not rank0:
        return None
    # Buffers (BatchNorm statistics) are not partitioned: every rank holds them whole.
    for k, v in module.state_dict().items():
        if k not in state and v.numel() > 0:
            state[k] = v.detach().float().cpu().clone()
    return {k: v.contiguous() for k, v in state.items()}


def _stage0_fp32_masters(engine) -> dict[int, torch.Tensor]:
    """ZeRO-0 under bf16: id(module parameter) -> the fp32 master copy DeepSpeed's wrapper
    (FP16_UnfusedOptimizer, `fp16_groups` beside `fp32_groups`) updates. The module's bf16 weights keep 8
    mantissa bits: a LayerNorm weight of 1.0 stays 1.0 under updates below 1/512, so an export read from
    them loses what the steps learnt. Empty in fp32, where the module's weights are the masters."""
    opt = engine.optimizer
    pairs = zip(getattr(opt, "fp16_groups", None) or [], getattr(opt, "fp32_groups", None) or [])
    return {id(half): master for halves, masters in pairs for half, master in zip(halves, masters)}
