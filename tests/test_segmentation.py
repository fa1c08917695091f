"""Semantic segmentation (SETR): the model and its FLOPs, loading pretrained encoders, masks that follow
their image through the loader's crops and flips, the metrics, the config's refusals, and (2 ranks, real
DeepSpeed) training under ZeRO 0-3 from an MAE encoder, then the eval stage's mIoU and figure."""

import io
import json

import numpy as np
import pytest
import torch
from conftest import assert_loss_fell, counted_flops, ema_weights, history, torchrun, weights
from PIL import Image

from pipeline.config import ConfigError, validate_config
from pipeline.data.batching import MASK_IGNORE, BatchBuilder, decode_pair
from pipeline.data.transforms import _drafted, eval_pair, train_pair, train_tensor
from pipeline.eval.metrics import confusion_matrix, segmentation_scores
from pipeline.models import SETR, create_model
from pipeline.models.convert import CheckpointMismatch
from pipeline.models.flops import flops_per_image


@pytest.mark.unit
@pytest.mark.parametrize("decoder", ["naive", "pup"])
def test_setr_gives_per_pixel_logits_and_every_parameter_learns(decoder):
    torch.manual_seed(0)
    model = create_model(f"setr_{decoder}_vit_debug", num_classes=5, img_size=48)
    x = torch.randn(2, 3, 48, 48)
    logits = model(x)
    assert logits.shape == (2, 5, 48, 48)
    torch.nn.functional.cross_entropy(logits, torch.randint(0, 5, (2, 48, 48))).backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, no_grad
    assert not hasattr(model, "export_encoder")  # the whole model is exported: the decoder is the head


@pytest.mark.unit
@pytest.mark.parametrize(
    "name,overrides",
    [
        ("setr_naive_vit_debug", {}),
        ("setr_pup_vit_debug", {}),
        ("setr_pup_vit_debug", {"patch_size": 6, "pool": "gap"}),  # 3 rounds of x2 then a resize to 48
    ],
)
def test_setr_counts_its_own_forward(name, overrides):
    model = create_model(name, num_classes=3, img_size=48, **overrides).eval()
    assert flops_per_image(model) == counted_flops(model, torch.randn(1, 3, 48, 48))


@pytest.mark.unit
def test_setr_refuses_what_it_cannot_decode():
    with pytest.raises(ValueError, match="decoder must be one of"):
        SETR(decoder="fpn")
    with pytest.raises(ValueError, match="distillation token"):
        create_model("setr_pup_vit_debug", distilled=True)


@pytest.mark.unit
def test_setr_loads_a_vit_export_into_its_encoder_with_position_embeddings_resampled():
    torch.manual_seed(0)
    vit = create_model("vit_debug", num_classes=7, img_size=32)  # a classifier trained at 32 px
    for p in vit.parameters():
        torch.nn.init.normal_(p)
    setr = create_model("setr_pup_vit_debug", num_classes=4, img_size=48)
    decoder_before = {k: v.clone() for k, v in setr.state_dict().items() if not k.startswith("encoder.")}
    setr.load_pretrained(vit.state_dict(), init_head=False)
    enc = setr.encoder.state_dict()
    assert enc["pos_embed"].shape == (1, 1 + 36, 64)  # 6x6 grid at 48 px, from 4x4 at 32 px
    assert torch.equal(enc["pos_embed"][:, 0], vit.pos_embed[:, 0].detach())  # the class token's row is kept
    for k, v in vit.state_dict().items():
        if k != "pos_embed" and not k.startswith("head."):
            assert torch.equal(enc[k], v), k
    assert all(torch.equal(setr.state_dict()[k], v) for k, v in decoder_before.items())


@pytest.mark.unit
def test_setr_loads_its_own_export_whole_or_with_a_new_decoder():
    torch.manual_seed(0)
    trained = create_model("setr_naive_vit_debug", num_classes=4, img_size=32)
    for p in trained.parameters():
        torch.nn.init.normal_(p, std=0.1)
    state = trained.state_dict()
    x = torch.randn(1, 3, 32, 32)
    same = create_model("setr_naive_vit_debug", num_classes=4, img_size=32)
    same.load_pretrained(state, init_head=True)
    assert torch.equal(same.eval()(x), trained.eval()(x))
    other = create_model("setr_naive_vit_debug", num_classes=6, img_size=32)
    with pytest.raises(CheckpointMismatch, match="classifier.weight: export"):
        other.load_pretrained(state, init_head=True)
    with pytest.raises(KeyError, match="no SETR decoder to load"):  # a plain ViT export has no decoder
        other.load_pretrained(create_model("vit_debug", img_size=32).state_dict(), init_head=True)
    fresh = other.classifier.weight.clone()
    other.load_pretrained(state, init_head=False)  # new classes: the encoder only
    assert torch.equal(other.classifier.weight, fresh)
    assert torch.equal(other.encoder.pos_embed, trained.encoder.pos_embed)


@pytest.mark.unit
def test_layer_decay_reaches_the_encoder_blocks_and_the_decoder_is_the_head():
    from pipeline.models.param_groups import param_groups

    model = create_model("setr_pup_vit_debug", num_classes=3)  # 4 blocks
    scale = {id(p): g["lr_scale"] for g in param_groups(model, 0.05, layer_decay=0.5) for p in g["params"]}
    named = dict(model.named_parameters())
    assert scale[id(named["encoder.patch_embed.proj.weight"])] == 0.5**5
    assert scale[id(named["encoder.blocks.0.attn.qkv.weight"])] == 0.5**4
    assert scale[id(named["encoder.blocks.3.attn.qkv.weight"])] == 0.5**1
    assert scale[id(named["classifier.weight"])] == scale[id(named["decode_head.0.weight"])] == 1.0


# ---------------------------------------------------------------------- metrics


@pytest.mark.unit
def test_confusion_matrix_and_scores_by_hand():
    target = torch.tensor([[[0, 0, 1, 1], [2, 2, 2, MASK_IGNORE]]])  # [1, 2, 4]
    pred = torch.tensor([[[0, 1, 1, 1], [2, 2, 0, 0]]])
    conf = confusion_matrix(pred, target, 4, target != MASK_IGNORE)
    assert conf.tolist() == [[1, 1, 0, 0], [0, 2, 0, 0], [1, 0, 2, 0], [0, 0, 0, 0]]
    s = segmentation_scores(conf)
    # IoU: class 0 1/(2+2-1)=1/3, class 1 2/(2+3-2)=2/3, class 2 2/(3+2-2)=2/3, class 3 absent: None
    assert s["iou"][:3] == pytest.approx([1 / 3, 2 / 3, 2 / 3])
    assert s["iou"][3] is None
    assert s["miou"] == pytest.approx((1 / 3 + 2 / 3 + 2 / 3) / 3)
    assert s["pixel_accuracy"] == pytest.approx(5 / 7)
    assert s["mean_accuracy"] == pytest.approx((1 / 2 + 1 + 2 / 3) / 3)


# ---------------------------------------------------------------------- masks through the loader


def _coded(width: int, height: int, seed: int, block: int = 8) -> tuple[Image.Image, Image.Image]:
    """An image whose colour says its mask's class (class k: red 60k), in square blocks."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 4, size=(height // block + 1, width // block + 1))
    mask = np.kron(blocks, np.ones((block, block), dtype=np.int64))[:height, :width].astype(np.uint8)
    rgb = np.stack([mask * 60, np.zeros_like(mask), np.zeros_like(mask)], -1).astype(np.uint8)
    return Image.fromarray(rgb), Image.fromarray(mask, "L")


def _agreement(image: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of pixels whose colour decodes to their mask's class."""
    decoded = ((image[0].float() + 30) // 60).clamp(0, 3).long()
    return float((decoded == mask.long()).float().mean())


@pytest.mark.unit
def test_masks_follow_their_image_through_crops_and_flips():
    flips, agree, control = 0, [], []
    for seed in range(20):
        img, mask = _coded(64, 48, seed)
        rng = np.random.default_rng(seed)
        image, target = train_pair(img, mask, 32, rng, min_scale=0.2)
        assert image.shape == (3, 32, 32) and target.shape == (32, 32) and target.dtype == torch.uint8
        assert set(target.unique().tolist()) <= {0, 1, 2, 3}  # nearest neighbour: no blended classes
        agree.append(_agreement(image, target))
        control.append(_agreement(image, target.flip(-1)))  # a mask one flip off
        # The crop and flip are drawn as the image path draws them: the same rng gives the same image.
        assert torch.equal(train_tensor(img, 32, np.random.default_rng(seed), 0.2), image)
        unflipped = train_pair(img, mask, 32, np.random.default_rng(seed), 0.2, hflip=False)[1]
        flips += not torch.equal(unflipped, target)
    # Only block borders disagree (antialiased bilinear against nearest: measured 0.89-0.96); a mask one flip
    # off agrees by chance and by symmetric blocks (0.15-0.67, mean 0.35).
    assert min(agree) > 0.85 and np.mean(control) < 0.5
    assert all(a > c for a, c in zip(agree, control))
    assert 3 <= flips <= 17  # about half of them flipped, image and mask together
    image, target = eval_pair(*_coded(64, 48, 1), 32)
    assert _agreement(image, target) > 0.85


@pytest.mark.unit
def test_masks_stay_on_their_image_when_a_jpeg_decodes_at_reduced_scale():
    """A 500x375 JPEG cropped to 32 px decodes at 1/8 scale (63x47 pixels holding 62.5x46.875 of the image):
    the mask must be cropped where the decoded image's crop lies. Agreement is bounded by the blur at block
    borders, so the JPEG path is held to the lossless PNG path on the same content: measured within 0.003 to
    0.022 (mean 0.011); cropping the mask at the requested box and scaling by decoded size / original size,
    as before, was 0.012 to 0.037 (mean 0.023) behind."""
    gaps = []
    for seed in range(4):
        img, mask = _coded(500, 375, seed, block=50)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=95)
        jpeg = Image.open(io.BytesIO(buf.getvalue()))
        drafted = Image.open(io.BytesIO(buf.getvalue()))
        assert _drafted(drafted, (0, 0, 500, 375), 32)[2] == (0.125, 0.125)  # decoded at 1/8
        gaps.append(_agreement(*eval_pair(img, mask, 32, 1.0)) - _agreement(*eval_pair(jpeg, mask, 32, 1.0)))
    assert max(gaps) < 0.03 and np.mean(gaps) < 0.016, gaps


def _sample(img: Image.Image, mask: Image.Image | None, key="k1") -> dict:
    def png(i):
        buf = io.BytesIO()
        i.save(buf, format="PNG")
        return buf.getvalue()

    sample = {"__key__": key, "png": png(img), "json": b'{"labels": [0]}'}
    if mask is not None:
        sample["seg.png"] = png(mask)
    return sample


@pytest.mark.unit
def test_a_bad_mask_is_an_error_that_says_what_is_wrong():
    img, mask = _coded(40, 32, 0)

    def pair(i, m):
        return eval_pair(i, m, 16)

    image, target, labels = decode_pair(_sample(img, mask), True, 3, 4, pair)
    assert target.shape == (16, 16) and labels == [0]
    with pytest.raises(ValueError, match="no seg.png mask member"):
        decode_pair(_sample(img, None), True, 3, 4, pair)
    with pytest.raises(ValueError, match="mask seg.png is 20x32, the image 40x32"):
        decode_pair(_sample(img, mask.crop((0, 0, 20, 32))), True, 3, 4, pair)
    with pytest.raises(ValueError, match="has value 3, manifest.json lists 3 segmentation_classes"):
        decode_pair(_sample(img, mask), True, 3, 3, pair)
    with pytest.raises(ValueError, match="mode RGB, expected L or P"):
        decode_pair(_sample(img, img), True, 3, 4, pair)
    # VOC-style masks: a palette image of indices, 255 for void pixels, which count nowhere.
    void = np.asarray(mask).copy()
    void[:4] = MASK_IGNORE
    palette = Image.fromarray(void, "L").convert("P")
    assert palette.mode == "P"
    _, target, _ = decode_pair(_sample(img, palette), True, 3, 4, pair)
    assert (target == MASK_IGNORE).any() and set(target.unique().tolist()) <= {0, 1, 2, 3, MASK_IGNORE}


@pytest.mark.unit
def test_padding_slots_have_ignored_masks():
    builder = BatchBuilder(3, 8, 2, False, masks=True)
    builder.add(torch.zeros(3, 8, 8, dtype=torch.uint8), 1, "a", torch.ones(8, 8, dtype=torch.uint8))
    builder.pad([])
    batch = builder.take(valid=builder.valid)
    assert batch["mask"].shape == (3, 8, 8)
    assert (batch["mask"][0] == 1).all() and (batch["mask"][1:] == MASK_IGNORE).all()


# ---------------------------------------------------------------------- config


@pytest.mark.unit
def test_config_pairs_segmentation_with_setr_models_only():
    def cfg(**over):
        raw = {"name": "s", "data": {"train": "/tmp/x"}, "model": {"name": "setr_pup_vit_debug"}}
        raw.update({"objective": {"name": "segmentation"}, **over})
        return validate_config(raw)

    assert cfg().objective.name == "segmentation"
    with pytest.raises(ConfigError, match="objective segmentation needs a SETR model"):
        cfg(model={"name": "vit_debug"})
    with pytest.raises(ConfigError, match="is a segmentation model: set objective.name: segmentation"):
        cfg(objective={"name": "supervised_sigmoid"})
    with pytest.raises(ConfigError, match="no RandAugment"):
        cfg(data={"train": "/tmp/x", "randaugment": [2, 9]})
    with pytest.raises(ConfigError, match="needs model.init_head: true"):
        cfg(
            kind="eval",
            model={"name": "setr_pup_vit_debug", "init_from": "/x"},
            eval={"classification": False},
        )
    with pytest.raises(ConfigError, match="only with layout: true"):
        cfg(data={"train": "/tmp/x", "synthetic": {"num": 10}})
    assert cfg(data={"train": "/tmp/x", "synthetic": {"num": 10, "layout": True}}).data.synthetic.layout


# ---------------------------------------------------------------------- training and evaluation


@pytest.fixture(scope="module")
def layout_dataset(tmp_path_factory):
    """The layout corpus with masks: 160 images of 48x40 px in shards of 20, a fifth held out as val."""
    from data_prep.synthetic import layout_class_names, segmentation_class_names, synthetic_samples
    from data_prep.writer import write_dataset

    root = tmp_path_factory.mktemp("layout")
    samples = synthetic_samples(160, 0, seed=0, width=48, height=40, val_fraction=0.2, layout=True, objects=4)
    write_dataset(
        root, samples, layout_class_names(4), True, 20, segmentation_classes=segmentation_class_names(4)
    )
    return root


@pytest.mark.dist
@pytest.mark.slow
def test_setr_trains_from_an_mae_encoder_under_every_zero_stage_and_reports_miou(layout_dataset, tmp_path):
    torchrun(
        "tests/scripts/downstream.py", "segmentation", str(tmp_path), str(layout_dataset), "0", "1", "2", "3"
    )
    losses = {z: [v for _, v in history(tmp_path / f"seg_zero{z}")] for z in range(4)}
    assert len(losses[0]) == 30
    assert_loss_fell(losses[0], "segmentation ZeRO-0")
    for z in (1, 2, 3):  # the same fp32 model and batches: ZeRO partitions the work, not the result
        assert losses[z] == pytest.approx(losses[0], rel=2e-3), z  # reduction order: measured 3.4e-4
    # The MAE encoder was loaded (resampled from a 4x4 to a 6x6 grid), then fine-tuned.
    mae, seg = weights(tmp_path / "mae"), weights(tmp_path / "seg_zero3")
    assert seg["encoder.pos_embed"].shape == (1, 37, 64) and mae["pos_embed"].shape == (1, 17, 64)
    summary = json.loads((tmp_path / "seg_eval" / "eval.json").read_text())
    names = ["background", *[n for n in summary["iou_per_class"] if n != "background"]]
    assert list(summary["iou_per_class"]) == names and len(names) == 5
    manifest = json.loads((layout_dataset / "manifest.json").read_text())
    assert summary["eval_samples"] == manifest["totals"]["val"]
    metrics = summary["metrics"]
    # A model that calls every pixel background scores at most 1/5 (background's IoU, the others 0); 30 steps
    # from the MAE encoder measured 0.49 (pixel accuracy 0.88).
    assert 0.3 < metrics["eval/miou"] <= 1.0 and 0.0 <= metrics["eval/pixel_accuracy"] <= 1.0
    assert metrics["eval/miou"] == pytest.approx(
        np.mean([v for v in summary["iou_per_class"].values() if v is not None])
    )
    assert dict(history(tmp_path / "seg_eval", "eval/miou")) == {30: pytest.approx(metrics["eval/miou"])}
    # The export's weight EMA (decay 0.8) was evaluated too: other weights, the same metrics.
    assert {"eval_ema/miou", "eval_ema/pixel_accuracy", "eval_ema/mean_accuracy"} <= set(metrics)
    assert 0.0 < metrics["eval_ema/miou"] <= 1.0 and summary["ema"]["eval_samples"] == summary["eval_samples"]
    assert dict(history(tmp_path / "seg_eval", "eval_ema/miou")) == {
        30: pytest.approx(metrics["eval_ema/miou"])
    }
    mae_ema = ema_weights(tmp_path / "mae")  # MAE's EMA exported as its encoder, as its weights are
    assert mae_ema.keys() == mae.keys() and any(not torch.equal(mae_ema[k], mae[k]) for k in mae)
    figure = tmp_path / "seg_eval" / "figures" / "segmentation_masks.png"
    assert figure.stat().st_size > 10_000 and Image.open(figure).size[1] > Image.open(figure).size[0]


@pytest.mark.unit
def test_a_dataset_without_masks_is_refused_before_anything_starts(tmp_path):
    from data_prep.synthetic import class_names, synthetic_samples
    from data_prep.writer import write_dataset
    from pipeline.config import input_problems
    from pipeline.data.sources import dataset_info

    plain = tmp_path / "plain"
    write_dataset(plain, synthetic_samples(8, 3, width=24, height=20), class_names(3), True, 8)
    raw = {"name": "s", "data": {"train": str(plain)}, "model": {"name": "setr_naive_vit_debug"}}
    cfg = validate_config({**raw, "objective": {"name": "segmentation"}})
    (problem,) = input_problems(cfg)
    assert str(plain) in problem and "needs per-pixel masks" in problem and "segmentation_classes" in problem
    with pytest.raises(ValueError, match="per-pixel masks were asked for"):
        dataset_info(plain, "train").mask_classes()
