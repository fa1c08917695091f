"""Masked patch prediction, the ViT paper's self-supervision (Dosovitskiy et al. 2020, Appendix B.1.2).

Half of the patch embeddings are corrupted, BERT-style: of those, 80% become a learned [mask] embedding,
10% another patch's embedding from the same image, 10% stay as they are. From each corrupted patch's
output token a linear head predicts its 3-bit mean colour (8 levels per channel, 512 classes).

    model = create_model("mpp_vit_b16")
    targets = mean_colour_classes(images_uint8, patch_size=16)            # [B, N]
    loss, logits, corrupted = model(images_normalized, targets, generator=g)

Tests: `.venv/bin/python -m pytest tests/test_mae.py -q`.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.macs import linear_macs
from pipeline.models.registry import register
from pipeline.models.vit import VIT_SHAPES, VisionTransformer

# What happened to each patch, as returned by `corrupt_patches`.
CLEAN, MASKED, SWAPPED, KEPT = 0, 1, 2, 3
MASK_TOKEN_PROB = 0.8  # of the corrupted patches: replaced by the [mask] embedding
SWAP_PROB = 0.1  # replaced by another patch of the same image; the remaining 10% are kept as they are


def mean_colour_classes(images: torch.Tensor, patch_size: int, num_bins: int = 8) -> torch.Tensor:
    """Each patch's mean colour as one class: images [B, 3, H, W] in [0, 255] -> [B, N] long.

    Each channel's mean is quantised to `num_bins` levels (value * 8 // 256 for 3 bits), and the
    classes are combined as r * 64 + g * 8 + b. Patches are numbered row-major, as `PatchEmbed` does.
    """
    B, C, H, W = images.shape
    p = patch_size
    if C != 3:
        raise ValueError(f"mean_colour_classes expects RGB images [B, 3, H, W], got {C} channels")
    if H % p or W % p:
        raise ValueError(f"image size {H}x{W} is not a multiple of the patch size {p}")
    # Integer sums and integer division: exact, and no float64 (slow on GPUs). floor(mean * bins / 256).
    sums = images.to(torch.int64).reshape(B, C, H // p, p, W // p, p).sum(dim=(3, 5))  # [B, 3, h, w]
    bins = torch.div(sums * num_bins, p * p * 256, rounding_mode="floor").clamp_(0, num_bins - 1)
    r, g, b = bins.flatten(2).unbind(1)  # [B, N] each
    return (r * num_bins + g) * num_bins + b  # [B, N], r*64 + g*8 + b for 8 bins


def corrupt_patches(
    x: torch.Tensor, mask_token: torch.Tensor, corrupt_ratio: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrupt exactly `int(N * corrupt_ratio)` patch embeddings per image.

    x [B, N, D], mask_token [1, 1, D] -> (corrupted x [B, N, D], what happened [B, N] long: CLEAN,
    MASKED, SWAPPED or KEPT). All randomness comes from `generator`.
    """
    if not 0.0 < corrupt_ratio <= 1.0:
        raise ValueError(f"corrupt_ratio must be in (0, 1], got {corrupt_ratio}")
    B, N, D = x.shape
    if N < 2:
        raise ValueError(f"masked patch prediction needs at least 2 patches per image, got {N}")
    # Draw on the generator's own device (a CPU generator cannot fill a CUDA tensor), then move.
    device = generator.device if generator is not None else x.device
    noise = torch.rand(B, N, generator=generator, device=device)
    choice = torch.rand(B, N, generator=generator, device=device)  # picks mask / swap / keep
    other = torch.randint(0, N - 1, (B, N), generator=generator, device=device)
    noise, choice, other = noise.to(x.device), choice.to(x.device), other.to(x.device)

    rank = noise.argsort(dim=1).argsort(dim=1)  # [B, N], each patch's place in a random order
    corrupted = rank < int(N * corrupt_ratio)  # exactly that many per image
    # torch.where, not boolean-mask assignment: that would read the mask's size to the host (a GPU sync).
    how = torch.where(
        choice < MASK_TOKEN_PROB,
        MASKED,
        torch.where(choice < MASK_TOKEN_PROB + SWAP_PROB, SWAPPED, KEPT),
    )
    what = torch.where(corrupted, how, CLEAN)  # [B, N] long

    # Skip the patch itself: uniform over the N - 1 others.
    other = other + (other >= torch.arange(N, device=x.device))  # [B, N]
    swapped = torch.gather(x, 1, other[..., None].expand(-1, -1, D))  # [B, N, D], from the clean x
    out = torch.where((what == MASKED)[..., None], mask_token.to(x.dtype), x)
    out = torch.where((what == SWAPPED)[..., None], swapped, out)
    return out, what


class MaskedPatchPredictionViT(nn.Module):
    """A `VisionTransformer` pretrained by predicting the 3-bit mean colour of corrupted patches.

    Keyword arguments other than `corrupt_ratio`, `num_classes` and `head_bias_init` build the ViT.
    `num_classes` and `head_bias_init` are kept for the classifier `export_encoder()` attaches; the
    ViT's own classifier is unused in pretraining and dropped, so no parameter sits without a gradient.
    """

    def __init__(
        self, corrupt_ratio: float = 0.5, num_classes: int = 1000, head_bias_init: float = 0.0, **vit_kwargs
    ):
        super().__init__()
        if not 0.0 < corrupt_ratio <= 1.0:
            raise ValueError(f"corrupt_ratio must be in (0, 1], got {corrupt_ratio}")
        if vit_kwargs.get("distilled"):
            raise ValueError("masked patch prediction has no use for a distillation token (distilled=True)")
        self.corrupt_ratio = corrupt_ratio
        self.export_num_classes, self.export_head_bias_init = num_classes, head_bias_init
        self.encoder = VisionTransformer(num_classes=num_classes, head_bias_init=head_bias_init, **vit_kwargs)
        self.encoder.head = nn.Identity()
        self.num_bins = 8  # per channel: 3 bits
        D = self.encoder.embed_dim
        self.mask_token = nn.Parameter(torch.zeros(1, 1, D))  # in the patch-embedding space
        self.head = nn.Linear(D, self.num_bins**3)  # per-patch colour logits
        nn.init.normal_(self.mask_token, std=0.02)
        nn.init.trunc_normal_(
            self.head.weight, std=0.02
        )  # not zero: the encoder must get a gradient at step 0
        nn.init.zeros_(self.head.bias)

    @property
    def patch_size(self) -> int:
        return self.encoder.patch_embed.patch_size

    def forward(
        self, images: torch.Tensor, targets: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """images [B, C, H, W] normalised, targets [B, N] long (`mean_colour_classes`) ->
        (loss, logits [B, N, 512], corrupted [B, N] bool); the loss covers corrupted patches only."""
        enc = self.encoder
        x = enc.patch_embed(images)  # [B, N, D]
        if targets.shape != x.shape[:2]:
            raise ValueError(f"targets must be [B, N] = {tuple(x.shape[:2])}, got {tuple(targets.shape)}")
        # Corrupt before adding position: a swapped patch brings its content, not its position.
        x, what = corrupt_patches(x, self.mask_token, self.corrupt_ratio, generator)
        pos = enc.patch_pos_embed()
        if pos is not None:  # a fixed sincos table is a buffer, fp32 under bf16 weights: cast as vit.py does
            x = x + pos.to(x.dtype)
        prefix = enc.prefix_tokens(x.shape[0])
        if prefix is not None:
            x = torch.cat([prefix, x], dim=1)  # [B, P+N, D]
        x = enc.norm(enc.forward_blocks(x))
        logits = self.head(x[:, enc.num_prefix_tokens :])  # [B, N, 512]
        corrupted = what != CLEAN  # [B, N]
        # A weighted mean over every patch, not logits[corrupted]: boolean indexing syncs with the host.
        per_patch = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        weight = corrupted.flatten().float()
        loss = (per_patch * weight).sum() / weight.sum().clamp_min(1.0)
        return loss, logits, corrupted

    def forward_macs(self, img_size: int | None = None, mask_ratio: float | None = None) -> int:
        """Forward multiply-accumulates for one image: the encoder on every token, the head on every patch."""
        if mask_ratio:
            raise ValueError("masked patch prediction corrupts patches, it does not drop them: no mask_ratio")
        macs, n = self.encoder.encoder_macs(img_size)
        return macs + linear_macs(self.head, n)

    def export_encoder(self, num_classes: int | None = None) -> VisionTransformer:
        """A copy of the pretrained ViT with a fresh zero-initialised classifier, ready to fine-tune."""
        vit = copy.deepcopy(self.encoder)
        vit.num_classes = self.export_num_classes if num_classes is None else num_classes
        param = next(vit.parameters())
        vit.head = nn.Linear(vit.embed_dim, vit.num_classes).to(device=param.device, dtype=param.dtype)
        nn.init.zeros_(vit.head.weight)  # as VisionTransformer does
        nn.init.constant_(vit.head.bias, self.export_head_bias_init)
        return vit


# ---------------------------------------------------------------------- registered variants


@register
def mpp_vit_debug(**kw) -> MaskedPatchPredictionViT:
    """Tiny masked-patch-prediction ViT for tests: 32px images, 8px patches, 4 blocks of width 64."""
    return MaskedPatchPredictionViT(**{**VIT_SHAPES["debug"], **kw})


@register
def mpp_vit_b16(**kw) -> MaskedPatchPredictionViT:
    """The paper's setting: ViT-B/16."""
    return MaskedPatchPredictionViT(**{**VIT_SHAPES["b16"], **kw})


@register
def mpp_vit_l16(**kw) -> MaskedPatchPredictionViT:
    return MaskedPatchPredictionViT(**{**VIT_SHAPES["l16"], **kw})


__all__ = ["MaskedPatchPredictionViT", "corrupt_patches", "mean_colour_classes"]
