"""FLOPs of one forward+backward step, FAIR vs patched, counted on the CPU (no GPU needed).

    python scripts/count_flops.py [--model mae_hiera_base_224] [--batch 2] [--json out.json]

Counts what ``torch.utils.flop_counter``'s formulas attribute to matmuls, convolutions and attention in one
training step (fp32, mask ratio 0.6, seeded), per configuration: ``fair`` (unpatched),
``patched`` (hiera_autopatch with ``ops/loss.decoder_rows`` off),
``patched+decoder_rows`` (with it on, the default since; with session 15's aligned patch-embedding
matmul and matmul fusion heads), ``patched+decoder_rows+session14`` (without those two). Each mode
also lists its matmuls with an operand not aligned for cuBLAS's Hopper kernels
(``unaligned_operands``), with their shapes and calls. Elementwise work (LayerNorm, GELU) is not counted, so a FLOP cut is an upper
bound on what it saves in GEMM time and says nothing about bandwidth-bound kernels. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

MODES = ("fair", "patched", "patched+decoder_rows+session14", "patched+decoder_rows")


class FlopCount(TorchDispatchMode):
    """Sums torch's own per-op FLOP formulas (``flop_registry``: matmuls, convolutions, attention).
    torch's FlopCounterMode does the same but tracks modules with global hooks, and our patches
    step aside where a hook could see a difference (``mlp.no_hooks``), so it would count FAIR's path."""

    def __init__(self):
        super().__init__()
        self.by_op: Dict[str, int] = {}
        self.unaligned: Dict[str, int] = {}  # "op shapes" -> calls, see ``unaligned_operands``

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            name = str(func._overloadpacket)
            self.by_op[name] = self.by_op.get(name, 0) + formula(*args, **kwargs, out_val=out)
            if name in MATMULS and unaligned_operands(args):
                key = f"{name} {[list(a.shape) for a in args if isinstance(a, torch.Tensor)]}"
                self.unaligned[key] = self.unaligned.get(key, 0) + 1
        return out


MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")


def unaligned_operands(args) -> bool:
    """A matrix operand whose rows (or columns, if transposed) are not 16 bytes apart in a 2-byte
    dtype: cuBLAS then cannot use its aligned (Hopper) GEMM kernels."""
    matrices = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
    return any(max(a.stride()[-2:]) % 8 for a in matrices)


def count_step(model, x, seed: int = 0) -> FlopCount:
    """FLOPs of forward+backward by aten op (``by_op``), and the unaligned matmuls. SDPA runs its
    math path, so attention is counted as its ``bmm``s (the CPU's fused attention has no FLOP
    formula in torch); Linear layers are ``mm``/``addmm``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with sdpa_kernel(SDPBackend.MATH), FlopCount() as counter:
        loss = model(x)[0]
        loss.backward()
    return counter


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mae_hiera_base_224")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--json", help="also write the JSON here")
    args = parser.parse_args(argv)

    import hiera

    import hiera_autopatch
    from hiera_autopatch.ops import loss as loss_ops

    from hiera_autopatch.ops import fusion_head, patch_embed

    hiera_autopatch.enable()  # patch the classes before building: the same model serves every mode
    torch.manual_seed(0)
    model = getattr(hiera, args.model)().train()
    x = torch.randn(args.batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    results = {"command": " ".join(["python", *sys.argv]), "model": args.model, "batch": args.batch,
               "dtype": "fp32", "step": "forward+backward", "torch": torch.__version__, "modes": {}}
    defaults = loss_ops.decoder_rows, patch_embed.aligned, fusion_head.as_matmul
    for mode in MODES:
        loss_ops.decoder_rows = "+decoder_rows" in mode
        patch_embed.aligned = fusion_head.as_matmul = "+session14" not in mode
        if mode == "fair":
            with hiera_autopatch.disabled():
                counter = count_step(model, x)
        else:
            counter = count_step(model, x)
        total = counter.total
        results["modes"][mode] = {"flop": total, "gflop_per_sample": total / args.batch / 1e9,
                                  "gflop_per_sample_by_op": {op: f / args.batch / 1e9 for op, f in counter.by_op.items()},
                                  "unaligned_matmuls": counter.unaligned}
    loss_ops.decoder_rows, patch_embed.aligned, fusion_head.as_matmul = defaults
    fair_total = results["modes"]["fair"]["flop"]
    for counted in results["modes"].values():
        counted["vs_fair"] = counted["flop"] / fair_total
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
