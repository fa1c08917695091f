"""Transformer building blocks in the timm/MAE layout (`attn.qkv`, `mlp.fc1`, `ls1.gamma`, ...), single-device."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.macs import conv_macs, linear_macs
from pipeline.models.pos_embed import RelativePositionBias


def init_linear_and_norm(module: nn.Module, norms: tuple[type[nn.Module], ...] = (nn.LayerNorm,)) -> None:
    """The init ViT, DeiT, TNT, CvT and Swin share: trunc-normal(0.02) Linear weights, zero biases, unit norms."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, norms):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class _StatsPrecisionBatchNorm:
    """BatchNorm that keeps its statistics in fp32 under a bf16 or fp16 engine.

    DeepSpeed casts parameters to the training precision but leaves buffers as they were (fp32), so the
    weight and bias would be bf16 beside fp32 running statistics, a mix torch's batch norm refuses. Here
    the weight and bias join the statistics' dtype for the call: torch's mixed kernel (half input,
    fp32 weight and statistics, half output) runs, and the running statistics keep fp32's precision.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = self.running_mean
        if stats is None or self.weight is None or self.weight.dtype == stats.dtype:
            return super().forward(x)
        self._check_input_dim(x)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        return F.batch_norm(
            x,
            stats,
            self.running_var,
            self.weight.to(stats.dtype),
            self.bias.to(stats.dtype),
            self.training,
            momentum,
            self.eps,
        )


class BatchNorm1d(_StatsPrecisionBatchNorm, nn.BatchNorm1d):
    """nn.BatchNorm1d with fp32 statistics under half-precision weights (see _StatsPrecisionBatchNorm)."""


class BatchNorm2d(_StatsPrecisionBatchNorm, nn.BatchNorm2d):
    """nn.BatchNorm2d with fp32 statistics under half-precision weights (see _StatsPrecisionBatchNorm)."""


def set_grad_checkpointing(model: nn.Module, fraction: float = 1.0) -> int:
    """Recompute the activations of `fraction` of the blocks in backward (1 or True: all, 0 or False: none),
    in every part of `model` that offers it; returns how many parts.

    Each family marks the modules whose blocks it can recompute in backward with a `grad_checkpointing`
    attribute (a ViT, an MAE decoder, each CvT stage, a Swin, TNT or LeViT); wrappers (MAE, masked patch
    prediction, SimMIM) hold such modules, so the policy is set wherever it appears, not only on the top.
    Each part applies the fraction to its own blocks (`checkpoints_block`).
    """
    if not 0.0 <= float(fraction) <= 1.0:
        raise ValueError(f"the fraction of blocks to checkpoint must be in [0, 1], got {fraction}")
    found = [m for m in model.modules() if hasattr(m, "grad_checkpointing")]
    for m in found:
        m.grad_checkpointing = float(fraction)
    return len(found)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of every part of `model`, in order: the members of each `blocks` or
    `decoder_blocks` container (a ViT's, an MAE decoder's, each CvT, Swin or LeViT stage's, TNT's)."""
    found: list[nn.Module] = []
    for m in model.modules():
        for name in ("blocks", "decoder_blocks"):
            container = getattr(m, name, None)
            if isinstance(container, (nn.ModuleList, nn.Sequential)):
                found.extend(container)
    return found


def checkpointed_fraction(model: nn.Module) -> float:
    """The share of `model`'s transformer blocks that recompute in backward as its parts are set now (for
    HFU): each container of blocks counted as its part selects them, so a Swin stage of two blocks at 0.25
    recomputes none. A part's policy is its own `grad_checkpointing` or, for a stage that takes it from the
    model (Swin), the nearest enclosing one's. A model that selects otherwise says so itself (LeViT's
    `checkpointed_fraction`: its stages' layers together, downsampling included)."""
    own = getattr(model, "checkpointed_fraction", None)
    if callable(own):
        return own()
    modules = dict(model.named_modules())
    chosen = total = 0
    for name, module in modules.items():
        for attr in ("blocks", "decoder_blocks"):
            container = getattr(module, attr, None)
            if not isinstance(container, (nn.ModuleList, nn.Sequential)):
                continue
            owner, policy = name, 0.0
            while True:  # the part itself, then its enclosing modules
                holder = modules[owner]
                if hasattr(holder, "grad_checkpointing"):
                    policy = float(holder.grad_checkpointing)
                    break
                if not owner:
                    break
                owner = owner.rpartition(".")[0]
            total += len(container)
            chosen += sum(checkpoints_block(policy, i, len(container)) for i in range(len(container)))
    return chosen / total if total else 0.0


def checkpoints_block(fraction: float, index: int, count: int) -> bool:
    """Whether block `index` of `count` recomputes its activations in backward when `fraction` of them do.

    floor(fraction x count) blocks, spread evenly (block i when floor((i + 1) f) > floor(i f)): at 0.5
    every second block, at 0.25 every fourth, at 1 all. Spread rather than the first or last ones, so the
    activations that stay in memory and the recompute are spread over the whole forward (torchtitan's
    selective layer checkpointing takes every k-th block the same way).
    """
    f = float(fraction)
    return f > 0 and math.floor((index + 1) * f + 1e-9) > math.floor(index * f + 1e-9)


def drop_patches(x: torch.Tensor, keep: int) -> torch.Tensor:
    """FLIP patch dropout: a random `keep` of the N tokens of each image [B, N, D] -> [B, keep, D].

    Draws from the global RNG (seeded from the config, saved in checkpoints) like stochastic depth.
    """
    noise = torch.rand(x.shape[0], x.shape[1], device=x.device)  # [B, N]
    ids = noise.argsort(dim=1)[:, :keep]  # [B, keep]
    return torch.gather(x, 1, ids[..., None].expand(-1, -1, x.shape[2]))


def classify(model: nn.Module, x: torch.Tensor, x_dist: torch.Tensor):
    """Logits from the pooled class features `x` and distillation features `x_dist` (DeiT).

    Without a distillation head: head(x). With one: both logits while the distillation objective
    trains (`model.distilled_training`), else their mean, as DeiT predicts at inference.
    """
    logits = model.head(x)
    if model.head_dist is None:
        return logits
    logits_dist = model.head_dist(x_dist)
    if model.distilled_training and model.training:
        return logits, logits_dist
    return (logits + logits_dist) / 2


class MaskedImageModelling:
    """Mixin for the families SimMIM wraps (TNT, CvT, Swin): `forward(x)` classifies, `forward_mim(x, mask)`
    returns the feature map of images whose masked tokens were replaced by the mask token.

    forward_mim goes through `__call__`, so module hooks fire on the model itself: ZeRO-3 gathers the
    parameters it registers directly (mask tokens, class token, position embeddings) in its own forward.
    A subclass writes `_forward_mim(x, mask)`.
    """

    def forward(self, x: torch.Tensor, mim_mask: torch.Tensor | None = None):
        if mim_mask is not None:
            return self._forward_mim(x, mim_mask)
        return self.forward_head(self.forward_features(x))

    def forward_mim(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Images [B, C, H, W], mask bool [B, H/mim_patch_size, W/mim_patch_size] (True = masked)
        -> features [B, num_features, H/mim_stride, W/mim_stride]."""
        return self(x, mim_mask=mask)


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> tokens by one strided convolution."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
        self.patch_size = patch_size
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)  # [B, D, H/p, W/p]
        return x.flatten(2).transpose(1, 2)  # [B, N, D]

    def forward_macs(self, img_hw: tuple[int, int]) -> tuple[int, int]:
        """(MACs, number of patch tokens) on an image of size img_hw."""
        macs, hw = conv_macs(self.proj, img_hw)
        return macs, hw[0] * hw[1]


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None = None) -> torch.Tensor:
        B, N, D = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # [B, H, N, D/H] each
        bias = None if attn_bias is None else attn_bias.to(q.dtype)  # [H, N, N], broadcast over B
        x = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias
        )  # flash / efficient kernels when bias is None
        return self.proj(x.transpose(1, 2).reshape(B, N, D))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class LayerScale(nn.Module):
    """Per-channel residual scaling (CaiT); timm names the parameter `gamma`."""

    def __init__(self, dim: int, init_values: float):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample (scaled to keep the expectation).

    The keep probability is a 0-dim buffer (not saved), not a Python float: torch.compile treats a module's
    float attribute as a constant of the graph, so every block's own rate (a linear ramp over depth) would
    compile a graph of its own, and past dynamo's recompile limit (8) the remaining blocks would run eager.
    """

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.register_buffer("keep", torch.tensor(1.0 - p), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(self.keep)
        return x * mask / self.keep

    def extra_repr(self) -> str:
        return f"p={self.p:.3f}"


class Block(nn.Module):
    """Pre-LN transformer encoder block with optional layer scale and stochastic depth."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_dim: int,
        qkv_bias: bool = True,
        drop_path: float = 0.0,
        init_values: float | None = None,
        rel_pos_grid: tuple[int, int] | None = None,
        num_prefix_tokens: int = 0,
    ):
        super().__init__()
        # Relative position: a learned bias per head and offset in every block (pos_embed="relative").
        self.rel_pos = (
            RelativePositionBias(rel_pos_grid, num_heads, num_prefix_tokens) if rel_pos_grid else None
        )
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, qkv_bias)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, mlp_dim)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn_bias = self.rel_pos() if self.rel_pos is not None else None
        x = x + self.drop_path(self.ls1(self.attn(self.norm1(x), attn_bias)))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x))))

    def forward_macs(self, tokens: int) -> int:
        """MACs on `tokens` tokens: qkv, QK^T, AV, proj, fc1, fc2 (the relative position bias is an add)."""
        attn, mlp = self.attn, self.mlp
        inner = attn.qkv.out_features // 3  # heads x head_dim
        # QK^T [T, d] x [d, T] and AV [T, T] x [T, d], summed over heads
        attention = 2 * tokens * tokens * inner
        return (
            linear_macs(attn.qkv, tokens)
            + attention
            + linear_macs(attn.proj, tokens)
            + linear_macs(mlp.fc1, tokens)
            + linear_macs(mlp.fc2, tokens)
        )
