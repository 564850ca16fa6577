"""Static-shape MAE masking: gathers and scatters of a known length instead of boolean indexing.

Boolean indexing (``x[mask]``) runs ``nonzero``: a device sync, a slow indexing kernel, a graph
break under ``torch.compile`` and no CUDA graphs. Every MAE sample keeps the same number of mask
units, so the same rows can be picked with a gather whose length is a Python int.
"""

from __future__ import annotations

from typing import Optional

import torch


def static_keep_count(num_units: int, mask_ratio: float) -> int:
    """How many mask units FAIR's ``get_random_mask`` keeps: known without looking at the mask."""
    return int(num_units * (1 - mask_ratio))


def keep_count(mask: torch.Tensor, strict: bool = True) -> Optional[int]:
    """The number of True entries per row of a (B, L) mask; reads it from the device (one sync).

    Rows with different counts raise ``ValueError`` (FAIR's encoder needs equal counts too), or
    return None with ``strict=False``.
    """
    counts = mask.reshape(mask.shape[0], -1).sum(dim=1)
    low, high = (int(c) for c in torch.stack(counts.aminmax()).tolist())
    if low != high:
        if not strict:
            return None
        raise ValueError(
            "hiera_autopatch: every sample's mask must keep the same number of mask units "
            f"(FAIR's Hiera needs this too); this mask keeps between {low} and {high}"
        )
    return low


def true_indices(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Positions of the True entries of each row, ascending. (B, L) bool -> (B, count) int64.

    A stable descending sort puts the True entries first, in their original order.
    """
    order = torch.sort(mask.to(torch.uint8), dim=1, descending=True, stable=True).indices
    return order[:, :count]


def keep_mask_units(x: torch.Tensor, keep_idx: torch.Tensor, num_units: int) -> torch.Tensor:
    """Drop the masked units from unrolled tokens, as FAIR's ``x[mask[..., None].tile(...)]``.

    x: (B, mu_size * num_units, C), token j in unit j % num_units; keep_idx: (B, n_keep) ascending.
    Returns (B, mu_size * n_keep, C), again unit index fastest.
    """
    batch, _, channels = x.shape
    x = x.view(batch, -1, num_units, channels)  # (B, mu, nw, C)
    index = keep_idx[:, None, :, None].expand(batch, x.shape[1], keep_idx.shape[1], channels)
    return x.gather(2, index).reshape(batch, -1, channels)  # (B, mu * n_keep, C)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` of each sample: (B, L, P), (B, n) -> (B, n, P)."""
    index = idx[..., None].expand(-1, -1, x.shape[-1])  # (B, n, P)
    return x.gather(1, index)


def take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` of each sample, batch-major: (B, L, P), (B, n) -> (B * n, P), as ``x[mask]``."""
    return gather_rows(x, idx).reshape(-1, x.shape[-1])


def place_mask_units(
    x: torch.Tensor, keep_idx: torch.Tensor, num_units: int, fill: torch.Tensor
) -> torch.Tensor:
    """Put visible units back among mask tokens, as FAIR's decoder does with ``x_dec[mask] = ...``.

    x: (B, n_keep, *unit_shape, C); keep_idx: (B, n_keep); fill: the mask token, C elements.
    Returns (B, num_units, *unit_shape, C) in the dtype FAIR's ``~mask * token + mask * x`` gives.
    """
    dtype = torch.promote_types(x.dtype, fill.dtype)
    batch, n_keep, *unit_shape, channels = x.shape
    base = fill.to(dtype).reshape(1, 1, *[1] * len(unit_shape), channels)
    base = base.expand(batch, num_units, *unit_shape, channels)
    index = keep_idx.view(batch, n_keep, *[1] * (len(unit_shape) + 1)).expand(x.shape)
    return base.scatter(1, index, x.to(dtype))
