"""What every Triton kernel module here shares: triton itself (optional), the interpreter check and
the device guard for launches."""

from __future__ import annotations

import contextlib
import os
from typing import List

import torch

try:  # the kernel modules must import (and their ``supports`` answer False) without triton
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False

try:  # grid dependency control (programmatic dependent launch); absent from older Triton
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except Exception:  # pragma: no cover - depends on the environment
    gdc_wait = gdc_launch_dependents = None

PDL = True
"""Our kernels launched with programmatic dependent launch (Hopper and later, as Inductor's own
kernels in the graphed step): a kernel may be scheduled while the one before it finishes, and waits
(``griddepcontrol.wait``) before it touches memory. On since session 32: in the graphed step timed
in interleaved rounds on an H100 it was faster in both pairs, by a round median of 0.13 and 0.09
ms (27 and 29 of 40 rounds; h100_profile_ln_pdl_mask_interleaved_session32.json,
``scripts/profile_step.py``'s ``+pdl_ours``). Runs one after the other had not resolved it (H100
session 23, H200 session 26). Its GPU equivalence test passed on an H200 (session 26) and an H100
(session 32)."""


def pdl(t: torch.Tensor) -> bool:
    """Launch this tensor's kernels with programmatic dependent launch: ``PDL`` on, a CUDA tensor
    on a GPU of compute capability 9 or later, Triton's grid dependency control present, and not
    in the interpreter."""
    return (PDL and gdc_wait is not None and t.is_cuda and not interpreting()
            and torch.cuda.get_device_capability(t.device)[0] >= 9)


if HAS_TRITON and gdc_wait is not None:

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """First statement of a kernel launched with ``launch_pdl=PDL``: wait until the kernel before
        it has finished and its writes are visible, then let the kernel after it be scheduled."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

elif HAS_TRITON:  # pragma: no cover - old Triton: never launched with PDL (``pdl`` is False)

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        pass


def interpreting() -> bool:
    """TRITON_INTERPRET=1: kernels run on the CPU in Triton's interpreter (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's (multi-GPU, no DDP setup)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def launch_fields(text: str) -> List[int]:
    """A kernel launch's text form (the benchmark scripts' variants), ``AxBxC`` -> [A, B, C]."""
    try:
        fields = [int(v) for v in text.split("x")]
    except ValueError:
        raise ValueError(f"launch {text!r}: positive integers separated by 'x'") from None
    if len(fields) < 2 or min(fields) < 1:
        raise ValueError(f"launch {text!r}: at least two positive integers separated by 'x'")
    return fields
