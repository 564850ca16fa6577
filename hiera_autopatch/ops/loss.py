"""MAE pixel targets and loss on a static set of rows (FAIR's ``label[mask]`` without the mask)."""

from __future__ import annotations

from typing import Tuple

import torch

from . import masking


def pixel_patches_2d(images: torch.Tensor, size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/size * W/size, size*size*C), FAIR's ``get_pixel_label_2d`` order."""
    images = images.permute(0, 2, 3, 1)  # (B, H, W, C)
    patches = images.unfold(1, size, size).unfold(2, size, size)  # (B, H/s, W/s, C, s, s)
    return patches.flatten(1, 2).flatten(2)


def pixel_patches_3d(videos: torch.Tensor, size: int, time_stride: int) -> torch.Tensor:
    """(B, C, T, H, W) -> (B, T/ts * H/s * W/s, C*s*s), FAIR's ``get_pixel_label_3d`` order."""
    videos = videos[:, :, ::time_stride, :, :]  # first frame of each token
    patches = videos.unfold(3, size, size).unfold(4, size, size)  # (B, C, T', H/s, W/s, s, s)
    patches = patches.permute(0, 2, 3, 4, 5, 6, 1)  # (B, T', H/s, W/s, s, s, C) as FAIR does
    return patches.flatten(1, 3).flatten(2)


def normalize_rows(label: torch.Tensor) -> torch.Tensor:
    """Per-patch normalisation exactly as FAIR writes it."""
    mean = label.mean(dim=-1, keepdim=True)
    var = label.var(dim=-1, keepdim=True)
    return (label - mean) / (var + 1.0e-6) ** 0.5


def masked_mse(
    pred: torch.Tensor, patches: torch.Tensor, masked_idx: torch.Tensor, norm: bool = True
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FAIR's ``(loss, pred[mask], label[mask])`` from static row indices.

    pred: (B, L, P); patches: (B, L, P) unnormalised targets; masked_idx: (B, n) ascending.
    Rows come out batch-major, then token order, as boolean indexing returns them.
    """
    label = masking.take_rows(patches, masked_idx)  # (B*n, P)
    if norm:
        label = normalize_rows(label)
    pred = masking.take_rows(pred, masked_idx)  # (B*n, P)
    loss = (pred - label) ** 2
    return loss.mean(), pred, label
