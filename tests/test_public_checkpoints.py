"""Public checkpoints by path: timm, DeiT and MAE files and folders (.pth, .bin, .safetensors), checked
against model.name through the published-name map before any tensor is compared."""

import argparse
import json

import pytest
import torch
from safetensors.torch import save_file

from pipeline.config import ModelConfig
from pipeline.models import create_model
from pipeline.models.convert import check_published_architecture, export_timm_state_dict, published_name
from pipeline.stage import init_weights
from pipeline.train.export import export_weights

pytestmark = pytest.mark.unit


def _same_except(a: torch.nn.Module, b: torch.nn.Module, skip: tuple[str, ...]) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa if not k.startswith(skip))


def test_a_deit_pth_loads_into_its_model_at_another_resolution(tmp_path):
    torch.manual_seed(0)
    public = create_model("vit_ti16", img_size=224, num_classes=10)
    path = tmp_path / "deit_tiny_patch16_224-a1311bcf.pth"
    torch.save({"model": export_timm_state_dict(public)}, path)  # as DeiT publishes it
    ours = create_model("vit_ti16", img_size=32, num_classes=10)
    init_weights(ours, path, init_head=True, model_name="vit_ti16")
    assert _same_except(ours, public, ("pos_embed",))
    assert ours.state_dict()["pos_embed"].shape[1] == 1 + 2 * 2  # 14 x 14 resampled to 2 x 2
    # a new head for another class count (init_head false): the encoder only
    fresh = create_model("vit_ti16", img_size=32, num_classes=3)
    init_weights(fresh, path, init_head=False, model_name="vit_ti16")
    assert _same_except(fresh, public, ("pos_embed", "head."))

    with pytest.raises(ValueError, match=r"deit_tiny_patch16 \(our vit_ti16\), but model.name is vit_s16"):
        init_weights(create_model("vit_s16", img_size=32), path, init_head=False, model_name="vit_s16")


class Code:
    """Any class of ours: unpickling it imports this module, which weights_only refuses."""


def test_an_mae_training_checkpoint_loads_its_encoder(tmp_path):
    """MAE's checkpoint-N.pth: {"model", "optimizer", "args": argparse.Namespace, ...}; its decoder and mask
    token are dropped, its encoder fills the ViT; nothing else in the file runs."""
    torch.manual_seed(0)
    mae = create_model("mae_vit_debug")
    path = tmp_path / "checkpoint-799.pth"
    # MAE's layout: the encoder's keys on top (pos_embed the fixed sin-cos table), the decoder's beside them
    decoder = {k: v for k, v in mae.state_dict().items() if not k.startswith("encoder.")}
    layout = {**mae.export_encoder().state_dict(), **decoder}
    assert any(k.startswith("decoder_") for k in layout) and "mask_token" in layout
    torch.save({"model": layout, "epoch": 799, "args": argparse.Namespace(blr=1.5e-4)}, path)
    vit = create_model("vit_debug", num_classes=4)
    init_weights(vit, path, init_head=False, model_name="vit_debug")
    assert all(torch.equal(v, layout[k]) for k, v in vit.state_dict().items() if not k.startswith("head."))

    bad = (
        tmp_path / "evil.pth"
    )  # a pickle that would import and call code on load is refused, naming the file
    torch.save({"model": Code()}, bad)
    with pytest.raises(ValueError, match=r"evil.pth: not a PyTorch state dict that loads without code"):
        init_weights(vit, bad, init_head=False, model_name="vit_debug")


def test_a_timm_folder_or_bin_loads_and_names_its_architecture(tmp_path):
    torch.manual_seed(0)
    public = create_model("vit_ti16", img_size=224, num_classes=10)
    folder = tmp_path / "vit_tiny_patch16_224.augreg_in21k_ft_in1k"  # a Hugging Face hub snapshot
    folder.mkdir()
    save_file(export_timm_state_dict(public), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        json.dumps({"architecture": "vit_tiny_patch16_224", "num_classes": 10})
    )
    ours = create_model("vit_ti16", img_size=224, num_classes=10)
    init_weights(ours, folder, init_head=True, model_name="vit_ti16")
    assert _same_except(ours, public, ())
    with pytest.raises(ValueError, match="vit_tiny_patch16 .* model.name is mae_vit_b16"):
        check_published_architecture(str(folder), "mae_vit_b16")

    binary = tmp_path / "renamed"  # timm's pytorch_model.bin: named by its config.json only
    binary.mkdir()
    torch.save(export_timm_state_dict(public), binary / "pytorch_model.bin")
    (binary / "config.json").write_text(json.dumps({"architecture": "vit_tiny_patch16_224"}))
    again = create_model("vit_ti16", img_size=224, num_classes=10)
    init_weights(again, binary, init_head=True, model_name="vit_ti16")
    assert _same_except(again, public, ())
    assert published_name(str(binary)) == "vit_tiny_patch16"


@pytest.mark.parametrize(
    "path, published",
    [
        ("/w/mae_pretrain_vit_base.pth", "mae_pretrain_vit_base"),
        ("/w/deit_base_distilled_patch16_224-df68dfff.pth", "deit_base_distilled_patch16"),
        ("/w/deit_base_patch16_384-8de9b5d1.pth", "deit_base_patch16"),
        ("/w/vit_large_patch16_224.augreg_in21k/model.safetensors", "vit_large_patch16"),
        ("/runs/pretrain/export", None),  # ours: no published name, no check
        ("/w/checkpoint-799.pth", None),
    ],
)
def test_published_names(path, published):
    assert published_name(path) == published


def test_wrappers_take_their_encoders_checkpoint_and_timm_names_are_model_names(tmp_path):
    for model in ("vit_b16", "mae_vit_b16", "setr_pup_vit_b16", "detr_vit_b16", "mpp_vit_b16"):
        check_published_architecture("/w/mae_pretrain_vit_base.pth", model)
    with pytest.raises(ValueError, match="set model.name: vit_b16"):
        check_published_architecture("/w/mae_pretrain_vit_base.pth", "vit_l16")
    assert (
        ModelConfig(name="vit_base_patch16_384").name,
        ModelConfig(name="vit_base_patch16_384").img_size,
    ) == (
        "vit_b16",
        384,
    )
    assert ModelConfig(name="deit_small_patch16_224", img_size=96).img_size == 96  # img_size as set
    # an export names its model as timm does, at the resolution it was trained at
    model = create_model("vit_ti16", img_size=64)
    export_weights(model.state_dict(), "vit_ti16", {"img_size": 64}, tmp_path / "export", 1)
    assert json.loads((tmp_path / "export/model.json").read_text())["timm_name"] == "vit_tiny_patch16_64"
