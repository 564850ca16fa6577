"""Patches for FAIR's Hiera: PyPI ``hiera-transformer`` and in-tree copies of it (``models/hiera.py``).

Each replacement returns what FAIR's method returns, in the same layout and dtype, so any subset of
them composes with the user's own (edited) methods. Together, the MAE step has no data-dependent
shape: it traces with ``torch.compile(fullgraph=True)`` and runs under CUDA graphs.
"""

from __future__ import annotations

import math
import sys
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from ..ops import attention, fusion_head, layer_norm, loss, masking, mlp, patch_embed, step_graph
from . import _base
from ._base import Patch

# Fingerprints (see _base.fingerprint) of FAIR's methods in hiera-transformer 0.1.4, which match
# facebookresearch/hiera main as vendored into research repos.
MASK_UNIT_ATTENTION_FORWARD = frozenset({"1858b2ecf667cca5"})
HIERA_BLOCK_FORWARD = frozenset({"622e207bf14d51e4"})
TIMM_MLP_FORWARD = frozenset({"f2fe57510e1eef51"})  # timm's Mlp, which FAIR's blocks use
DO_POOL = frozenset({"34e705fa5b714105"})
PATCH_EMBED_FORWARD = frozenset({"d30b67b7f8ff561a"})
UNROLL_FORWARD = frozenset({"4bae67a70c70555d"})
DO_MASKED_CONV = frozenset({"102e8b62ad4163a3"})
GET_RESIZED_MASK = frozenset({"e328d2bde128a7d5"})
HIERA_FORWARD = frozenset({"5b85aa9e5f0e0d8a"})
GET_RANDOM_MASK = frozenset({"e965111f25ffeec2"})
MAE_FORWARD_ENCODER = frozenset({"9b675f3cdba2366e"})
MAE_FORWARD_DECODER = frozenset({"bd1eb989e0596170"})
MAE_FORWARD_LOSS = frozenset({"9c07c1f6f0c3990c"})
MAE_FORWARD = frozenset({"35299b559f87a5d3"})
PIXEL_LABEL_2D = frozenset({"7b50ef890e5c911b"})
PIXEL_LABEL_3D = frozenset({"3f00e4cb0df3e777"})
UNDO_WINDOWING = frozenset({"dc319e1ecd229d7d"})
APPLY_FUSION_HEAD = frozenset({"3e5d5a663ba3e0eb"})


# --- attention -------------------------------------------------------------------------------


def make_attention_forward(original: Callable, cls: type) -> Callable:
    def mask_unit_attention_forward(self, x: torch.Tensor) -> torch.Tensor:
        """FAIR's MaskUnitAttention.forward, with q/k/v handed to SDPA as 4-D tensors."""
        batch, tokens, _ = x.shape
        num_windows = (tokens // (self.q_stride * self.window_size)) if self.use_mask_unit_attn else 1
        out = attention.qkv_attention(x, self.qkv, num_windows, self.heads, self.q_stride, pool="max")
        return self.proj(out)

    return mask_unit_attention_forward


# --- block -----------------------------------------------------------------------------------


def make_block_forward(original: Callable, cls: type) -> Callable:
    do_pool = _module_of(cls).do_pool  # FAIR's (checked)
    # The Mlp class FAIR's module uses (timm's), recognised now: a call only compares classes, which
    # torch.compile traces without reading any source.
    timm_mlp = getattr(_module_of(cls), "Mlp", None)
    if _base.fingerprint(getattr(timm_mlp, "forward", None)) not in TIMM_MLP_FORWARD:
        timm_mlp = None

    def attention_residual(self, x: torch.Tensor) -> torch.Tensor:
        """The block's first half: ``x + attn(norm1(x))``, pooled where the width changes."""
        x, x_norm = layer_norm.fork(self.norm1, x)  # (x, norm1(x))
        if self.dim != self.dim_out:
            x = do_pool(self.proj(x_norm), stride=self.attn.q_stride)
        return x + self.drop_path(self.attn(x_norm))

    def mlp_residual(self, x: torch.Tensor) -> torch.Tensor:
        """The block's second half, ``x + mlp(norm2(x))``; under torch.compile the MLP recomputes
        GELU in backward instead of saving it."""
        x, x_norm = layer_norm.fork(self.norm2, x)  # (x, norm2(x))
        if mlp.wanted() and type(self.mlp) is timm_mlp and mlp.plain(self.mlp):
            return x + self.drop_path(mlp.gelu_mlp(self.mlp, x_norm))
        return x + self.drop_path(self.mlp(x_norm))

    def rowwise_mlp_residual(self) -> bool:
        """``mlp_residual`` treats each token on its own and draws no random numbers: running it
        on some tokens gives those tokens' rows of running it on all (hooks would see the change)."""
        return (
            type(self.norm2) is torch.nn.LayerNorm
            and type(self.drop_path) is torch.nn.Identity
            and type(self.mlp) is timm_mlp
            and mlp.plain(self.mlp)
            and mlp.no_hooks(self, self.norm2)
        )

    def hiera_block_forward(self, x: torch.Tensor) -> torch.Tensor:
        """FAIR's HieraBlock.forward; under torch.compile the MLP recomputes GELU in backward
        instead of saving it."""
        return mlp_residual(self, attention_residual(self, x))

    hiera_block_forward.attention_residual = attention_residual
    hiera_block_forward.mlp_residual = mlp_residual
    hiera_block_forward.rowwise_mlp_residual = rowwise_mlp_residual
    return hiera_block_forward


def check_do_pool(cls: type, module) -> Optional[str]:
    return _base.function_matches(module, "do_pool", DO_POOL)


# --- encoder ---------------------------------------------------------------------------------


def kept_embed_classes(module) -> Optional[tuple]:
    """(PatchEmbed, Unroll) of FAIR's ``hiera`` module when their code is what
    ``ops.patch_embed`` reproduces; None otherwise. Checked at patch time: a compiled step must not
    read source."""
    embed, unroll = getattr(module, "PatchEmbed", None), getattr(module, "Unroll", None)
    masked_conv = getattr(module, "do_masked_conv", None)
    resized_mask = getattr(masked_conv, "__globals__", {}).get("get_resized_mask")
    known = (
        _base.fingerprint(getattr(embed, "forward", None)) in PATCH_EMBED_FORWARD
        and _base.fingerprint(getattr(unroll, "forward", None)) in UNROLL_FORWARD
        and _base.fingerprint(masked_conv) in DO_MASKED_CONV
        and _base.fingerprint(resized_mask) in GET_RESIZED_MASK
    )
    return (embed, unroll) if known else None


def _embed_kept_units(self, x, unit_mask, keep_idx, kept_classes) -> Optional[torch.Tensor]:
    """Patch + position embedding of the kept tokens only (ops/patch_embed.py), in the order FAIR's
    unroll + keep leaves them: (B, mu_size * n_keep, C). None when that path does not apply."""
    if not (patch_embed.kept_only and kept_classes is not None):
        return None
    embed_cls, unroll_cls = kept_classes
    if type(self.patch_embed) is not embed_cls or type(self.unroll) is not unroll_cls:
        return None
    conv = self.patch_embed.proj
    pos_embed = self.get_pos_embed()
    num_tokens = math.prod(self.tokens_spatial_shape)
    if not patch_embed.usable(conv) or pos_embed.shape[-2:] != (num_tokens, conv.out_channels):
        return None
    token_ids = patch_embed.kept_token_ids(self.unroll, num_tokens, keep_idx, math.prod(self.mask_spatial_shape))
    # FAIR's get_resized_mask + do_masked_conv: nearest-resized unit mask, as bool, on the pixels
    pixel_keep = unit_mask
    if tuple(unit_mask.shape[2:]) != tuple(x.shape[2:]):
        pixel_keep = F.interpolate(unit_mask.float(), size=x.shape[2:])
    tokens = patch_embed.embed_tokens(x, pixel_keep.bool(), conv, token_ids, self.tokens_spatial_shape)
    return tokens + patch_embed.position_rows(pos_embed, token_ids)  # (B, mu * n_keep, C)


def encode(self, x, mask: Optional[torch.Tensor], n_keep: Optional[int], return_intermediates: bool,
           kept_classes: Optional[tuple] = None):
    """FAIR's Hiera.forward with the masked units dropped by a gather of static length ``n_keep``."""
    if isinstance(x, list):  # slowfast training passes a list
        x = x[0]
    intermediates = []
    unit_mask = None if mask is None else mask.view(x.shape[0], 1, *self.mask_spatial_shape)
    kept = None
    if mask is not None:
        keep_idx = masking.true_indices(mask, n_keep)  # (B, n_keep)
        kept = _embed_kept_units(self, x, unit_mask, keep_idx, kept_classes)
    if kept is not None:
        x = kept  # (B, mu_size * n_keep, C)
    else:
        x = self.patch_embed(x, mask=unit_mask)  # (B, N, C)
        x = x + self.get_pos_embed()
        x = self.unroll(x)  # (B, N, C), mask unit index fastest
        if mask is not None:
            x = masking.keep_mask_units(x, keep_idx, mask.shape[1])  # (B, mu_size * n_keep, C)
    for i, block in enumerate(self.blocks):
        x = block(x)
        if return_intermediates and i in self.stage_ends:
            intermediates.append(self.reroll(x, i, mask=mask))
    if mask is None:
        x = self.head(self.norm(x.mean(dim=1)))
    if return_intermediates:
        return x, intermediates
    return x


def make_hiera_forward(original: Callable, cls: type) -> Callable:
    kept_classes = kept_embed_classes(_module_of(cls))

    def hiera_forward(self, x, mask=None, return_intermediates=False):
        """FAIR's Hiera.forward; a given mask is read once to learn its (equal) keep count."""
        n_keep = None if mask is None else masking.keep_count(mask)
        return encode(self, x, mask, n_keep, return_intermediates, kept_classes)

    return hiera_forward


# --- MAE -------------------------------------------------------------------------------------


def _module_of(cls: type):
    return sys.modules[cls.__module__]


def _forward_base(cls: type) -> Optional[type]:
    """The class whose ``forward`` ``super().forward`` means inside a method defined on ``cls``."""
    for base in cls.__mro__[1:]:
        if "forward" in base.__dict__:
            return base
    return None


def _super_forward(cls: type) -> Optional[Callable]:
    base = _forward_base(cls)
    return None if base is None else base.__dict__["forward"]


def check_encoder_parts(cls: type, module) -> Optional[str]:
    reason = _base.method_matches(cls, "get_random_mask", GET_RANDOM_MASK)
    if reason:
        return reason
    if _base.fingerprint(_super_forward(cls)) not in HIERA_FORWARD:
        return f"super().forward of {cls.__name__} is not FAIR's Hiera.forward"
    return _base.function_matches(module, "apply_fusion_head", APPLY_FUSION_HEAD)


def make_mae_forward_encoder(original: Callable, cls: type) -> Callable:
    fair_random_mask = cls.get_random_mask  # checked at patch time; checked again per call
    apply_fusion_head = _module_of(cls).apply_fusion_head  # FAIR's (checked), already static
    kept_classes = kept_embed_classes(_module_of(_forward_base(cls)))  # the Hiera module's

    def random_mask(self, x, mask_ratio):
        """FAIR's random mask (same RNG use) and its keep count, known without reading the mask."""
        mask = self.get_random_mask(x, mask_ratio)  # (B, #MUs)
        if type(self).get_random_mask is fair_random_mask:
            return mask, masking.static_keep_count(mask.shape[1], mask_ratio)
        return mask, masking.keep_count(mask)  # a subclass's own masking: count it

    def mask_draw(self, mask_ratio) -> Optional[Tuple[step_graph.MaskDraw, int]]:
        """FAIR's random mask as our forward graph draws it itself, and its keep count; None where
        a subclass masks its own way."""
        if type(self).get_random_mask is not fair_random_mask:
            return None
        num_units = math.prod(self.mask_spatial_shape)  # as get_random_mask's num_windows
        draw = step_graph.MaskDraw(lambda module, x: fair_random_mask(module, x, mask_ratio), (mask_ratio,))
        return draw, masking.static_keep_count(num_units, mask_ratio)

    def encode_kept(self, x, mask, n_keep: int):
        """Encoder features of the ``n_keep`` visible units, fused across scales."""
        _, intermediates = encode(self, x, mask, n_keep, True, kept_classes)
        # resolution is unchanged after the q_pool stages, so their features are skipped
        intermediates = intermediates[: self.q_pool] + intermediates[-1:]
        fused = 0.0
        for head, features in zip(self.multi_scale_fusion_heads, intermediates):
            if fusion_head.as_matmul and fusion_head.usable(head, features):
                fused = fused + fusion_head.patchify_head(head, features)  # (B, n_keep, *unit_final, C)
            else:
                fused = fused + apply_fusion_head(head, features)
        return self.encoder_norm(fused)

    def mae_forward_encoder(self, x, mask_ratio, mask=None):
        """FAIR's forward_encoder, with the masked units dropped by a static gather."""
        if mask is None:
            mask, n_keep = random_mask(self, x, mask_ratio)
        else:
            n_keep = masking.keep_count(mask)
        return encode_kept(self, x, mask, n_keep), mask

    mae_forward_encoder.random_mask = random_mask
    mae_forward_encoder.mask_draw = mask_draw
    mae_forward_encoder.encode_kept = encode_kept
    return mae_forward_encoder


def make_mae_forward_decoder(original: Callable, cls: type) -> Callable:
    undo_windowing = _module_of(cls).undo_windowing  # FAIR's (checked): views and a permute

    def decoder_tokens(self, x, mask):
        """Decoder input: visible units scattered among mask tokens, in spatial order, plus the
        position embedding -> (B, #tokens, C), and the keep mask at token resolution (B, #tokens)."""
        x = self.decoder_embed(x)  # (B, n_keep, *unit_final, C)
        keep_idx = masking.true_indices(mask, x.shape[1])  # (B, n_keep)
        x = masking.place_mask_units(x, keep_idx, mask.shape[1], self.mask_token.view(-1))
        # (B, #MUs, *unit_final, C) -> (B, *tokens_final, C) -> (B, #tokens, C)
        tokens_shape, unit_shape = self.tokens_spatial_shape_final, self.mask_unit_spatial_shape_final
        x = undo_windowing(x, tokens_shape, unit_shape)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        # (B, #MUs) keep mask -> (B, #MUs, *unit_final, 1) -> (B, #tokens), spatial order
        pred_mask = mask.view(*mask.shape, *[1] * (len(unit_shape) + 1)).expand(*mask.shape, *unit_shape, 1)
        pred_mask = undo_windowing(pred_mask, tokens_shape, unit_shape).reshape(x.shape[0], -1)
        return x + self.decoder_pos_embed, pred_mask

    def mae_forward_decoder(self, x, mask):
        """FAIR's forward_decoder; visible units are placed with a scatter instead of x_dec[mask]."""
        x, pred_mask = decoder_tokens(self, x, mask)
        for block in self.decoder_blocks:
            x = block(x)
        x = self.decoder_pred(self.decoder_norm(x))  # (B, #tokens, pixels per token)
        return x, pred_mask

    def predicts_rows(self) -> bool:
        """``predict_masked`` gives exactly the rows of forward_decoder's prediction it returns:
        the switch is on, the last decoder block is FAIR's with our forward and a token-wise MLP
        half, and the norm and head are a plain LayerNorm and Linear without hooks."""
        if not loss.decoder_rows or len(self.decoder_blocks) == 0:
            return False
        last = self.decoder_blocks[-1]
        block_forward = type(last).forward
        return (
            getattr(block_forward, _base.MARKER, None) == "fair.block"
            and last.dim == last.dim_out
            and block_forward.rowwise_mlp_residual(last)
            and type(self.decoder_norm) is torch.nn.LayerNorm
            and type(self.decoder_pred) is torch.nn.Linear
            and mlp.no_hooks(self.decoder_norm, self.decoder_pred)
        )

    def predict_masked(self, x, mask, n_masked: int):
        """forward_decoder's prediction at the ``n_masked`` masked tokens of each sample only
        -> (B, n_masked, P), and their token indices (B, n_masked), ascending. Every token goes
        through every attention (each one is a key); the last block's MLP, the norm and the head
        then run only where the loss reads them. Call only where ``predicts_rows`` holds."""
        x, pred_mask = decoder_tokens(self, x, mask)
        masked_idx = masking.true_indices(~pred_mask, n_masked)  # (B, n_masked)
        *blocks, last = self.decoder_blocks
        for block in blocks:
            x = block(x)
        block_forward = type(last).forward
        x = block_forward.attention_residual(last, x)  # (B, #tokens, C)
        x = masking.gather_rows(x, masked_idx)  # (B, n_masked, C)
        x = block_forward.mlp_residual(last, x)
        return self.decoder_pred(self.decoder_norm(x)), masked_idx  # (B, n_masked, P)

    mae_forward_decoder.predicts_rows = predicts_rows
    mae_forward_decoder.predict_masked = predict_masked
    return mae_forward_decoder


def check_pixel_labels(cls: type, module) -> Optional[str]:
    return _base.method_matches(cls, "get_pixel_label_2d", PIXEL_LABEL_2D) or _base.method_matches(
        cls, "get_pixel_label_3d", PIXEL_LABEL_3D
    )


def make_mae_forward_loss(original: Callable, cls: type) -> Callable:
    fair_label_2d, fair_label_3d = cls.get_pixel_label_2d, cls.get_pixel_label_3d

    def fair_targets(self) -> bool:
        """The targets are FAIR's pixels: no subclass changed them."""
        owner = type(self)
        return owner.get_pixel_label_2d is fair_label_2d and owner.get_pixel_label_3d is fair_label_3d

    def rows_loss(self, x, pred, masked_idx, pred_is_masked: bool = False):
        """FAIR's (loss, pred[mask], label[mask]) at ``masked_idx`` (B, n); ``fair_targets`` holds."""
        dims = len(self.q_stride)
        if dims == 2:
            patches = loss.pixel_patches_2d(x, self.pred_stride)
        elif dims == 3:
            patches = loss.pixel_patches_3d(x, self.pred_stride, self.patch_stride[0])
        else:
            raise NotImplementedError  # as FAIR's
        return loss.masked_mse(pred, patches, masked_idx, pred_is_masked=pred_is_masked)

    def static_loss(self, x, pred, mask, n_masked: Optional[int]):
        """FAIR's forward_loss with ``n_masked`` rows per sample; None: read it from the mask."""
        if not fair_targets(self):
            return original(self, x, pred, mask)  # a subclass changed the targets: keep its code
        if n_masked is None:
            n_masked = masking.keep_count(mask, strict=False)
            if n_masked is None:  # unequal counts: FAIR's concatenation of rows still applies
                return original(self, x, pred, mask)
        return rows_loss(self, x, pred, masking.true_indices(mask, n_masked))  # (B, n_masked) rows

    def mae_forward_loss(self, x, pred, mask):
        """FAIR's forward_loss: same (loss, pred[mask], label[mask]), from static gathers."""
        return static_loss(self, x, pred, mask, None)

    mae_forward_loss.fair_targets = fair_targets
    mae_forward_loss.rows_loss = rows_loss
    mae_forward_loss.static_loss = static_loss
    return mae_forward_loss


def make_mae_forward(original: Callable, cls: type) -> Callable:
    encoder, decoder = cls.forward_encoder, cls.forward_decoder  # FAIR's or ours: both recognised
    static_parts = (
        getattr(encoder, _base.MARKER, None) == "fair.mae_encoder"
        and getattr(decoder, _base.MARKER, None) == "fair.mae_decoder"
    )

    def static_step(self, x, mask, n_keep: int):
        """Encoder, decoder and loss with every shape known from ``n_keep``: one static graph."""
        latent = encoder.encode_kept(self, x, mask, n_keep)  # (B, n_keep, *unit_final, C)
        n_masked = (mask.shape[1] - n_keep) * math.prod(self.mask_unit_spatial_shape_final)  # tokens
        forward_loss = type(self).forward_loss
        if decoder.predicts_rows(self) and forward_loss.fair_targets(self):
            pred, masked_idx = decoder.predict_masked(self, latent, mask, n_masked)  # (B, n_masked, P)
            return forward_loss.rows_loss(self, x, pred, masked_idx, pred_is_masked=True)
        pred, pred_mask = decoder(self, latent, mask)  # pred_mask: (B, #tokens), True = keep
        return forward_loss.static_loss(self, x, pred, ~pred_mask, n_masked)

    def mae_forward(self, x, mask_ratio=0.6, mask=None):
        """FAIR's forward. With our encoder, decoder and loss in place, the keep count is known
        up front and the step after the (eager, FAIR-identical) random mask has static shapes; our
        CUDA graphs can draw that mask themselves (``step_graph.mask_in_graph``)."""
        owner = type(self)
        forward_loss = owner.forward_loss
        ours_loss = getattr(forward_loss, _base.MARKER, None) == "fair.mae_loss"
        unchanged = owner.forward_encoder is encoder and owner.forward_decoder is decoder
        if static_parts and unchanged and ours_loss:
            drawn = mask is None and step_graph.mask_in_graph and step_graph.wanted(x)
            draw = encoder.mask_draw(self, mask_ratio) if drawn else None
            if draw is not None:  # the forward graph draws FAIR's mask itself
                return step_graph.run_drawing(static_step, self, x, *draw)
            if mask is None:
                mask, n_keep = encoder.random_mask(self, x, mask_ratio)
            else:
                n_keep = masking.keep_count(mask)
            if step_graph.wanted(x):
                return (*step_graph.run(static_step, self, x, mask, n_keep), mask)
            return (*static_step(self, x, mask, n_keep), mask)
        # Some part is the user's own code: FAIR's orchestration, our loss told the masked count.
        latent, mask = self.forward_encoder(x, mask_ratio, mask=mask)  # (B, n_keep, *unit, C)
        pred, pred_mask = self.forward_decoder(latent, mask)
        if ours_loss and unchanged:
            visible = latent.shape[1] * math.prod(self.mask_unit_spatial_shape_final)
            n_masked = pred_mask.shape[1] - visible
            return (*forward_loss.static_loss(self, x, pred, ~pred_mask, n_masked), mask)
        return (*self.forward_loss(x, pred, ~pred_mask), mask)

    return mae_forward


def check_mae_parts(cls: type, module) -> Optional[str]:
    return (
        _base.method_matches(cls, "forward_encoder", MAE_FORWARD_ENCODER)
        or _base.method_matches(cls, "forward_decoder", MAE_FORWARD_DECODER)
        or _base.method_matches(cls, "forward_loss", MAE_FORWARD_LOSS)
    )


def check_undo_windowing(cls: type, module) -> Optional[str]:
    return _base.function_matches(module, "undo_windowing", UNDO_WINDOWING)


PATCHES = (
    Patch(
        "fair.attention",
        "MaskUnitAttention",
        "forward",
        make_attention_forward,
        MASK_UNIT_ATTENTION_FORWARD,
        summary="4-D q/k/v so SDPA runs a fused kernel",
    ),
    Patch(
        "fair.block",
        "HieraBlock",
        "forward",
        make_block_forward,
        HIERA_BLOCK_FORWARD,
        checks=(check_do_pool,),
        summary="under torch.compile, the MLP saves 1 hidden tensor less for backward (GELU recomputed)",
    ),
    Patch(
        "fair.encoder",
        "Hiera",
        "forward",
        make_hiera_forward,
        HIERA_FORWARD,
        summary="masked units dropped by a gather instead of boolean indexing",
    ),
    Patch(
        "fair.mae_encoder",
        "MaskedAutoencoderHiera",
        "forward_encoder",
        make_mae_forward_encoder,
        MAE_FORWARD_ENCODER,
        checks=(check_encoder_parts,),
        summary="static keep count for FAIR's random mask",
    ),
    Patch(
        "fair.mae_decoder",
        "MaskedAutoencoderHiera",
        "forward_decoder",
        make_mae_forward_decoder,
        MAE_FORWARD_DECODER,
        checks=(check_undo_windowing,),
        summary="scatter of visible units instead of boolean index assignment",
    ),
    Patch(
        "fair.mae_loss",
        "MaskedAutoencoderHiera",
        "forward_loss",
        make_mae_forward_loss,
        MAE_FORWARD_LOSS,
        checks=(check_pixel_labels,),
        summary="pred[mask] / label[mask] by static gathers",
    ),
    Patch(
        "fair.mae_forward",
        "MaskedAutoencoderHiera",
        "forward",
        make_mae_forward,
        MAE_FORWARD,
        checks=(check_mae_parts,),
        summary="passes the static masked count to the loss",
    ),
)
