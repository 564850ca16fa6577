"""MAE pixel targets and loss on a static set of rows (FAIR's ``label[mask]`` without the mask)."""

from __future__ import annotations

from typing import Tuple

import torch

from . import masking

decoder_rows = True
"""In the patched MAE step, the decoder's last MLP, its norm and its prediction head run at the
masked tokens only, the rows the loss reads (``patches/fair.py``, ``predict_masked``). Hiera-B MAE
at mask 0.6: 120 of 196 tokens, so 40% less of that work; the other tokens' predictions are never
returned and get no gradient, so results are FAIR's. On since session 12: the graphed step was
0.11 and 0.36 ms faster in two interleaved A/B pairs on an H100
(benchmarks/results/h100_profile_decoder_rows.json). ``False`` (``scripts/profile_step.py``'s
``+full_decoder``) runs the whole decoder."""


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
    pred: torch.Tensor, patches: torch.Tensor, masked_idx: torch.Tensor, norm: bool = True,
    pred_is_masked: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FAIR's ``(loss, pred[mask], label[mask])`` from static row indices.

    pred: (B, L, P), or (B, n, P) already at the masked rows with ``pred_is_masked``; patches:
    (B, L, P) unnormalised targets; masked_idx: (B, n) ascending. Rows come out batch-major, then
    token order, as boolean indexing returns them.
    """
    label = masking.take_rows(patches, masked_idx)  # (B*n, P)
    if norm:
        label = normalize_rows(label)
    if pred_is_masked:
        pred = pred.reshape(-1, pred.shape[-1])  # (B*n, P)
    else:
        pred = masking.take_rows(pred, masked_idx)  # (B*n, P)
    loss = (pred - label) ** 2
    return loss.mean(), pred, label
