"""Patches for timm's ``timm.models.hiera``.

timm made its global attention 4-D in early 2026; its windowed attention still hands SDPA 5-D
tensors (math path). Its q-pool uses ``amax`` (gradient split among ties), which we keep. With
``fused_attn`` off (``TIMM_FUSED_ATTN=0``) its explicit math path runs unchanged.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch

from ..ops import attention, masking
from ._base import Patch, method_matches
from .fair import GET_RANDOM_MASK  # timm's is FAIR's, unchanged

# Fingerprints of timm's methods: attention before / after its 2026 global-attention change.
MASK_UNIT_ATTENTION_FORWARD = frozenset({"a9a75f950ff89e3f", "63ac65f89dc381fb"})  # 1.0.9-1.0.24, 1.0.26-1.0.31
FORWARD_FEATURES = frozenset({"2c461226877d4754"})  # 1.0.9-1.0.31
FORWARD_INTERMEDIATES = frozenset({"83e730981d2e91fc"})  # 1.0.19-1.0.31


def make_attention_forward(original: Callable, cls: type) -> Callable:
    def mask_unit_attention_forward(self, x: torch.Tensor) -> torch.Tensor:
        """timm's MaskUnitAttention.forward with 4-D q/k/v; its math path when fused_attn is off."""
        if not self.fused_attn:
            return original(self, x)
        batch, tokens, _ = x.shape
        num_windows = (tokens // (self.q_stride * self.window_size)) if self.use_mask_unit_attn else 1
        out = attention.qkv_attention(x, self.qkv, num_windows, self.heads, self.q_stride, pool="amax")
        return self.proj(out)

    return mask_unit_attention_forward


def _drop_units(self, x: torch.Tensor, mask: torch.Tensor, n_keep: int) -> torch.Tensor:
    """timm's ``x[mask[..., None].tile(1, self.mu_size, C)].view(B, -1, C)`` as a static gather."""
    keep_idx = masking.true_indices(mask, n_keep)  # (B, n_keep)
    return masking.keep_mask_units(x, keep_idx, mask.shape[1])  # (B, mu_size * n_keep, C)


def make_forward_features(original: Callable, cls: type) -> Callable:
    timm_random_mask = cls.get_random_mask
    checkpoint = sys.modules[cls.__module__].checkpoint

    def forward_features(self, x, mask=None, return_intermediates=False):
        """timm's Hiera.forward_features; patch dropout keeps a count known without a device read."""
        if self.training and self.patch_drop_rate > 0:
            assert mask is None
            mask = self.get_random_mask(x, mask_ratio=self.patch_drop_rate)
            if type(self).get_random_mask is timm_random_mask:
                n_keep = masking.static_keep_count(mask.shape[1], self.patch_drop_rate)
            else:
                n_keep = masking.keep_count(mask)
        elif mask is not None:
            n_keep = masking.keep_count(mask)
        patch_mask = None if mask is None else mask.view(x.shape[0], 1, *self.mask_spatial_shape)
        x = self.patch_embed(x, mask=patch_mask)  # (B, N, C)
        x = self._pos_embed(x)
        x = self.unroll(x)  # (B, N, C), mask unit index fastest
        if mask is not None:
            x = _drop_units(self, x, mask, n_keep)
        intermediates = []
        for i, block in enumerate(self.blocks):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(block, x)
            else:
                x = block(x)
            if return_intermediates and i in self.stage_ends:
                intermediates.append(self.reroll(x, i, mask=mask))
        if return_intermediates:
            return x, intermediates
        return x

    return forward_features


def make_forward_intermediates(original: Callable, cls: type) -> Callable:
    module = sys.modules[cls.__module__]
    feature_take_indices, checkpoint = module.feature_take_indices, module.checkpoint

    def forward_intermediates(
        self,
        x,
        mask=None,
        indices=None,
        norm=False,
        stop_early=True,
        output_fmt="NCHW",
        intermediates_only=False,
        coarse=True,
    ):
        """timm's Hiera.forward_intermediates with a static gather for a given mask."""
        assert not norm, "normalization of features not supported"
        assert output_fmt in ("NCHW", "NHWC"), "Output format must be one of NCHW, NHWC."
        if coarse:
            take_indices, max_index = feature_take_indices(len(self.stage_ends), indices)
            take_indices = [self.stage_ends[i] for i in take_indices]
            max_index = self.stage_ends[max_index]
        else:
            take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        patch_mask = None if mask is None else mask.view(x.shape[0], 1, *self.mask_spatial_shape)
        x = self.patch_embed(x, mask=patch_mask)
        x = self._pos_embed(x)
        x = self.unroll(x)
        if mask is not None:
            x = _drop_units(self, x, mask, masking.keep_count(mask))
        intermediates = []
        blocks = self.blocks if torch.jit.is_scripting() or not stop_early else self.blocks[: max_index + 1]
        for i, block in enumerate(blocks):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(block, x)
            else:
                x = block(x)
            if i in take_indices:
                x_int = self.reroll(x, i, mask=mask)
                intermediates.append(x_int.permute(0, 3, 1, 2) if output_fmt == "NCHW" else x_int)
        if intermediates_only:
            return intermediates
        return x, intermediates

    return forward_intermediates


def check_random_mask(cls: type, module) -> Optional[str]:
    return method_matches(cls, "get_random_mask", GET_RANDOM_MASK)


PATCHES = (
    Patch(
        "timm.attention",
        "MaskUnitAttention",
        "forward",
        make_attention_forward,
        MASK_UNIT_ATTENTION_FORWARD,
        summary="4-D q/k/v for windowed attention so SDPA runs a fused kernel",
    ),
    Patch(
        "timm.forward_features",
        "Hiera",
        "forward_features",
        make_forward_features,
        FORWARD_FEATURES,
        checks=(check_random_mask,),
        summary="masks and patch dropout by a static gather instead of boolean indexing",
    ),
    Patch(
        "timm.forward_intermediates",
        "Hiera",
        "forward_intermediates",
        make_forward_intermediates,
        FORWARD_INTERMEDIATES,
        summary="a given mask applied by a static gather",
    ),
)
