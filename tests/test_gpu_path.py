"""The GPU training path, checked on the CPU as far as it goes: activation checkpointing in every family,
patch dropout and its FLOPs, the precision and decode settings, the MFU peak table, and the CUDA-decode
data path run with a PIL decoder standing in for nvJPEG (the real decoder needs a GPU: bench/gpu.py).

    .venv/bin/python -m pytest tests/test_gpu_path.py -q
"""

import dataclasses
import importlib.util
import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import history, torchrun  # shared with the other torchrun tests
from PIL import Image

from data_prep.shard_file import Sample
from data_prep.synthetic import class_names, synthetic_samples
from data_prep.writer import write_dataset
from pipeline.config import ConfigError, DataConfig, load_config, validate_config
from pipeline.data.device import DeviceDecode, Prefetcher, pil_decoder, prefetch
from pipeline.data.loader import make_train_loader
from pipeline.data.sources import dataset_info
from pipeline.data.transforms import crop_resize_flip, crop_resize_flip_batch
from pipeline.hardware import peak_flops
from pipeline.models import create_model
from pipeline.models.flops import flops_per_image
from pipeline.models.layers import (
    checkpointed_fraction,
    checkpoints_block,
    set_grad_checkpointing,
    transformer_blocks,
)
from pipeline.train.engine import compile_blocks
from pipeline.train.loop import _flops_per_image, _shutdown_loader

pytestmark = pytest.mark.unit
ROOT = Path(__file__).parents[1]

# ---------------------------------------------------------------------- activation checkpointing

FAMILIES = {  # model -> how its training forward is called
    "vit_debug": "classify",
    "cvt_debug": "classify",
    "swin_debug": "classify",
    "tnt_debug": "classify",
    "levit_debug": "classify",
    "mae_vit_debug": "masked",
    "mpp_vit_debug": "mpp",
    "simmim_swin_debug": "masked",
    "simmim_cvt_debug": "masked",
    "simmim_tnt_debug": "masked",
}


def _loss(model, kind: str, images: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "classify":
        return model(images).float().pow(2).mean()
    if kind == "mpp":
        targets = torch.randint(0, 512, (images.shape[0], model.encoder.patch_embed.num_patches), generator=g)
        return model(images, targets, generator=g)[0]
    return model(images, generator=g)[0]


def _linear_calls_in_backward(model, kind: str, images: torch.Tensor) -> tuple[int, dict]:
    """(Linear forwards that ran during backward, the gradients)."""
    calls = {"n": 0}
    hooks = [
        m.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    torch.manual_seed(1)
    loss = _loss(model, kind, images)
    before = calls["n"]
    loss.backward()
    for h in hooks:
        h.remove()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return calls["n"] - before, grads


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_activation_checkpointing_reaches_every_family(name):
    """The flag reaches the blocks inside wrappers (MAE, masked patch prediction, SimMIM) and CvT's stages:
    backward recomputes the forward, and the gradients do not change."""
    torch.manual_seed(0)
    model = create_model(name).train()
    images = torch.randn(2, 3, 32, 32)
    recomputed, plain = _linear_calls_in_backward(model, FAMILIES[name], images)
    assert recomputed == 0
    assert set_grad_checkpointing(model) > 0
    recomputed, checkpointed = _linear_calls_in_backward(model, FAMILIES[name], images)
    assert recomputed > 0, f"{name}: activation checkpointing recomputed nothing in backward"
    assert plain.keys() == checkpointed.keys()
    for k in plain:
        torch.testing.assert_close(checkpointed[k], plain[k], rtol=1e-4, atol=1e-6, msg=f"{name}: {k}")


@pytest.mark.parametrize(
    "fraction, blocks", [(0.0, []), (0.25, [3]), (0.5, [1, 3]), (0.75, [1, 2, 3]), (1.0, [0, 1, 2, 3])]
)
def test_a_fraction_of_the_blocks_recomputes_in_backward(fraction, blocks):
    """model.grad_checkpointing: F checkpoints floor(F x depth) blocks spread evenly, and only those run their
    forward again in backward; the gradients do not change."""
    torch.manual_seed(0)
    model = create_model("vit_debug").train()
    assert len(model.blocks) == 4
    images = torch.randn(2, 3, 32, 32)
    _, plain = _linear_calls_in_backward(model, "classify", images)
    set_grad_checkpointing(model, fraction)
    rerun = []
    for i, blk in enumerate(model.blocks):
        blk.mlp.fc1.register_forward_hook(lambda *_, i=i: rerun.append(i))
    loss = _loss(model, "classify", images)
    rerun.clear()  # the forward's calls; what follows is the backward's recompute
    loss.backward()
    assert sorted(rerun) == blocks  # backward reaches the last block first
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[k], rtol=1e-4, atol=1e-6, msg=k)


def test_checkpointed_blocks_are_spread_and_counted():
    for count in (1, 4, 12, 24, 32):
        for fraction in (0.0, 0.1, 0.25, 1 / 3, 0.5, 0.75, 1.0):
            chosen = [i for i in range(count) if checkpoints_block(fraction, i, count)]
            assert len(chosen) == int(fraction * count + 1e-9), (count, fraction, chosen)
            if len(chosen) > 1:  # evenly spread: gaps differ by at most one block
                gaps = [b - a for a, b in zip(chosen, chosen[1:])]
                assert max(gaps) - min(gaps) <= 1, (count, fraction, chosen)
    with pytest.raises(ValueError, match=r"in \[0, 1\], got 1.5"):
        set_grad_checkpointing(create_model("vit_debug"), 1.5)


@pytest.mark.parametrize(
    "name, shares",
    [
        ("vit_debug", [0.0, 0.25, 0.5, 1.0]),
        ("mae_vit_debug", [0.0, 1 / 6, 0.5, 1.0]),  # 4 encoder blocks, 2 decoder blocks: 1 + 0, 2 + 1 of 6
        ("swin_debug", [0.0, 0.0, 3 / 7, 1.0]),  # stages of 2, 2, 2 and 1 blocks: a quarter of 2 is none
        ("levit_debug", [0.0, 0.2, 0.4, 1.0]),  # its stages' 5 layers together, downsampling included
    ],
)
def test_hfu_counts_the_blocks_actually_recomputed(name, shares):
    """perf/hfu's recompute is the share of blocks each part selects, not the configured fraction."""
    model = create_model(name)
    for fraction, share in zip((0.0, 0.25, 0.5, 1.0), shares):
        set_grad_checkpointing(model, fraction)
        assert checkpointed_fraction(model) == pytest.approx(share), (name, fraction)


def test_grad_checkpointing_config_takes_a_fraction_or_a_flag_and_names_the_old_key(tmp_path):
    assert _load(tmp_path, model={"grad_checkpointing": True}).model.grad_checkpointing == 1.0
    assert _load(tmp_path, model={"grad_checkpointing": 0.5}).model.grad_checkpointing == 0.5
    with pytest.raises(ConfigError, match=r"model\.grad_checkpointing: .*less than or equal to 1"):
        _load(tmp_path, model={"grad_checkpointing": 2})
    with pytest.raises(
        ConfigError, match=r"deepspeed\.activation_checkpointing: moved to model\.grad_checkpointing"
    ):
        _load(tmp_path, deepspeed={"activation_checkpointing": True})


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_compile_applies_to_each_transformer_block_not_the_whole_model(name):
    """model.compile: every block of every part (MAE's decoder too) compiled in place, the code between
    blocks left eager; state dict keys unchanged. (Compiled training runs in the torchrun test below.)"""
    model = create_model(name)
    keys = list(model.state_dict())
    blocks = transformer_blocks(model)
    assert blocks and compile_blocks(model) == len(blocks)
    assert all(b._compiled_call_impl is not None for b in blocks)
    assert model._compiled_call_impl is None
    assert list(model.state_dict()) == keys


COMPILED_SHAPES = {  # name -> (overrides, image side): the debug families, and two of the real depths
    **{name: ({}, 32) for name in FAMILIES},
    "vit_debug@depth32": ({"depth": 32}, 32),  # ViT-H's depth, its own ramp of drop path rates
    "swin_b@narrow": ({"embed_dim": 32, "num_heads": (1, 2, 4, 8)}, 224),  # Swin-B's stages and windows
}


@pytest.mark.parametrize("name", sorted(COMPILED_SHAPES))
def test_compiled_blocks_with_stochastic_depth_stay_compiled(name):
    """model.compile with drop_path_rate > 0 (each block its own rate): a training step compiles every block
    without reaching dynamo's recompile limit, past which the remaining blocks would silently run eager; the
    blocks of a ViT (32 of them here) share one graph beside the first, which has no drop path. Traced with
    the eager backend: the guards and graphs are dynamo's whatever the backend, without a C++ compile."""
    overrides, side = COMPILED_SHAPES[name]
    model = create_model(name.split("@")[0], drop_path_rate=0.2, **overrides).train()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert compile_blocks(model, backend="eager") == len(transformer_blocks(model))
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        _loss(model, FAMILIES.get(name, "classify"), torch.randn(2, 3, side, side)).backward()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if name.startswith("vit_debug"):
        assert graphs == 2, f"{name}: {graphs} graphs for {len(model.blocks)} blocks of one shape"
    torch._dynamo.reset()


def test_a_model_without_checkpointable_blocks_is_named():
    assert set_grad_checkpointing(torch.nn.Linear(2, 2)) == 0


# ---------------------------------------------------------------------- patch dropout


def test_patch_dropout_keeps_a_random_subset_in_training_only():
    torch.manual_seed(0)
    model = create_model("vit_debug", num_classes=4, patch_dropout=0.5)  # 16 patches, keeps 8
    seen = []
    model.blocks[0].register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    x = torch.randn(3, 3, 32, 32)
    model.train()(x)
    model.eval()(x)
    assert seen == [1 + 8, 1 + 16]  # class token + kept patches in training; everything at eval
    torch.manual_seed(1)
    a = model.train().forward_features(x)
    torch.manual_seed(2)
    b = model.forward_features(x)
    assert not torch.equal(a, b), "another draw keeps other patches"


def test_patch_dropout_flops_count_the_kept_tokens():
    full = flops_per_image("vit_b16")
    model = create_model("vit_b16", patch_dropout=0.5).to("meta")
    half = _flops_per_image(model)
    assert half == flops_per_image("vit_b16", mask_ratio=0.5)
    assert 0.45 * full < half < 0.55 * full  # the blocks see half the tokens; the embedding sees all


def _stage(**sections) -> dict:
    return {"name": "t", "data": {"train": "/nonexistent"}, **sections}


def _load(tmp_path: Path, **sections):
    """A stage file through load_config, which also builds the model on the meta device."""
    path = tmp_path / "stage.yaml"
    path.write_text(yaml.safe_dump(_stage(**sections)))
    return load_config(path)


def test_patch_dropout_config_errors_name_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="model.patch_dropout.*supervised"):
        validate_config(
            _stage(model={"name": "mae_vit_debug", "patch_dropout": 0.5}, objective={"name": "mae"})
        )
    with pytest.raises(ConfigError, match="model.patch_dropout: swin_debug has no patch dropout"):
        _load(tmp_path, model={"name": "swin_debug", "patch_dropout": 0.5})
    with pytest.raises(ConfigError, match="relative"):
        _load(
            tmp_path,
            model={"name": "vit_debug", "patch_dropout": 0.5, "overrides": {"pos_embed": "relative"}},
        )
    assert _load(tmp_path, model={"name": "vit_debug", "patch_dropout": 0.5}).model.patch_dropout == 0.5


# ---------------------------------------------------------------------- precision, decode, peaks


def test_precision_defaults_to_bf16_on_gpu_and_fp32_on_cpu():
    assert validate_config(_stage(cluster={"use_gpu": False})).deepspeed.precision == "fp32"
    gpu = validate_config(_stage(cluster={"use_gpu": True}))
    assert gpu.deepspeed.precision == "bf16" and gpu.deepspeed.tf32
    assert (
        validate_config(
            _stage(cluster={"use_gpu": True}, deepspeed={"precision": "fp32"})
        ).deepspeed.precision
        == "fp32"
    )
    assert validate_config(_stage()).tracking.log_every == 20


def test_use_gpu_auto_is_decided_where_the_stage_starts_with_the_precision():
    auto = validate_config(_stage())
    assert auto.cluster.use_gpu == "auto" and auto.deepspeed.precision is None  # not decided at load
    cpu, gpu = auto.on_device(False), auto.on_device(True)
    assert (cpu.cluster.use_gpu, cpu.deepspeed.precision) == (False, "fp32")
    assert (gpu.cluster.use_gpu, gpu.deepspeed.precision) == (True, "bf16")
    assert auto.on_device(True).model_dump(exclude={"cluster", "deepspeed"}) == auto.model_dump(
        exclude={"cluster", "deepspeed"}
    )
    # A precision the user set stays; a use_gpu the user set is never overridden.
    fp32 = validate_config(_stage(deepspeed={"precision": "fp32"})).on_device(True)
    assert (fp32.cluster.use_gpu, fp32.deepspeed.precision) == (True, "fp32")
    forced = validate_config(_stage(cluster={"use_gpu": False}))
    assert forced.on_device(True) is forced


# DeepSpeed's accelerator (DS_ACCELERATOR, read once at its import) against the stage's device: the launchers
# import no DeepSpeed, each rank sets it from its stage, and one that names the other device is refused.
ACCELERATOR_SCRIPT = """
import os, sys
import cluster.run, pipeline.train.launch  # the Ray worker's and the torchrun rank's entry points
print("imported:", "deepspeed" in sys.modules)
from pipeline.distributed import AcceleratorMismatch, deepspeed_module, use_accelerator
os.environ["DS_ACCELERATOR"] = "cuda"  # left in the environment, the other device than the stage's
try:
    use_accelerator(False)
except AcceleratorMismatch as exc:
    print("refused:", exc)
del os.environ["DS_ACCELERATOR"]
use_accelerator(False)
print("set:", os.environ["DS_ACCELERATOR"])
deepspeed_module()
from deepspeed.accelerator import get_accelerator
print("deepspeed:", get_accelerator().device_name())
use_accelerator(False)  # the same device again: fine
try:
    use_accelerator(True)
except AcceleratorMismatch as exc:
    print("refused:", exc)
"""


def test_deepspeed_takes_each_stages_device_and_refuses_a_ds_accelerator_naming_the_other():
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    script = [sys.executable, "-c", ACCELERATOR_SCRIPT]
    proc = subprocess.run(script, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "imported: False", proc.stdout  # so a rank can still choose its accelerator
    refused = "refused: DS_ACCELERATOR=cuda is set, but this stage runs on the CPU (cluster.use_gpu: false)"
    assert lines[1].startswith(refused), lines[1]
    assert "Unset DS_ACCELERATOR" in lines[1] and "cluster.use_gpu=true" in lines[1], lines[1]
    assert lines[2:4] == ["set: cpu", "deepspeed: cpu"], proc.stdout
    refused = "refused: DeepSpeed was imported with its cpu accelerator, but this stage runs on a GPU"
    assert lines[4].startswith(refused), lines[4]


def test_a_training_run_under_a_ds_accelerator_for_the_other_device_stops_at_once_naming_it(
    smoke_dataset, tmp_path
):
    """Before: DeepSpeed (DS_ACCELERATOR=cuda) set a CUDA device for a CPU stage and crashed inside torch."""
    env = {**os.environ, "DS_ACCELERATOR": "cuda"}
    proc = subprocess.run(
        [
            sys.executable, "-m", "vitpipe", "train", "configs/experiments/smoke.yaml", "cluster.launcher=local",
            f"data.train={smoke_dataset}", f"run_dir={tmp_path / 'run'}", "optim.steps=2", "optim.warmup_steps=1",
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "DS_ACCELERATOR=cuda is set, but this stage runs on the CPU" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "checkpoints").exists()


def test_a_cpu_stage_on_a_host_with_cuda_never_starts_cuda(monkeypatch, tmp_path):
    """Reading the CUDA RNG state, or pinning batches, starts CUDA: a CPU stage on a GPU host held a context
    on its first GPU in every rank. Both now follow the stage's device (CUDA started by a GPU stage)."""
    from pipeline.data.loader import make_eval_loader
    from pipeline.train.tag import rng_state, set_rng_state

    def starts_cuda(*args, **kwargs):
        raise AssertionError("a CPU stage started CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", starts_cuda)
    monkeypatch.setattr(torch.cuda, "set_rng_state", starts_cuda)
    monkeypatch.setattr(torch.cuda, "current_device", starts_cuda)
    assert not torch.cuda.is_initialized()
    state = rng_state()
    assert state["cuda"] is None
    set_rng_state({**state, "cuda": torch.zeros(16, dtype=torch.uint8)})  # saved by a GPU stage
    set_rng_state({**state, "cuda": [torch.zeros(16, dtype=torch.uint8)]})  # the older per-device list
    data = tmp_path / "data"
    samples = synthetic_samples(8, 2, seed=0, width=16, height=16, val_fraction=0.5)
    write_dataset(data, samples, class_names(2), True, 8)
    cfg = DataConfig(train=str(data), batch_size=2, num_workers=0)
    train = make_train_loader(dataset_info(data, "train"), cfg, rank=0, world_size=1, img_size=16, seed=0)
    val = make_eval_loader(dataset_info(data, "val"), cfg, rank=0, world_size=1, batch_size=2, img_size=16)
    assert not train.pin_memory and not val.pin_memory
    pinned = make_train_loader(
        dataset_info(data, "train"), cfg, rank=0, world_size=1, img_size=16, seed=0, pin_memory=True
    )
    assert pinned.pin_memory  # a GPU stage's (the loop passes its device's)


def test_bf16_models_hand_their_losses_and_metrics_fp32_values():
    """Under bf16 weights (the GPU default) what losses and metrics read is fp32: SETR's upsampled logits
    (on CUDA the bilinear backward sums about (2p)^2 atomic adds in the logits' dtype), DETR's boxes (bf16 puts
    a centre within 2^-8 of the side), MAE's and SimMIM's losses (as the reference's, targets in fp32), and
    an evaluation's head under bf16 autocast (bf16 logits tie)."""
    from pipeline.eval.run import embed_split
    from pipeline.models.mae import patchify

    torch.manual_seed(0)
    images = torch.randn(2, 3, 32, 32)
    for decoder in ("naive", "pup"):
        setr = create_model(f"setr_{decoder}_vit_debug", num_classes=3, img_size=32).to(torch.bfloat16)
        logits = setr(images.to(torch.bfloat16))
        assert logits.dtype == torch.float32 and logits.shape == (2, 3, 32, 32), decoder
        logits.sum().backward()  # the upsample's backward reaches the bf16 classifier
        assert setr.classifier.weight.grad is not None
        setr = create_model(f"setr_{decoder}_vit_debug", num_classes=3, img_size=32).eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # an evaluation's
            evaluated = setr(images)
            features = setr.decode_head(setr.patch_features(images))
        assert features.dtype == torch.bfloat16  # the body did run under autocast...
        expected = F.interpolate(setr.classifier(features.float()), size=(32, 32), mode="bilinear")
        assert torch.equal(evaluated, expected)  # ...the classifier in fp32
    detr = create_model("detr_vit_debug", num_classes=3, img_size=32).to(torch.bfloat16)
    classes, boxes = detr(images.to(torch.bfloat16))
    assert boxes.dtype == torch.float32 and classes.dtype == torch.bfloat16  # training: the weights' dtype
    detr = create_model("detr_vit_debug", num_classes=3, img_size=32).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        classes, boxes = detr(images)
    assert classes.dtype == boxes.dtype == torch.float32  # an evaluation's: fp32 scores, no bf16 ties

    # MAE and SimMIM: bf16 weights, fp32 images (as the objective passes them): the targets are those.
    x = images  # fp32
    mae = create_model("mae_vit_debug", img_size=32, norm_pix_loss=True).to(torch.bfloat16)
    loss, pred, mask = mae(x, generator=torch.Generator().manual_seed(0))
    assert pred.dtype == torch.bfloat16  # the model did run in bf16
    target = patchify(x, mae.patch_size)
    target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6) ** 0.5
    expected = (((pred.float() - target) ** 2).mean(-1) * mask).sum() / mask.sum()
    assert torch.equal(loss, expected)

    simmim = create_model("simmim_swin_debug", img_size=64).to(torch.bfloat16)
    x = torch.randn(13, 3, 64, 64)
    loss, rec, masked = simmim(x, generator=torch.Generator().manual_seed(0))
    assert rec.dtype == torch.bfloat16
    p = simmim.patch_size
    weight = masked.repeat_interleave(p, 1).repeat_interleave(p, 2).unsqueeze(1).float()
    l1 = (rec.float() - x).abs()
    assert weight.sum() != weight.to(torch.bfloat16).sum().float()  # a count bf16 cannot hold exactly
    assert torch.equal(loss, (l1 * weight).sum() / (weight.sum() * 3 + 1e-5))

    vit = create_model("vit_debug", num_classes=5, img_size=32).eval()
    torch.nn.init.normal_(vit.head.weight, std=2.0)  # initialised to zero: logits far from it, as trained
    batch = {"image": (images.clamp(-1, 1) * 100 + 128).to(torch.uint8), "target": torch.zeros(2)}
    batch |= {"valid": torch.ones(2, dtype=torch.bool), "key": ["a", "b"]}
    found = embed_split(vit, [batch], torch.device("cpu"), with_logits=True, amp_dtype=torch.bfloat16)
    from pipeline.data.transforms import IMAGENET_MEAN, IMAGENET_STD, normalize

    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tokens = vit.forward_features(normalize(batch["image"], IMAGENET_MEAN, IMAGENET_STD))
            assert vit.forward_head(tokens).dtype == torch.bfloat16  # the head, left under autocast
        head = vit.forward_head(tokens.float())
    assert torch.equal(found.logits, head) and found.logits.dtype == torch.float32


def test_cuda_decode_needs_a_gpu_and_no_randaugment():
    with pytest.raises(ConfigError, match="data.decode: cuda .* cluster.use_gpu"):
        validate_config(_stage(data={"train": "/x", "decode": "cuda"}, cluster={"use_gpu": False}))
    # auto: refused where the stage starts without a GPU, with the setting named
    auto = validate_config(_stage(data={"train": "/x", "decode": "cuda"}))
    with pytest.raises(ConfigError, match=r"(?s)use_gpu: auto found no GPU.*data.decode: cuda"):
        auto.on_device(False)
    assert auto.on_device(True).data.decode == "cuda"
    with pytest.raises(ConfigError, match="RandAugment"):
        validate_config(
            _stage(data={"train": "/x", "decode": "cuda", "randaugment": [2, 9]}, cluster={"use_gpu": True})
        )


@pytest.mark.parametrize(
    "name, precision, tf32, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", True, 989),
        ("NVIDIA H200", "bf16", True, 989),
        ("NVIDIA GH200 480GB", "fp16", True, 989),
        ("NVIDIA H100 PCIe", "bf16", True, 756),
        ("NVIDIA H100 NVL", "bf16", True, 835.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", True, 312),
        ("NVIDIA A100 80GB PCIe", "fp32", True, 156),
        ("NVIDIA A100-SXM4-40GB", "fp32", False, 19.5),
        ("NVIDIA L40S", "bf16", True, 362),
        ("NVIDIA L4", "bf16", True, 121),
        ("NVIDIA H100 80GB HBM3", "fp32", True, 494.7),
    ],
)
def test_peak_table_by_device_name_and_precision(name, precision, tf32, tflops):
    assert peak_flops(name, precision, tf32) == pytest.approx(tflops * 1e12)


def test_unknown_devices_have_no_peak():
    assert peak_flops("cpu", "fp32") is None
    assert peak_flops("Some Accelerator 9000", "bf16") is None


# ---------------------------------------------------------------------- the CUDA-decode data path


def _dataset(root: Path) -> Path:
    """24 JPEGs and, in the last shard, a PNG and a JPEG whose body is cut short (its header reads)."""
    samples = list(synthetic_samples(24, 4, seed=3, width=64, height=48))
    png = io.BytesIO()
    Image.new("RGB", (40, 40), (200, 30, 30)).save(png, format="PNG")
    cut = samples[0].image[: len(samples[0].image) // 2]
    samples += [
        Sample("png_0", png.getvalue(), "png", [1], 40, 40),
        Sample("cut_0", cut, "jpg", [2], 64, 48),
    ]
    write_dataset(root, samples, class_names(4), multi_label=True, max_count=13)
    return root


def _batches(root: Path, decode: str, n: int) -> list[dict]:
    info = dataset_info(root, "train")
    data = DataConfig(train="-", batch_size=13, num_workers=0, shuffle_buffer=0, min_scale=0.3, decode=decode)
    loader = make_train_loader(info, data, rank=0, world_size=1, img_size=32, seed=5)
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_cuda_decode_path_matches_the_cpu_path(tmp_path):
    """The workers draw the same crop and flip for a JPEG they leave encoded; decoded and cropped on the
    device (here the CPU with PIL in nvJPEG's place) it matches the CPU path's image within resampling
    noise, far closer than its mirror image. Other formats come decoded; a JPEG that fails to decode on
    the device is replaced by another image of the batch and counted as skipped."""
    root = _dataset(tmp_path / "data")
    cpu_images, cpu_targets = {}, {}
    for b in _batches(root, "cpu", 2):
        for i, key in enumerate(b["key"]):
            cpu_images.setdefault(key, b["image"][i].float())
            cpu_targets.setdefault(key, b["target"][i])
    encoded = _batches(root, "cuda", 2)
    to_device = DeviceDecode(torch.device("cpu"), 32, pil_decoder(torch.device("cpu")))
    checked = 0
    for b_enc in encoded:
        assert {"jpeg_data", "jpeg_offsets", "box", "flip"} <= b_enc.keys()
        keys = b_enc["key"]
        sizes = (b_enc["jpeg_offsets"][1:] - b_enc["jpeg_offsets"][:-1]).tolist()
        for key, size in zip(keys, sizes):
            assert (size == 0) == (key == "png_0"), f"{key}: only the PNG is decoded in the worker"
        dev = to_device(b_enc)
        assert dev["image"].shape == (13, 3, 32, 32) and dev["image"].dtype == torch.uint8
        for i, key in enumerate(keys):
            if key == "cut_0" or key not in cpu_images:
                continue
            a, b = dev["image"][i].float(), cpu_images[key]
            same = (a - b).abs().mean().item()
            mirrored = (a - b.flip(-1)).abs().mean().item()
            assert same < 2, f"{key}: mean abs difference {same:.1f} from the CPU path"
            assert same < mirrored or same == 0, (
                f"{key}: closer to the mirrored image ({same:.1f} vs {mirrored:.1f})"
            )
            assert torch.equal(dev["target"][i], cpu_targets[key]), key
            checked += 1
    assert checked >= 20
    cut_batches = [b for b in encoded if "cut_0" in b["key"]]
    assert cut_batches, "the cut JPEG reached a batch with its header read"
    assert to_device.failed == 1


def test_encoded_batches_carry_only_the_images_the_workers_decoded(tmp_path):
    """No full image batch in an encoded batch (it would be pinned and copied for slots the GPU fills): just the
    images the workers decoded (the PNG), the same as the CPU path's, with their slots."""
    root = _dataset(tmp_path / "data")
    cpu = {key: b["image"][i] for b in _batches(root, "cpu", 2) for i, key in enumerate(b["key"])}
    seen_png = False
    for b in _batches(root, "cuda", 2):
        assert "image" not in b
        slots = b["decoded_slots"].tolist()
        assert slots == [i for i, key in enumerate(b["key"]) if key == "png_0"]
        assert b["decoded_images"].shape == (len(slots), 3, 32, 32)
        assert b["decoded_images"].dtype == torch.uint8
        for j, slot in enumerate(slots):
            assert torch.equal(b["decoded_images"][j], cpu[b["key"][slot]])
            seen_png = True
    assert seen_png


def _random_crops(n: int, seed: int) -> tuple[list[torch.Tensor], list[tuple], list[bool]]:
    """Images of 1 to 150 pixels a side, boxes from a pixel to past the edges (upscales and downscales of up
    to ~20x at 8 px), every other one flipped; and three fixed cases: the whole image, one pixel, a crop of
    exactly the output size (24 px)."""
    g = torch.Generator().manual_seed(seed)
    images, boxes = [], []
    for _ in range(n):
        h, w = torch.randint(1, 151, (2,), generator=g).tolist()
        images.append(torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g))
        x0, x1 = sorted((torch.rand(2, generator=g) * 1.2 * w - 0.1 * w).tolist())
        y0, y1 = sorted((torch.rand(2, generator=g) * 1.2 * h - 0.1 * h).tolist())
        boxes.append((x0, y0, x1, y1))
    smooth = torch.linspace(0, 255, 60 * 80).round().to(torch.uint8).view(1, 60, 80).repeat(3, 1, 1)
    images += [smooth, smooth, smooth]
    boxes += [(0, 0, 80, 60), (10.2, 20.7, 10.9, 21.1), (5, 6, 29, 30)]
    return images, boxes, [i % 2 == 1 for i in range(len(images))]


@pytest.mark.parametrize("size", [8, 24])
@pytest.mark.parametrize("max_elements", [None, 20_000])  # 20,000: the batch is cut into groups
def test_batched_crop_matches_the_per_image_crop(size, max_elements):
    """`crop_resize_flip_batch` (two batched matmuls) gives `crop_resize_flip`'s images (torch's antialiased
    bilinear, per image) within one grey level, on a few pixels only, whatever the crop's scale and flip."""
    images, boxes, flips = _random_crops(40, seed=size)
    expected = torch.stack([crop_resize_flip(im, b, f, size) for im, b, f in zip(images, boxes, flips)])
    kwargs = {} if max_elements is None else {"max_elements": max_elements}
    got = crop_resize_flip_batch(images, boxes, flips, size, **kwargs)
    assert got.shape == (len(images), 3, size, size) and got.dtype == torch.uint8
    diff = (got.int() - expected.int()).abs()
    assert diff.max().item() <= 1
    assert (diff > 0).float().mean().item() < 0.01
    if size == 24:  # a 24 px crop at 24 px: the pixels themselves
        crop = images[-1][:, 6:30, 5:29]
        assert torch.equal(got[-1], crop.flip(-1) if flips[-1] else crop)


def test_batched_crop_launches_as_many_ops_for_any_batch_size():
    """One batch, one set of kernels: the ops that compute (views aside) do not grow with the batch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += not func.is_view
            return func(*args, **(kwargs or {}))

    counts = []
    for n in (2, 16):
        images, boxes, flips = _random_crops(n, seed=1)
        with CountOps() as counter:
            crop_resize_flip_batch(images, boxes, flips, 16)
        counts.append(counter.ops)
    assert counts[0] == counts[1] < 70, counts


def _encoded_loader(root: Path, pin_memory: bool = False):
    info = dataset_info(root, "train")
    data = DataConfig(train="-", batch_size=13, num_workers=0, shuffle_buffer=0, min_scale=0.3, decode="cuda")
    return make_train_loader(info, data, rank=0, world_size=1, img_size=32, seed=5, pin_memory=pin_memory)


def test_prefetcher_yields_the_plain_paths_batches_in_order(tmp_path):
    """The prefetcher (a thread decoding ahead; on the CPU with the PIL decoder, no streams) yields what
    decoding each batch in turn yields, in the same order, and its thread ends when it is closed."""
    root = _dataset(tmp_path / "data")
    cpu = torch.device("cpu")
    plain_it, plain_decode = iter(_encoded_loader(root)), DeviceDecode(cpu, 32, pil_decoder(cpu))
    plain = [plain_decode(next(plain_it)) for _ in range(5)]
    batches, to_device = prefetch(iter(_encoded_loader(root)), DeviceDecode(cpu, 32, pil_decoder(cpu)), cpu)
    assert isinstance(batches, Prefetcher)
    made = [to_device(next(batches)) for _ in range(5)]
    for a, b in zip(plain, made):
        assert a["key"] == b["key"]
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["target"], b["target"])
        assert a["skipped"] == b["skipped"]
    assert batches.gpu_idle_seconds() is None  # CUDA events only
    batches.close()
    assert not batches._thread.is_alive()


class _Source:
    """A loader iterator stand-in: `good` batches, then `end` raised (StopIteration: a finite loader's end);
    records the threads that read it and its shutdown."""

    def __init__(self, good: int, end: Exception):
        self.good, self.end, self.taken, self.shut = good, end, 0, False
        self.threads: set[str] = set()

    def __next__(self) -> dict:
        self.threads.add(threading.current_thread().name)
        if self.taken == self.good:
            raise self.end
        self.taken += 1
        return {"n": self.taken}

    def _shutdown_workers(self) -> None:
        self.shut = True


def test_prefetcher_raises_the_loaders_error_in_the_caller():
    source = _Source(2, ValueError("shard 7 is not a tar file"))
    batches = Prefetcher(source, lambda b: {**b, "made": True}, torch.device("cpu"))
    assert [next(batches)["n"] for _ in range(2)] == [1, 2]
    with pytest.raises(ValueError, match="shard 7"):
        next(batches)
    with pytest.raises(StopIteration):
        next(batches)
    assert source.threads == {"device-prefetch"}  # the loader ran in the prefetch thread only
    batches.close()
    assert not batches._thread.is_alive()


def test_prefetcher_ends_at_the_loaders_end_and_stops_when_closed():
    batches = Prefetcher(_Source(3, StopIteration()), lambda b: b, torch.device("cpu"))
    assert [b["n"] for b in batches] == [1, 2, 3]  # a finite loader: StopIteration at its end
    endless = _Source(10**9, StopIteration())
    batches = Prefetcher(endless, lambda b: b, torch.device("cpu"), depth=1)
    next(batches)
    _shutdown_loader(batches)  # the loop's shutdown: the thread stops (it was waiting on a full queue)...
    assert not batches._thread.is_alive()
    assert endless.shut  # ...then the loader's workers
    assert endless.taken <= 4  # it never ran more than the queue's depth ahead


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefetcher_on_cuda_matches_the_cpu_path(tmp_path):
    """The real stream path (side stream, event wait, record_stream, idle events) with PIL in nvJPEG's place:
    the same batches as the CPU, and the GPU idle time measured."""
    root = _dataset(tmp_path / "data")
    cpu, gpu = torch.device("cpu"), torch.device("cuda", torch.cuda.current_device())
    plain_it, plain_decode = iter(_encoded_loader(root)), DeviceDecode(cpu, 32, pil_decoder(cpu))
    plain = [plain_decode(next(plain_it)) for _ in range(4)]
    pinned = _encoded_loader(root, pin_memory=True)  # as a GPU stage's loop makes it
    batches, to_device = prefetch(iter(pinned), DeviceDecode(gpu, 32, pil_decoder(gpu)), gpu)
    for expected in plain:
        batch = to_device(next(batches))
        assert batch["image"].device == gpu and batch["key"] == expected["key"]
        diff = (batch["image"].cpu().int() - expected["image"].int()).abs()
        assert diff.max().item() <= 1 and torch.equal(batch["target"].cpu(), expected["target"])
        (batch["image"].float().mean() * 2).sum()  # a "step" on the training stream
    torch.cuda.synchronize()
    idle = batches.gpu_idle_seconds()
    assert idle is not None and idle >= 0
    _shutdown_loader(batches)
    assert not batches._thread.is_alive()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["mae_vit_debug", "mpp_vit_debug", "simmim_swin_debug"])
def test_masking_wrappers_take_a_cpu_generator_with_cuda_images(name):
    """The documented call (`model(imgs, generator=torch.Generator().manual_seed(seed))`) on a CUDA model:
    the mask is drawn on the generator's device and moved, the same mask as the CPU model's."""
    torch.manual_seed(0)
    model = create_model(name).train()
    images = torch.randn(2, 3, 32, 32)
    masks = {}
    for device in ("cpu", "cuda"):
        model.to(device)
        masks[device] = _loss_and_mask(model, FAMILIES[name], images.to(device))
    assert masks["cuda"].device.type == "cuda" and torch.equal(masks["cuda"].cpu(), masks["cpu"])


def _loss_and_mask(model, kind: str, images: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)  # on the CPU, whatever the model's device
    if kind == "mpp":
        targets = torch.randint(0, 512, (images.shape[0], model.encoder.patch_embed.num_patches))
        loss, *_, mask = model(images, targets.to(images.device), generator=g)
    else:
        loss, _, mask = model(images, generator=g)
    assert torch.isfinite(loss)
    return mask


# ---------------------------------------------------------------------- torch.compile in the engine

SMOKE = Path(__file__).parents[1] / "configs/experiments/smoke.yaml"


@pytest.mark.dist
@pytest.mark.slow
def test_compiled_model_trains_like_eager_under_zero3(smoke_dataset, tmp_path):
    """model.compile: true runs the model under torch.compile inside the DeepSpeed engine (2 ranks, ZeRO-3,
    activation checkpointing): the same losses as eager, to float tolerance (inductor fuses differently)."""
    losses = {}
    for mode in ("eager", "compiled"):
        run_dir = tmp_path / mode
        torchrun(
            "-m",
            "pipeline.train.launch",
            str(SMOKE),
            f"run_dir={run_dir}",
            f"data.train={smoke_dataset}",
            "cluster.launcher=local",
            "deepspeed.zero_stage=3",
            "model.grad_checkpointing=1.0",
            f"model.compile={mode == 'compiled'}",
            "optim.steps=6",
            "data.num_workers=1",
            "tracking.system_metrics=false",
            "checkpoint.export=false",
        )
        losses[mode] = [v for _, v in history(run_dir)]
    assert len(losses["eager"]) == 6
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4, abs=1e-5)


BENCH = Path(__file__).parents[1] / "bench/gpu.py"


def _gpu_bench():
    # As a script sees it: bench/ on the path (its `from provenance import ...`), not only when another
    # test module put it there first.
    if str(BENCH.parent) not in sys.path:
        sys.path.insert(0, str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_gpu_bench_dry_run_runs_every_case_on_cpu(tmp_path):
    """bench/gpu.py --dry-run: the benchmark's code, debug models on CPU, every default case done.
    Eager only: compiling costs a minute on these cores; test_compiled_model_trains_like_eager_under_zero3
    runs the compiled engine and test_compile_applies_to_each_transformer_block_not_the_whole_model checks
    what is compiled."""
    bench = _gpu_bench()
    names = [n for n, c in bench.CASES.items() if c.default and not (c.train and c.train.compiled)]
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        # The budget and the hang guard above what the suite's full load needs (the old bench took 255 s).
        [
            sys.executable,
            str(BENCH),
            "--dry-run",
            "--cases",
            ",".join(names),
            "--budget-s",
            "1100",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] and result["errors"] == [] and result["dataset"]["status"] == "done"
    cases = result["cases"]
    assert list(cases) == names and all(c["status"] == "done" for c in cases.values()), cases
    for name in names:
        if bench.CASES[name].kind == "train":
            assert cases[name]["images_per_s"] > 0 and cases[name]["forward_flops_per_image"] > 0, name
    # ViT-H and MAE-H train without recompute under ZeRO-1; the ZeRO-3 case recomputes every block.
    assert cases["vit_h14"]["zero"] == 1 and cases["vit_h14"]["checkpointing"] == 0
    assert cases["mae_vit_h14"]["zero"] == 1 and cases["mae_vit_h14"]["checkpointing"] == 0
    assert cases["vit_h14_zero3_ckpt"]["zero"] == 3 and cases["vit_h14_zero3_ckpt"]["checkpointing"] == 1
    fed = cases["fed_cuda_vit_b16"]
    assert 0 <= fed["data_wait_fraction"] <= 1 and fed["gpu_idle_fraction"] is None  # no CUDA events on CPU
    assert result["goals"]["vit_b16"]["mfu_goal"] == 0.45


def test_gpu_bench_skips_what_the_budget_leaves_no_time_for_and_writes_the_json(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--dry-run", "--budget-s", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    bench = _gpu_bench()
    assert list(result["cases"]) == [n for n, c in bench.CASES.items() if c.default]
    assert all(c["status"] == "skipped" and "budget" in c["reason"] for c in result["cases"].values())
    assert result["wall_s"] < 60


def test_gpu_bench_default_run_fits_its_budget_by_design():
    """The default cases' expected times (docs/gpu.md) fit the 7-minute budget with room for the dataset."""
    bench = _gpu_bench()
    default = [c for c in bench.CASES.values() if c.default]
    assert bench.BUDGET_S <= 420
    assert sum(c.expected_s for c in default) + 30 <= 0.85 * bench.BUDGET_S
    assert all(c.expected_s < c.cap_s for c in bench.CASES.values())


def test_a_failed_gpu_bench_case_keeps_the_exception(tmp_path):
    """A case that raises is marked failed with its exception's last lines, not a shutdown warning."""
    bench = _gpu_bench()
    bad = bench.Train("no_such_model", 1, 0.0, "supervised_softmax", 8, 32, steps=1, warmup=1)
    result = bench.run_case("train", {"train": dataclasses.asdict(bad), "gpu": False}, timeout=300)
    assert result["status"] == "failed"
    assert any("no_such_model" in line for line in result["error"]), result["error"]
