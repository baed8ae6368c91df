"""Rotary position embedding, shared by the model and by the storage kinds that re-rotate keys."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of the head dimension: x is [..., dim], cos/sin broadcast against it.

    `sin` carries the sign of the rotation in its first half, which saves negating x.
    """
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin
