"""SimMIM (Xie et al. 2022, microsoft/SimMIM): masked image modelling for the hierarchical families.

MAE drops the masked patches, which only a plain ViT can do. SimMIM keeps every token: the masked
ones are replaced by a learned mask token right after the first token embedding, the whole backbone
runs, and a one-layer decoder (1x1 convolution + pixel shuffle) regresses the raw pixels; the loss is
L1 on the masked pixels only. Any family whose class sets `supports_mim = True` and offers
`forward_mim(x, mask)` can be wrapped (Swin, CvT, TNT); LeViT says why it cannot.

    model = create_model("simmim_swin_t", img_size=192)
    loss, reconstruction, mask = model(imgs, generator=torch.Generator().manual_seed(seed))
    encoder = model.export_encoder()          # the plain Swin that fine-tuning starts from

Masks are drawn on a coarse grid of `mask_patch_size` pixels (32 in the paper; 60% masked) and
upsampled to the encoder's token grid (`mim_patch_size` pixels per token).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import pipeline.models.cvt  # noqa: F401  (registers the encoders SimMIM builds by name)
import pipeline.models.swin  # noqa: F401
import pipeline.models.tnt  # noqa: F401
from pipeline.models.macs import reject_mask_ratio
from pipeline.models.registry import create_model, register


class SimMIM(nn.Module):
    def __init__(
        self,
        encoder: str,
        img_size: int = 224,
        in_chans: int = 3,
        mask_ratio: float = 0.6,
        mask_patch_size: int = 32,
        num_classes: int = 1000,
        head_bias_init: float = 0.0,
        **encoder_kwargs,
    ):
        super().__init__()
        if not 0.0 < mask_ratio < 1.0:
            raise ValueError(f"mask_ratio must be in (0, 1), got {mask_ratio}")
        # The classifier is built at export time (fine-tuning gets a new head); pretraining has none.
        self.encoder = create_model(
            encoder, img_size=img_size, in_chans=in_chans, num_classes=0, mask_token=True, **encoder_kwargs
        )
        if not getattr(self.encoder, "supports_mim", False):
            raise ValueError(
                f"{encoder} ({type(self.encoder).__name__}) does not support masked image "
                f"modelling: see the docstring of {type(self.encoder).__module__}"
            )
        token, stride = self.encoder.mim_patch_size, self.encoder.mim_stride
        if img_size % mask_patch_size or mask_patch_size % token:
            raise ValueError(
                f"mask_patch_size {mask_patch_size} must divide img_size {img_size} and be a "
                f"multiple of {encoder}'s token size {token}"
            )
        self.encoder_name, self.encoder_kwargs = encoder, dict(encoder_kwargs)
        self.img_size, self.in_chans = img_size, in_chans
        self.mask_ratio, self.mask_patch_size = mask_ratio, mask_patch_size
        self.export_num_classes, self.export_head_bias_init = num_classes, head_bias_init
        self.patch_size = token  # pixels per token of the mask the encoder sees
        self.decoder = nn.Sequential(
            nn.Conv2d(self.encoder.num_features, stride * stride * in_chans, kernel_size=1),
            nn.PixelShuffle(stride),
        )

    def random_mask(self, batch: int, device: torch.device, generator: torch.Generator | None = None):
        """[B, H/token, W/token] bool, True = masked: ceil(ratio * cells) coarse cells per image, upsampled."""
        side = self.img_size // self.mask_patch_size
        cells = side * side
        count = math.ceil(cells * self.mask_ratio)
        # Drawn on the generator's own device, then moved (as MAE's): a CPU generator cannot fill a CUDA tensor.
        where = generator.device if generator is not None else device
        noise = torch.rand(batch, cells, device=where, generator=generator).to(device)
        rank = noise.argsort(dim=1).argsort(dim=1)  # each cell's position in a random order
        coarse = (rank < count).reshape(batch, side, side)
        scale = self.mask_patch_size // self.patch_size
        return coarse.repeat_interleave(scale, 1).repeat_interleave(scale, 2)

    def forward(
        self, imgs: torch.Tensor, mask_ratio: float | None = None, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (loss, reconstruction [B, C, H, W], mask [B, H/token, W/token] with True = masked)."""
        if mask_ratio is not None and mask_ratio != self.mask_ratio:
            raise ValueError("SimMIM's mask ratio is fixed at construction (mask_ratio=...)")
        if imgs.shape[-2:] != (self.img_size, self.img_size):
            raise ValueError(f"SimMIM was built for {self.img_size}px, got {tuple(imgs.shape[-2:])}")
        mask = self.random_mask(imgs.shape[0], imgs.device, generator)
        # The encoder reads the images in its weights' dtype; the L1 target is the images as given (fp32 from
        # the objective, as MAE's).
        dtype = self.decoder[0].weight.dtype
        rec = self.decoder(self.encoder.forward_mim(imgs.to(dtype), mask))  # [B, C, H, W]
        pixels = mask.repeat_interleave(self.patch_size, 1).repeat_interleave(self.patch_size, 2)
        weight = pixels.unsqueeze(1).float()  # [B, 1, H, W]; fp32: a bf16 sum of ~1e6 pixels is 0.4% off
        l1 = F.l1_loss(rec.float(), imgs.float(), reduction="none")
        loss = (l1 * weight).sum() / (weight.sum() * self.in_chans + 1e-5)
        return loss, rec, mask

    def forward_macs(self, img_size: int | None = None, mask_ratio: float | None = None) -> int:
        """The encoder on every token (masked ones replaced, none dropped), then the 1x1 decoder conv."""
        reject_mask_ratio(self, mask_ratio)
        size = img_size or self.img_size
        stride = self.encoder.mim_stride
        decoder = self.decoder[0]
        tokens = (size // stride) ** 2
        return self.encoder.forward_macs(size) + tokens * decoder.in_channels * decoder.out_channels

    def export_encoder(self, num_classes: int | None = None, **overrides) -> nn.Module:
        """The plain encoder (no mask token) with the pretrained weights and a new zero-initialised head."""
        kwargs = dict(
            self.encoder_kwargs,
            img_size=self.img_size,
            in_chans=self.in_chans,
            num_classes=self.export_num_classes if num_classes is None else num_classes,
            head_bias_init=self.export_head_bias_init,
        )
        plain = create_model(self.encoder_name, **{**kwargs, **overrides})
        state = {
            k: v.detach().clone()
            for k, v in self.encoder.state_dict().items()
            if not k.startswith("mask_token")
        }
        missing, unexpected = plain.load_state_dict(state, strict=False)
        if unexpected or any(not k.startswith(("head.", "head_dist.")) for k in missing):
            raise RuntimeError(f"export_encoder: missing {missing}, unexpected {unexpected}")
        param = next(self.encoder.parameters())
        return plain.to(device=param.device, dtype=param.dtype)


# SimMIM for every family that supports it; the debug encoders mask 8px cells of 32px images.
_ENCODERS = (
    "swin_debug",
    "swin_t",
    "swin_s",
    "swin_b",
    "cvt_debug",
    "cvt_13",
    "cvt_21",
    "tnt_debug",
    "tnt_s16",
    "tnt_b16",
)


def _simmim_factory(encoder: str):
    debug = encoder.endswith("_debug")

    def build(**kw) -> SimMIM:
        defaults = {"img_size": 32, "mask_patch_size": 8} if debug else {}
        return SimMIM(encoder, **{**defaults, **kw})

    build.__name__ = f"simmim_{encoder}"
    build.__doc__ = f"SimMIM pretraining of {encoder}."
    return build


for _name in _ENCODERS:
    register(_simmim_factory(_name))

__all__ = ["SimMIM"]
