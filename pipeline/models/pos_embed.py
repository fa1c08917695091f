"""Position embeddings of the ViT paper's ablation (Appendix D.4) and their resampling.

- `learned`: one learned vector per token, prefix tokens included (timm layout `pos_embed` [1, P+N, D]).
- `learned_2d`: learned row and column embeddings of width D/2 each, concatenated (the paper's 2-D variant).
- `sincos2d`: fixed 2-D sine-cosine (MoCo v3, MAE, big_vision).
- `relative`: no absolute embedding; each attention layer learns a bias per head and relative offset.
- `none`: no position information.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

POS_EMBED_KINDS = ("learned", "learned_2d", "sincos2d", "relative", "none")


def sincos_2d(grid_h: int, grid_w: int, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """Fixed 2-D sin-cos embedding [grid_h * grid_w, dim], in MAE's layout: [sin x, cos x, sin y, cos y]."""
    if dim % 4:
        raise ValueError(f"sincos2d needs a width divisible by 4, got {dim}")
    y, x = torch.meshgrid(
        torch.arange(grid_h, dtype=torch.float64), torch.arange(grid_w, dtype=torch.float64), indexing="ij"
    )
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))
    out_w = x.flatten()[:, None] * omega[None]  # [N, D/4]
    out_h = y.flatten()[:, None] * omega[None]
    return torch.cat([out_w.sin(), out_w.cos(), out_h.sin(), out_h.cos()], dim=1).float()


def resample_abs_pos_embed(
    pos_embed: torch.Tensor,
    new_grid: tuple[int, int],
    num_prefix_tokens: int,
    old_grid: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Bicubic resampling of a [1, P+N, D] table to a new grid; the P prefix (class, distillation) rows stay."""
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    if old_grid is None:
        side = int(round(grid.shape[1] ** 0.5))
        if side * side != grid.shape[1]:
            raise ValueError(
                f"cannot infer a square grid from {grid.shape[1]} position embeddings; pass old_grid"
            )
        old_grid = (side, side)
    if tuple(old_grid) == tuple(new_grid):
        return pos_embed
    d = grid.shape[-1]
    grid = grid.reshape(1, *old_grid, d).permute(0, 3, 1, 2).float()  # [1, D, H, W]
    grid = F.interpolate(grid, size=new_grid, mode="bicubic", align_corners=False)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], d).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)


class RelativePositionBias(nn.Module):
    """Learned bias per head for every relative (dy, dx) offset between patches (Swin, BEiT).

    As in BEiT, three extra entries per head cover prefix tokens: prefix->patch, patch->prefix and
    prefix->prefix, so a class token's attention is learned too.
    """

    def __init__(self, grid: tuple[int, int], num_heads: int, num_prefix_tokens: int):
        super().__init__()
        self.grid, self.num_prefix_tokens = tuple(grid), num_prefix_tokens
        h, w = grid
        self.num_offsets = (2 * h - 1) * (2 * w - 1)
        self.relative_position_bias_table = nn.Parameter(torch.zeros(self.num_offsets + 3, num_heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.register_buffer(
            "relative_position_index", self._index(h, w, num_prefix_tokens), persistent=False
        )

    @staticmethod
    def _index(h: int, w: int, prefix: int) -> torch.Tensor:
        coords = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")).flatten(
            1
        )  # [2, N]
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)  # [N, N, 2]
        patch = (rel[..., 0] + h - 1) * (2 * w - 1) + (rel[..., 1] + w - 1)  # [N, N]
        t = (2 * h - 1) * (2 * w - 1)
        n = h * w
        index = torch.empty(prefix + n, prefix + n, dtype=torch.long)
        index[prefix:, prefix:] = patch
        index[:prefix, prefix:] = t  # prefix query -> patch key
        index[prefix:, :prefix] = t + 1  # patch query -> prefix key
        index[:prefix, :prefix] = t + 2
        return index

    def forward(self) -> torch.Tensor:
        n = self.relative_position_index.shape[0]
        bias = self.relative_position_bias_table[self.relative_position_index.reshape(-1)]
        return bias.reshape(n, n, -1).permute(2, 0, 1)  # [H, P+N, P+N]

    def resample(self, new_grid: tuple[int, int]) -> None:
        """Bicubic resampling of the offset table for a new patch grid (BEiT's fine-tuning recipe)."""
        h, w = self.grid
        nh, nw = new_grid
        table = self.relative_position_bias_table.data
        heads = table.shape[1]
        t = table[: self.num_offsets].T.reshape(1, heads, 2 * h - 1, 2 * w - 1)
        t = F.interpolate(t, size=(2 * nh - 1, 2 * nw - 1), mode="bicubic", align_corners=False)
        t = torch.cat([t.reshape(heads, -1).T, table[self.num_offsets :]], dim=0)
        self.relative_position_bias_table = nn.Parameter(t.contiguous())
        self.grid, self.num_offsets = (nh, nw), (2 * nh - 1) * (2 * nw - 1)
        self.relative_position_index = self._index(nh, nw, self.num_prefix_tokens).to(table.device)
