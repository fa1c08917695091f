"""Input preprocessing: data.mean / data.std and eval.interpolation, decided per model family or taken from
the weights a stage starts from, recorded in exports, and applied by the objectives and the eval resize."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from pipeline.config import ConfigError, ObjectiveConfig, validate_config
from pipeline.data.transforms import IMAGENET_MEAN, IMAGENET_STD, _int_box, center_crop_box, eval_tensor
from pipeline.models import create_model
from pipeline.objectives import build_objective
from pipeline.stage import family_preprocessing, preprocessing_of, resolve_preprocessing
from pipeline.train.export import export_weights

pytestmark = pytest.mark.unit

HALF = [0.5, 0.5, 0.5]


def _stage(**sections):
    return validate_config({"name": "t", "data": {"train": "/nonexistent"}, **sections})


@pytest.mark.parametrize(
    "model, mean",
    [
        ("vit_b16", HALF),  # big_vision, timm's AugReg weights
        ("vit_r50_b16", HALF),  # the hybrid
        ("mpp_vit_b16", HALF),
        ("setr_pup_vit_b16", HALF),
        ("detr_vit_b16", HALF),
        ("tnt_s16", HALF),
        ("mae_vit_b16", list(IMAGENET_MEAN)),  # MAE's repository
        ("simmim_swin_t", list(IMAGENET_MEAN)),
        ("swin_t", list(IMAGENET_MEAN)),
        ("cvt_13", list(IMAGENET_MEAN)),
        ("levit_128", list(IMAGENET_MEAN)),
    ],
)
def test_a_stage_from_nothing_takes_its_model_familys_statistics(model, mean):
    task = {"setr_": "segmentation", "detr_": "detection"}.get(model[:5], "supervised_softmax")
    cfg = resolve_preprocessing(_stage(model={"name": model}, objective={"name": task}))
    assert list(cfg.data.mean) == mean and cfg.eval.interpolation == "bicubic"
    assert family_preprocessing(model)["mean"] == mean


def test_a_stage_takes_what_the_export_it_starts_from_recorded(tmp_path):
    """An MAE export (ImageNet statistics) fine-tuned into a ViT (whose family default is 0.5): the fine-tuning
    keeps the statistics the encoder learned with. The export records them; explicit settings win."""
    model = create_model("mae_vit_debug", img_size=32)
    recorded = {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "interpolation": "bilinear"}
    export_weights(model.state_dict(), "mae_vit_debug", {"img_size": 32}, tmp_path / "export", 3, recorded)
    assert json.loads((tmp_path / "export/model.json").read_text())["preprocessing"] == recorded

    cfg = resolve_preprocessing(_stage(model={"name": "vit_debug", "init_from": str(tmp_path / "export")}))
    assert list(cfg.data.mean) == list(IMAGENET_MEAN) and list(cfg.data.std) == list(IMAGENET_STD)
    assert cfg.eval.interpolation == "bilinear"
    assert preprocessing_of(cfg) == recorded  # what this stage's own export will record
    # the weights file rather than its folder: the record beside it
    by_file = resolve_preprocessing(
        _stage(model={"name": "vit_debug", "init_from": str(tmp_path / "export/model.safetensors")})
    )
    assert list(by_file.data.mean) == list(IMAGENET_MEAN)

    own = resolve_preprocessing(
        _stage(
            model={"name": "vit_debug", "init_from": str(tmp_path / "export")},
            data={"train": "/x", "mean": [0.1, 0.2, 0.3], "std": [0.4, 0.5, 0.6]},
            eval={"interpolation": "bicubic"},
        )
    )
    assert list(own.data.mean) == [0.1, 0.2, 0.3] and own.eval.interpolation == "bicubic"

    # an export from before exports recorded it: the model family's
    (tmp_path / "export/model.json").write_text(json.dumps({"model": "mae_vit_debug"}))
    old = resolve_preprocessing(_stage(model={"name": "vit_debug", "init_from": str(tmp_path / "export")}))
    assert list(old.data.mean) == HALF and old.eval.interpolation == "bicubic"


def test_a_timm_folder_gives_its_pretrained_cfg(tmp_path):
    """A Hugging Face timm folder (model.safetensors + config.json): its pretrained_cfg's statistics."""
    folder = tmp_path / "vit_base_patch16_224.augreg_in21k"
    folder.mkdir()
    save_file({"cls_token": torch.zeros(1, 1, 8)}, str(folder / "model.safetensors"))
    pretrained = {
        "mean": [0.5, 0.5, 0.5],
        "std": [0.5, 0.5, 0.5],
        "interpolation": "bicubic",
        "crop_pct": 0.9,
    }
    (folder / "config.json").write_text(
        json.dumps({"architecture": "vit_base_patch16_224", "pretrained_cfg": pretrained})
    )
    cfg = resolve_preprocessing(_stage(model={"name": "mae_vit_debug", "init_from": str(folder)}))
    assert list(cfg.data.mean) == HALF and cfg.eval.interpolation == "bicubic"


def test_an_export_in_object_storage_is_read_with_one_small_get(s3, tmp_path):
    from data_prep.storage import Store

    model = create_model("vit_debug", img_size=32)
    recorded = {"mean": [0.2, 0.3, 0.4], "std": [0.3, 0.3, 0.3], "interpolation": "bilinear"}
    export_weights(model.state_dict(), "vit_debug", {"img_size": 32}, tmp_path / "export", 1, recorded)
    uri = s3("prep/export")
    for f in (tmp_path / "export").iterdir():
        Store(uri).upload(f, f.name)
    cfg = resolve_preprocessing(_stage(model={"name": "vit_debug", "init_from": uri}))
    assert list(cfg.data.mean) == [0.2, 0.3, 0.4] and cfg.eval.interpolation == "bilinear"


def test_mean_and_std_go_together_and_std_is_positive():
    with pytest.raises(ConfigError, match="data.mean and data.std go together"):
        _stage(data={"train": "/x", "mean": [0.5, 0.5, 0.5]})
    with pytest.raises(ConfigError, match=r"data.std: every channel's must be > 0"):
        _stage(data={"train": "/x", "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.0, 0.5]})
    with pytest.raises(ConfigError, match="interpolation"):
        _stage(eval={"interpolation": "nearest"})


def test_objectives_normalise_with_the_stages_statistics():
    model = create_model("vit_debug", img_size=32, num_classes=4)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    mean, std = (0.5, 0.25, 0.75), (0.5, 0.2, 0.1)
    x = build_objective(ObjectiveConfig(name="supervised_softmax"), mean, std).pixels(model, images)
    expected = (images.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(
        1, 3, 1, 1
    )
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "interpolation, pil_filter", [("bilinear", Image.BILINEAR), ("bicubic", Image.BICUBIC)]
)
def test_eval_resize_is_pils_filter(interpolation, pil_filter):
    """The eval crop's antialiased resize (torch's uint8 kernel) is PIL's BILINEAR or BICUBIC within one level."""
    rng = np.random.default_rng(0)
    img = Image.fromarray((rng.random((60, 80, 3)) * 255).astype(np.uint8)).resize((400, 300), Image.BILINEAR)
    ours = eval_tensor(img, 64, 1.0, interpolation).numpy().astype(int)
    box = _int_box(center_crop_box(400, 300, 64, 1.0), 400, 300)
    pil = np.asarray(img.crop(box).resize((64, 64), pil_filter)).transpose(2, 0, 1).astype(int)
    assert np.abs(ours - pil).max() <= 1
    other = (
        eval_tensor(img, 64, 1.0, "bicubic" if interpolation == "bilinear" else "bilinear")
        .numpy()
        .astype(int)
    )
    assert np.abs(ours - other).max() > 5  # the setting reaches the resize
