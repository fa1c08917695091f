"""Every model family and every objective through the real DeepSpeed engine in bf16 (the GPU default), on the
CPU: forward, backward and three optimizer steps, a finite loss, and every parameter updated that the same
steps update in fp32 (a few get no gradient yet by design: LeViT's attention biases over a single token at
the debug size, parameters behind a zero-initialised residual branch).

    .venv/bin/python -m pytest tests/test_precision.py -q

One process, one rank (a gloo group of one): the engine, the objective and the loop's `train_step` are the
real ones; the batches are made here (the loader is the same in every precision). ZeRO-3 partitions and
casts parameters its own way, so every case runs under ZeRO-2 and ZeRO-3; ZeRO-0 (DeepSpeed's separate
bf16 optimizer wrapper) runs for the plain ViT and MAE. fp32 runs everywhere else in the suite, and here as
the reference. fp16 is refused by the config (DeepSpeed cannot run it on a CPU, so it could not be tested).
"""

from __future__ import annotations

import math
import socket
from pathlib import Path

import pytest
import torch
from conftest import models_for

from pipeline.config import ConfigError, load_config, validate_config
from pipeline.distributed import init_distributed, shutdown_distributed
from pipeline.models import create_model
from pipeline.objectives import build_objective
from pipeline.stage import model_kwargs
from pipeline.train import checkpoint
from pipeline.train.engine import bucket_elements, build_engine, consolidated_state_dict
from pipeline.train.export import export_weights
from pipeline.train.loop import train_step

pytestmark = pytest.mark.unit

CLASSES, IMG, BATCH = 5, 32, 4
# (model, objective, model overrides): every registered debug family with the objective it trains under.
CASES: list[tuple[str, str, dict]] = [
    *[(m, "supervised_softmax", {}) for m in models_for("classifier", debug=True)],
    *[(m, "mae", {}) for m in models_for("mae", debug=True)],
    *[(m, "simmim", {}) for m in models_for("simmim", debug=True)],
    *[(m, "masked_patch_prediction", {}) for m in models_for("masked_patch", debug=True)],
    *[(m, "segmentation", {}) for m in models_for("segmentation", debug=True)],
    *[(m, "detection", {}) for m in models_for("detection", debug=True)],
    ("vit_debug", "supervised_sigmoid", {}),
    ("vit_debug", "distill", {}),
    ("levit_debug", "distill", {}),  # its own distillation head
    # The plain ViT's variants: every position embedding, both poolings, patch dropout, the hybrid stem.
    *[
        ("vit_debug", "supervised_sigmoid", {"pos_embed": k})
        for k in ("learned_2d", "sincos2d", "relative", "none")
    ],
    ("vit_debug", "supervised_softmax", {"pool": "gap", "pos_embed": "sincos2d"}),
    ("vit_debug", "supervised_softmax", {"patch_dropout": 0.5}),
    ("mae_vit_debug", "mae", {"pos_embed": "learned", "norm_pix_loss": True}),
    # Masked patch prediction embeds its own (corrupted) patches: a fixed sincos table is an fp32 buffer.
    ("mpp_vit_debug", "masked_patch_prediction", {"pos_embed": "sincos2d"}),
]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _case_id(case: tuple[str, str, dict]) -> str:
    model, objective, overrides = case
    return "-".join([model, objective, *(f"{k}={v}" for k, v in overrides.items())])


@pytest.fixture(scope="module")
def one_rank():
    """A process group of one rank (gloo) for the module's engines; left when the module ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        yield init_distributed(use_gpu=False)
        shutdown_distributed()


@pytest.fixture(scope="module")
def teacher_weights(tmp_path_factory) -> Path:
    """A vit_debug export for the distillation cases (any weights do: the test checks the mechanics)."""
    torch.manual_seed(0)
    kwargs = {"num_classes": CLASSES}
    model = create_model("vit_debug", **kwargs)
    out = tmp_path_factory.mktemp("teacher")
    return export_weights(model.state_dict(), "vit_debug", kwargs, out, 0)


def _config(model: str, objective: str, overrides: dict, precision: str, zero: int, teacher: Path):
    obj: dict = {"name": objective}
    if objective == "distill":
        obj["teacher"] = {
            "model": "vit_debug",
            "weights": str(teacher),
            "overrides": {"num_classes": CLASSES},
        }
    model_overrides = dict(overrides)
    patch_dropout = model_overrides.pop("patch_dropout", 0.0)
    return validate_config(
        {
            "name": "precision",
            "data": {"train": "unused", "batch_size": BATCH},
            "model": {
                "name": model,
                "img_size": IMG,
                "overrides": model_overrides,
                "patch_dropout": patch_dropout,
            },
            "objective": obj,
            "optim": {"lr": 1e-3, "steps": 10, "warmup_steps": 0},
            "deepspeed": {"zero_stage": zero, "precision": precision},
            "cluster": {"launcher": "local"},
        }
    )


def _batches(objective: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        batch = {
            "image": torch.randint(0, 256, (BATCH, 3, IMG, IMG), dtype=torch.uint8, generator=g),
            "target": torch.randint(0, CLASSES, (BATCH,), generator=g),
            "skipped": 0,
        }
        if objective == "supervised_sigmoid":  # multi-hot, as the JFT-like corpus gives
            batch["target"] = (torch.rand(BATCH, CLASSES, generator=g) < 0.3).long()
        if objective == "segmentation":
            batch["mask"] = torch.randint(0, CLASSES, (BATCH, IMG, IMG), dtype=torch.uint8, generator=g)
        if objective == "detection":  # 1..3 objects of the debug DETR's 10 query rows, the rest padding
            centre, size = (
                torch.rand(BATCH, 10, 2, generator=g) * 0.5 + 0.25,
                torch.rand(BATCH, 10, 2, generator=g) * 0.3 + 0.1,
            )
            batch["boxes"] = torch.cat([centre, size], -1)
            batch["box_classes"] = torch.randint(0, CLASSES, (BATCH, 10), generator=g)
            batch["box_classes"][:, 3:] = -1
            batch["box_classes"][0, 1:] = -1
        yield batch


def _changed(one_rank, case, precision: str, zero: int, teacher: Path) -> set[str]:
    """Train three steps; -> the names of the parameters the steps changed (fp32 master weights)."""
    model_name, objective_name, overrides = case
    cfg = _config(model_name, objective_name, overrides, precision, zero, teacher)
    torch.manual_seed(0)
    model = create_model(model_name, **model_kwargs(cfg, CLASSES))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    objective = build_objective(cfg.objective)
    engine, _, _ = build_engine(model, cfg, one_rank)
    objective.prepare(engine.module, one_rank.device)
    dtypes = {p.dtype for p in engine.module.parameters()}  # ZeRO-3: partitioned, the dtype still says
    assert dtypes == {DTYPES[precision]}, f"the engine holds parameters in {dtypes}, not {precision}"
    batches = _batches(objective_name, seed=1)
    losses = []
    for step in range(3):
        loss, metrics, _, _, _ = train_step(engine, objective, batches, lambda b: b, 0, step, 1, 0)
        losses.append(loss.float().item())
        assert all(math.isfinite(v.float().item()) for v in metrics.values()), metrics
    assert all(math.isfinite(v) for v in losses), f"{precision} ZeRO-{zero}: losses {losses}"
    after = consolidated_state_dict(engine)
    return {k for k, v in before.items() if not torch.equal(after[k].float(), v.float())}


_FP32_CHANGED: dict[str, set[str]] = {}


def _run(one_rank, case, precision: str, zero: int, teacher: Path) -> None:
    key = _case_id(case)
    if key not in _FP32_CHANGED:  # the reference: the same steps in fp32 (ZeRO-2)
        _FP32_CHANGED[key] = _changed(one_rank, case, "fp32", 2, teacher)
    reference = _FP32_CHANGED[key]
    total = sum(1 for _ in create_model(case[0]).parameters())
    assert len(reference) >= 0.75 * total, f"fp32 updated only {len(reference)} of {total} parameters"
    changed = _changed(one_rank, case, precision, zero, teacher)
    assert changed == reference, (
        f"{precision} ZeRO-{zero}: not updated {sorted(reference - changed)}, "
        f"updated only here {sorted(changed - reference)}"
    )


# ZeRO-3 (slow: left out of `make test-fast`, run by `make test`) casts and partitions on its own path.
@pytest.mark.parametrize("zero", (2, pytest.param(3, marks=pytest.mark.slow)))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_family_and_objective_trains_in_bf16(one_rank, teacher_weights, case, zero):
    _run(one_rank, case, "bf16", zero, teacher_weights)


@pytest.mark.parametrize("objective", ("supervised_softmax", "mae"))
def test_zero0_bf16_wrapper(one_rank, teacher_weights, objective):
    """ZeRO-0 under bf16 goes through DeepSpeed's own bf16 optimizer wrapper, not ZeRO's."""
    model = "vit_debug" if objective != "mae" else "mae_vit_debug"
    _run(one_rank, (model, objective, {"pos_embed": "sincos2d"}), "bf16", 0, teacher_weights)


@pytest.mark.parametrize(
    "num_params, elements",
    [
        (250_001, 250_048),  # a debug model: one bucket holds it all, rounded up
        (5_717_416, 5_717_440),  # ViT-Ti
        (86_420_200, 10_802_560),  # ViT-B: num_params / 8
        (632_076_800, 79_009_600),  # ViT-H
        (10**10, 500_000_000),  # the ceiling
    ],
)
def test_communication_buckets_are_aligned_and_sized_from_the_model(num_params, elements):
    """ZeRO-1/2 refuse a bucket that is not a multiple of their alignment (2 elements in bf16): a model with
    an odd parameter count once got one. Sized num_params / 8 within [1e7, 5e8], never above the model."""
    assert bucket_elements(num_params) == elements and elements % 64 == 0


def test_fp16_is_refused_with_what_to_use_instead():
    with pytest.raises(ConfigError, match=r"deepspeed\.precision.*fp16 is not offered.*Use bf16"):
        load_config(
            Path(__file__).parents[1] / "configs/experiments/smoke.yaml", ["deepspeed.precision=fp16"]
        )


def test_a_weights_only_resume_under_zero0_bf16_trains_on_from_the_loaded_weights(
    one_rank, teacher_weights, tmp_path
):
    """debug.resume_optimizer: false under ZeRO-0 and bf16: DeepSpeed loads the module's weights but leaves its
    wrapper's fp32 masters as they were, which the next step would copy back; the resume refreshes them."""
    cfg = _config("vit_debug", "supervised_softmax", {}, "bf16", 0, teacher_weights)
    objective = build_objective(cfg.objective)
    engines = []
    for seed in (0, 1):  # the saving run, and a fresh run with other initial weights that resumes it
        torch.manual_seed(seed)
        engine, _, _ = build_engine(create_model("vit_debug", **model_kwargs(cfg, CLASSES)), cfg, one_rank)
        engines.append(engine)
    saving, resuming = engines
    batches = _batches("supervised_softmax", seed=1)
    for step in range(2):
        train_step(saving, objective, batches, lambda b: b, 0, step, 1, 0)
    saving.save_checkpoint(str(tmp_path), tag="step_2")
    saved = {k: p.detach().float().clone() for k, p in saving.module.named_parameters()}  # bf16 weights
    checkpoint._load(resuming, tmp_path, tmp_path / "step_2", None, load_optimizer=False)
    masters = consolidated_state_dict(resuming)
    for k, v in saved.items():
        torch.testing.assert_close(masters[k], v, msg=f"{k}: the fp32 master is not the loaded weight")
