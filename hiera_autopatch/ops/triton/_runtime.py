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
