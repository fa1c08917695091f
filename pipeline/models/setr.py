"""SETR (Zheng et al. 2021, "Rethinking Semantic Segmentation from a Sequence-to-Sequence Perspective"):
a plain ViT encoder whose patch tokens, laid back on their grid, are decoded to per-pixel class logits.

    model = create_model("setr_pup_vit_b16", num_classes=21, img_size=512)
    logits = model(images)                     # [B, 3, H, W] -> [B, num_classes, H, W]

Two decoders, as in the paper:
- `naive`: 1x1 conv to `decoder_dim`, norm, ReLU, 1x1 conv to the classes, one bilinear upsampling to the
  input size;
- `pup` (progressive upsampling): ceil(log2(patch)) rounds of 3x3 conv, norm, ReLU and x2 bilinear
  upsampling (4 rounds for 16 px patches), then a 1x1 conv to the classes (and a last resize where the
  patch is not a power of two, e.g. 14).
Both use GroupNorm where the paper uses synchronised BatchNorm: it does not depend on the per-rank batch
and has nothing to synchronise across ranks, so ZeRO 0-3 and any world size train the same model.

Every plain ViT size is registered (`setr_naive_vit_debug` ... `setr_pup_vit_G14`); any ViT option
(pos_embed, pool, drop_path_rate, ...) passes through to the encoder. Pretrained weights load into the
encoder from any ViT export (supervised, or MAE / masked-patch-prediction encoders) with position
embeddings resampled to the segmentation resolution (`load_pretrained`, used by `init_from`).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.convert import load_encoder_export
from pipeline.models.registry import register
from pipeline.models.vit import VIT_SHAPES, VisionTransformer

DECODERS = ("naive", "pup")


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32 if channels % 32 == 0 else 1, channels)


class SETR(nn.Module):
    def __init__(
        self,
        decoder: Literal["naive", "pup"] = "pup",
        num_classes: int = 2,
        decoder_dim: int = 256,
        img_size: int = 224,
        head_bias_init: float = 0.0,
        **encoder_kwargs,
    ):
        super().__init__()
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
        if encoder_kwargs.get("distilled"):
            raise ValueError(
                "SETR decodes patch tokens: a distillation token has no use here (distilled=False)"
            )
        if encoder_kwargs.get("hybrid_layers"):
            raise ValueError("SETR here takes plain ViT encoders (no hybrid_layers)")
        if encoder_kwargs.get("patch_dropout"):
            raise ValueError("SETR decodes every patch: patch_dropout must be 0")
        self.encoder = VisionTransformer(img_size=img_size, num_classes=1, **encoder_kwargs)
        self.encoder.head = nn.Identity()  # the decoder is the head; loading drops a classifier's head
        self.decoder, self.num_classes, self.decoder_dim = decoder, num_classes, decoder_dim
        self.patch_size = self.encoder.patch_embed.patch_size
        d = self.encoder.embed_dim
        if decoder == "naive":
            self.decode_head = nn.Sequential(
                nn.Conv2d(d, decoder_dim, 1), _norm(decoder_dim), nn.ReLU(inplace=True)
            )
        else:
            rounds = max(1, math.ceil(math.log2(self.patch_size)))
            layers: list[nn.Module] = []
            for i in range(rounds):
                layers += [
                    nn.Conv2d(d if i == 0 else decoder_dim, decoder_dim, 3, padding=1),
                    _norm(decoder_dim),
                    nn.ReLU(inplace=True),
                    nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                ]
            self.decode_head = nn.Sequential(*layers)
        self.classifier = nn.Conv2d(decoder_dim, num_classes, 1)
        nn.init.constant_(self.classifier.bias, head_bias_init)

    def patch_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] -> the encoder's normalised patch tokens on their grid [B, D, H/p, W/p]."""
        enc = self.encoder
        h, w = x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size
        tokens = enc.forward_features(x)[:, enc.num_prefix_tokens :]  # [B, N, D]
        tokens = enc.fc_norm(tokens)  # average-pooling ViTs normalise after pooling: here, per token
        return tokens.transpose(1, 2).reshape(x.shape[0], -1, h, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] -> per-pixel class logits [B, num_classes, H, W]."""
        features = self.decode_head(self.patch_features(x))
        # The classifier at its weights' precision, outside autocast: an evaluation (fp32 weights, bf16
        # autocast) would otherwise take the argmax of bf16 logits, whose ties go to the lowest class.
        with torch.autocast(x.device.type, enabled=False):
            y = self.classifier(features.to(self.classifier.weight.dtype))
        if y.shape[-2:] != x.shape[-2:]:
            # In fp32: on CUDA the bilinear backward sums each low-resolution pixel's gradient with atomic
            # adds in the tensor's dtype, about (2p)^2 of them at the naive decoder's x p (1,024 at p 16):
            # in bf16 that lost a large part of the sum.
            y = F.interpolate(y.float(), size=x.shape[-2:], mode="bilinear", align_corners=False)
        return y.float()  # per-pixel logits in fp32 from either decoder, as the objective and metrics read

    # ------------------------------------------------------------------ FLOPs

    def forward_macs(self, img_size: int | None = None, mask_ratio: float | None = None) -> int:
        """Forward multiply-accumulates for one image: the encoder, then the decoder's convolutions at the
        resolution each runs at (upsampling and norms are not counted, as torch's counter does not)."""
        if mask_ratio:
            raise ValueError("SETR decodes every patch: no mask_ratio")
        macs, n = self.encoder.encoder_macs(img_size)
        side = math.isqrt(n)
        h = w = side
        for layer in self.decode_head:
            if isinstance(layer, nn.Conv2d):
                k = layer.kernel_size[0] * layer.kernel_size[1]
                macs += layer.in_channels * layer.out_channels * k * h * w
            elif isinstance(layer, nn.Upsample):
                h, w = 2 * h, 2 * w
        return macs + self.classifier.in_channels * self.num_classes * h * w

    # ------------------------------------------------------------------ weights

    def load_pretrained(self, state: dict[str, torch.Tensor], init_head: bool) -> None:
        """Load an export: a SETR's (encoder and, with `init_head`, decoder), or any plain ViT's into the
        encoder alone (supervised, MAE or masked-patch-prediction encoders). Position embeddings are
        resampled to this model's grid; a classifier head in the export is left out."""
        load_encoder_export(self, state, init_head, "SETR decoder")


def _register(decoder: str, shape: str) -> None:
    name = f"setr_{decoder}_vit_{shape}"
    defaults = {**VIT_SHAPES[shape], "decoder": decoder}
    if shape == "debug":
        defaults["decoder_dim"] = 64

    def build(**kw) -> SETR:
        return SETR(**{**defaults, **kw})

    build.__name__ = name
    build.__doc__ = f"SETR-{decoder.upper() if decoder == 'pup' else 'Naive'} on ViT {shape}."
    register(build)


for _decoder in DECODERS:
    for _shape in VIT_SHAPES:
        _register(_decoder, _shape)

__all__ = ["DECODERS", "SETR"]
