"""Masked autoencoders (He et al. 2021, facebookresearch/mae `models_mae.py`), single-device.

The encoder is a plain `VisionTransformer` that sees only the visible 25% of patches; a light decoder
fills in mask tokens and regresses the pixels of the removed patches. After pretraining,
`export_encoder()` gives the ViT that MAE fine-tuning starts from.

    model = create_model("mae_vit_b16", norm_pix_loss=True)
    loss, pred, mask = model(imgs, generator=torch.Generator().manual_seed(seed))

Tests: `.venv/bin/python -m pytest tests/test_mae.py -q`.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.models.layers import Block, checkpoints_block
from pipeline.models.macs import kept_patches, linear_macs
from pipeline.models.pos_embed import sincos_2d
from pipeline.models.registry import register
from pipeline.models.vit import VIT_SHAPES, VisionTransformer


def patchify(imgs: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Images [B, C, H, W] -> patches [B, N, p*p*C], row-major over the grid, pixels (p, q, c) inside a patch."""
    B, C, H, W = imgs.shape
    p = patch_size
    if H % p or W % p:
        raise ValueError(f"image size {H}x{W} is not a multiple of the patch size {p}")
    h, w = H // p, W // p
    x = imgs.reshape(B, C, h, p, w, p)
    x = torch.einsum("nchpwq->nhwpqc", x)  # [B, h, w, p, p, C]
    return x.reshape(B, h * w, p * p * C)  # [B, N, p*p*C]


def unpatchify(
    x: torch.Tensor, patch_size: int, in_chans: int = 3, grid: tuple[int, int] | None = None
) -> torch.Tensor:
    """Patches [B, N, p*p*C] -> images [B, C, H, W]; the inverse of `patchify` (square grid unless given)."""
    B, N, _ = x.shape
    p = patch_size
    if grid is None:
        side = int(round(N**0.5))
        if side * side != N:
            raise ValueError(f"cannot infer a square grid from {N} patches; pass grid")
        grid = (side, side)
    h, w = grid
    x = x.reshape(B, h, w, p, p, in_chans)
    x = torch.einsum("nhwpqc->nchpwq", x)  # [B, C, h, p, w, p]
    return x.reshape(B, in_chans, h * p, w * p)


def random_masking(
    x: torch.Tensor, mask_ratio: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep a random `int(N * (1 - mask_ratio))` tokens per sample by sorting uniform noise.

    Returns the kept tokens [B, N_keep, D], the mask [B, N] (0 is keep, 1 is remove) and `ids_restore`
    [B, N], the permutation that puts a shuffled sequence back in patch order.
    """
    B, N, D = x.shape
    len_keep = kept_patches(N, mask_ratio)
    # Draw on the generator's own device (a CPU generator cannot fill a CUDA tensor), then move: the mask
    # depends on the generator alone. (The objective's generator is on the images' device, and CUDA's
    # Philox draws other numbers than the CPU's generator: a GPU run's masks are not a CPU run's.)
    device = generator.device if generator is not None else x.device
    noise = torch.rand(B, N, generator=generator, device=device).to(x.device)  # [B, N] in [0, 1)

    ids_shuffle = torch.argsort(noise, dim=1)  # ascend: small is keep, large is remove
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    ids_keep = ids_shuffle[:, :len_keep]  # [B, N_keep]
    x_masked = torch.gather(x, 1, ids_keep[..., None].expand(-1, -1, D))  # [B, N_keep, D]

    mask = torch.ones(B, N, device=x.device)
    mask[:, :len_keep] = 0  # 0 is keep, 1 is remove (in shuffled order)
    mask = torch.gather(mask, 1, ids_restore)  # back to patch order
    return x_masked, mask, ids_restore


class MaskedAutoencoderViT(nn.Module):
    """MAE: a ViT encoder on the visible patches, a narrow transformer decoder predicting pixels.

    `num_classes` and `head_bias_init` are not used in pretraining (the encoder has no head); they are
    the defaults of the classifier that `export_encoder()` attaches.
    """

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_dim: int = 3072,
        decoder_embed_dim: int = 512,
        decoder_depth: int = 8,
        decoder_num_heads: int = 16,
        decoder_mlp_dim: int = 2048,
        mask_ratio: float = 0.75,
        norm_pix_loss: bool = False,
        pos_embed: Literal["sincos2d", "learned", "learned_2d", "none"] = "sincos2d",
        qkv_bias: bool = True,
        drop_path_rate: float = 0.0,
        init_values: float | None = None,
        grad_checkpointing: float = 0.0,
        num_classes: int = 1000,
        head_bias_init: float = 0.0,
    ):
        super().__init__()
        if pos_embed == "relative":
            raise ValueError(
                "MAE cannot use pos_embed='relative': the encoder sees a random subset of the patches, "
                "so the per-offset bias table (built for the full grid) no longer lines up; use 'sincos2d'"
            )
        if not 0.0 <= mask_ratio < 1.0:
            raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")
        self.mask_ratio, self.norm_pix_loss = mask_ratio, norm_pix_loss
        self.grad_checkpointing = grad_checkpointing  # the decoder's blocks; the encoder holds its own flag
        self.patch_size, self.in_chans = patch_size, in_chans
        self.export_num_classes, self.export_head_bias_init = num_classes, head_bias_init

        # -- encoder: a plain ViT with a class token; its classifier is dropped (MAE pretrains none),
        # so no parameter sits without a gradient.
        self.encoder = VisionTransformer(
            img_size=img_size,
            patch_size=patch_size,
            in_chans=in_chans,
            num_classes=1,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_dim=mlp_dim,
            pool="cls",
            pos_embed=pos_embed,
            qkv_bias=qkv_bias,
            drop_path_rate=drop_path_rate,
            init_values=init_values,
            grad_checkpointing=grad_checkpointing,
        )
        self.encoder.head = nn.Identity()
        self._encoder_kwargs = dict(
            patch_size=patch_size,
            in_chans=in_chans,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_dim=mlp_dim,
            qkv_bias=qkv_bias,
            init_values=init_values,
        )

        # -- decoder
        grid = self.encoder.grid_size
        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        # Fixed sin-cos for the patches, a zero row for the class token; not saved (rebuilt from the shape).
        table = sincos_2d(*grid, decoder_embed_dim)  # [N, Dd]
        table = torch.cat([torch.zeros(1, decoder_embed_dim), table], dim=0)[None]  # [1, 1+N, Dd]
        self.register_buffer("decoder_pos_embed_fixed", table, persistent=False)
        self.decoder_blocks = nn.ModuleList(
            Block(decoder_embed_dim, decoder_num_heads, decoder_mlp_dim, qkv_bias)
            for _ in range(decoder_depth)
        )
        self.decoder_norm = nn.LayerNorm(decoder_embed_dim, eps=1e-6)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size * patch_size * in_chans)
        self._init_weights()

    def _init_weights(self) -> None:
        """MAE's `initialize_weights`: xavier-uniform for every Linear (encoder included), tokens N(0, 0.02)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)  # on the full qkv matrix, as the original
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        w = self.encoder.patch_embed.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))  # the patch projection as a linear layer
        nn.init.normal_(self.encoder.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)

    # ------------------------------------------------------------------ forward

    def forward_encoder(
        self, imgs: torch.Tensor, mask_ratio: float, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> latent [B, 1+N_keep, D] (class token first), mask [B, N], ids_restore [B, N]."""
        enc = self.encoder
        x = enc.embed_patches(imgs)  # [B, N, D]; position added before masking, so kept tokens keep it
        x, mask, ids_restore = random_masking(x, mask_ratio, generator)  # [B, N_keep, D]
        x = torch.cat([enc.prefix_tokens(x.shape[0]), x], dim=1)  # [B, 1+N_keep, D]
        return enc.norm(enc.forward_blocks(x)), mask, ids_restore

    def forward_decoder(self, latent: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """latent [B, 1+N_keep, D] -> pixel predictions for every patch [B, N, p*p*C]."""
        x = self.decoder_embed(latent)  # [B, 1+N_keep, Dd]
        B, n_visible, Dd = x.shape[0], x.shape[1] - 1, x.shape[2]
        mask_tokens = self.mask_token.to(x.dtype).expand(B, ids_restore.shape[1] - n_visible, -1)
        x_ = torch.cat([x[:, 1:], mask_tokens], dim=1)  # [B, N, Dd] in shuffled order
        x_ = torch.gather(x_, 1, ids_restore[..., None].expand(-1, -1, Dd))  # unshuffle to patch order
        x = torch.cat([x[:, :1], x_], dim=1) + self.decoder_pos_embed_fixed.to(x.dtype)  # [B, 1+N, Dd]
        for i, blk in enumerate(self.decoder_blocks):
            ckpt = self.training and checkpoints_block(self.grad_checkpointing, i, len(self.decoder_blocks))
            x = checkpoint(blk, x, use_reentrant=False) if ckpt else blk(x)
        x = self.decoder_pred(self.decoder_norm(x))  # [B, 1+N, p*p*C]
        return x[:, 1:]  # drop the class token

    def forward_loss(self, imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean squared error over the removed patches only (visible ones are copied, not predicted)."""
        target = patchify(imgs.float(), self.patch_size)  # [B, N, p*p*C], in fp32 as the reference's
        pred = pred.float()
        if self.norm_pix_loss:
            # Per-patch normalised pixels: the paper's better-representation variant.
            mean = target.mean(dim=-1, keepdim=True)
            var = target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1e-6) ** 0.5
        loss = ((pred - target) ** 2).mean(dim=-1)  # [B, N], mean loss per patch
        # clamp: at mask_ratio 0 nothing is removed and the loss is 0, not 0/0.
        return (loss * mask).sum() / mask.sum().clamp_min(1)

    def forward(
        self, imgs: torch.Tensor, mask_ratio: float | None = None, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (loss, pred [B, N, p*p*C], mask [B, N] with 1 = removed)."""
        ratio = self.mask_ratio if mask_ratio is None else mask_ratio
        # The encoder reads the images in its weights' dtype; the targets are the images as given (fp32 from
        # the objective, as the reference's targets stay fp32 under autocast: bf16 pixels, normalised per
        # patch, turned a flat patch's rounding into its target).
        dtype = self.decoder_pred.weight.dtype
        latent, mask, ids_restore = self.forward_encoder(imgs.to(dtype), ratio, generator)
        pred = self.forward_decoder(latent, ids_restore)
        return self.forward_loss(imgs, pred, mask), pred, mask

    # ------------------------------------------------------------------ FLOPs

    def forward_macs(self, img_size: int | None = None, mask_ratio: float | None = None) -> int:
        """Forward multiply-accumulates for one image: the encoder on the visible tokens, the decoder on all
        of them (mask tokens filled in). `mask_ratio` None means the model's own."""
        ratio = self.mask_ratio if mask_ratio is None else mask_ratio
        macs, n = self.encoder.encoder_macs(img_size, ratio)  # pretraining has no classifier
        prefix = self.encoder.num_prefix_tokens
        visible, full = prefix + kept_patches(n, ratio), prefix + n
        macs += linear_macs(self.decoder_embed, visible)  # before the mask tokens are appended
        macs += sum(blk.forward_macs(full) for blk in self.decoder_blocks)
        return macs + linear_macs(self.decoder_pred, full)  # predicts on every token, then drops the prefix

    # ------------------------------------------------------------------ export

    def export_encoder(
        self, pool: Literal["cls", "gap"] = "cls", num_classes: int | None = None, **overrides
    ) -> VisionTransformer:
        """A plain ViT (learned position table) holding the encoder's weights, as MAE fine-tuning starts.

        `pos_embed` starts from the encoder's position embedding (the fixed sin-cos table, a zero row for
        the class token). With pool="gap" the class token and final norm are dropped and `fc_norm` starts
        fresh, like MAE's `global_pool` fine-tuning. `overrides` go to `VisionTransformer`
        (e.g. drop_path_rate=0.1). The classifier head is new (zero-initialised).
        """
        enc = self.encoder
        img_size = enc.grid_size[0] * self.patch_size  # the encoder's current grid, even after set_grid
        kwargs = dict(
            self._encoder_kwargs,
            img_size=img_size,
            num_classes=self.export_num_classes if num_classes is None else num_classes,
            head_bias_init=self.export_head_bias_init,
            pool=pool,
            pos_embed="learned",
        )
        vit = VisionTransformer(**{**kwargs, **overrides})

        patch_pos = enc.patch_pos_embed()  # [1, N, D] or None ("none")
        if patch_pos is None:
            patch_pos = torch.zeros(1, enc.grid_size[0] * enc.grid_size[1], enc.embed_dim)
        state = {k: v for k, v in enc.state_dict().items() if not k.startswith("pos_embed")}
        if pool == "cls":
            cls_pos = (
                enc.pos_embed[:, :1]
                if enc.pos_embed_kind == "learned"
                else torch.zeros_like(patch_pos[:, :1])
            )
            state["pos_embed"] = torch.cat([cls_pos, patch_pos], dim=1)  # [1, 1+N, D]
        else:
            state = {k: v for k, v in state.items() if k != "cls_token" and not k.startswith("norm.")}
            state["pos_embed"] = patch_pos  # [1, N, D]
        state = {k: v.detach().clone() for k, v in state.items()}
        missing, unexpected = vit.load_state_dict(state, strict=False)
        fresh = {"head.weight", "head.bias", "fc_norm.weight", "fc_norm.bias"}  # new for fine-tuning
        if unexpected or not set(missing) <= fresh:
            raise RuntimeError(f"export_encoder: missing {missing}, unexpected {unexpected}")
        param = next(enc.parameters())
        return vit.to(device=param.device, dtype=param.dtype)


# ---------------------------------------------------------------------- registered variants

# The paper's decoder for every encoder size: 8 blocks, width 512, 16 heads, MLP 4x; the debug size a 2x32 one.
_DECODER = dict(decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16, decoder_mlp_dim=2048)
_DEBUG_DECODER = dict(decoder_embed_dim=32, decoder_depth=2, decoder_num_heads=4, decoder_mlp_dim=128)


@register
def mae_vit_debug(**kw) -> MaskedAutoencoderViT:
    """Tiny MAE for tests: 32px images, 8px patches, encoder 4x64, decoder 2x32."""
    return MaskedAutoencoderViT(**{**VIT_SHAPES["debug"], **_DEBUG_DECODER, **kw})


@register
def mae_vit_b16(**kw) -> MaskedAutoencoderViT:
    return MaskedAutoencoderViT(**{**VIT_SHAPES["b16"], **_DECODER, **kw})


@register
def mae_vit_l16(**kw) -> MaskedAutoencoderViT:
    return MaskedAutoencoderViT(**{**VIT_SHAPES["l16"], **_DECODER, **kw})


@register
def mae_vit_h14(**kw) -> MaskedAutoencoderViT:
    return MaskedAutoencoderViT(**{**VIT_SHAPES["h14"], **_DECODER, **kw})


__all__ = ["MaskedAutoencoderViT", "patchify", "random_masking", "unpatchify"]
