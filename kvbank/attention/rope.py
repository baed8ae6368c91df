"""Rotary position embedding, shared by the model and by the storage kinds that re-rotate keys."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of the head dimension: x is [..., dim], cos/sin broadcast against it.

    `sin` carries the sign of the rotation in its first half, which saves negating x.
    """
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


def rotation_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin rows [n, head_dim] for `positions` [n] (negative ones rotate backwards), laid out as
    the model's rotary tables are (the sign in sin's first half); computed in float64."""
    angles = positions.double().unsqueeze(-1) * inv_freq.double()
    emb = torch.cat((angles, angles), dim=-1)
    sin = emb.sin()
    sin[..., : sin.shape[-1] // 2].neg_()
    return emb.cos().float(), sin.float()
