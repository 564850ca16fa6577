"""MAE pre-training of FAIR's Hiera on synthetic images: a small, self-contained training loop.

    python examples/train_mae.py                                  # CPU: tiny model; GPU: Hiera-B, bf16, batch 128
    python examples/train_mae.py --steps 50 --batch-size 64
    torchrun --nproc-per-node 2 examples/train_mae.py             # DDP (gloo on CPU, nccl on GPU)

Prints samples/s while it trains and, at the end, one JSON line (on rank 0) with the settings,
throughput, the loss of every step, and which module each rank's attention forward comes from.
Seeded: two runs with the same flags draw the same images and the same MAE masks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message="Importing from timm.models.layers is deprecated")
import hiera  # noqa: E402  (FAIR's hiera-transformer; it imports timm.models.layers)

TINY = dict(
    input_size=(64, 64),
    embed_dim=32,
    num_heads=1,
    stages=(1, 1, 2, 1),
    q_pool=2,
    decoder_embed_dim=64,
    decoder_depth=1,
    decoder_num_heads=2,
)
"""A Hiera small enough that a few CPU steps take seconds; same architecture as Hiera-B."""


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mae_hiera_base_224" if cuda else "tiny",
                   help="'tiny' or a hiera factory name, e.g. mae_hiera_base_224 (default: base on GPU, tiny on CPU)")
    p.add_argument("--batch-size", type=int, default=128 if cuda else 8, help="per rank")
    p.add_argument("--steps", type=int, default=30 if cuda else 6, help="timed steps")
    p.add_argument("--warmup", type=int, default=5 if cuda else 1, help="untimed steps first")
    p.add_argument("--dtype", choices=("fp32", "bf16", "amp"), default="bf16" if cuda else "fp32",
                   help="bf16: bf16 parameters; amp: fp32 parameters under bf16 autocast")
    p.add_argument("--mask-ratio", type=float, default=0.6)
    p.add_argument("--lr", type=float, default=1.5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--log-every", type=int, default=10 if cuda else 2)
    return p.parse_args(argv)


def build_model(name: str) -> torch.nn.Module:
    if name == "tiny":
        return hiera.MaskedAutoencoderHiera(**TINY)
    factory = getattr(hiera, name, None)
    if factory is None:
        sys.exit(f"unknown model {name!r}: use 'tiny' or a hiera factory such as mae_hiera_base_224")
    return factory()


def main(argv=None) -> int:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    torch.manual_seed(args.seed)  # same initial weights on every rank; masks come from this RNG
    model = build_model(args.model)
    params_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = model.to(device=device, dtype=params_dtype).train()
    size = tuple(t * s for t, s in zip(model.tokens_spatial_shape, model.patch_stride))  # (H, W) or (T, H, W)
    in_chans = model.patch_embed.proj.in_channels
    if world_size > 1:
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None
        )
    else:
        ddp_model = model
    step_model = torch.compile(ddp_model) if args.compile else ddp_model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)

    # Images from their own generator (seeded per rank), so the MAE masks drawn from the global RNG
    # are the same in any two runs with the same flags.
    data_gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
    batch_shape = (args.batch_size, in_chans, *size)

    def step():
        images = torch.randn(batch_shape, generator=data_gen, device=device, dtype=params_dtype)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "amp"):
            loss = step_model(images, mask_ratio=args.mask_ratio)[0]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    losses = []
    for _ in range(args.warmup):
        losses.append(step())
    sync()
    start = last = time.perf_counter()
    for i in range(1, args.steps + 1):
        losses.append(step())
        if rank == 0 and (i % args.log_every == 0 or i == args.steps):
            sync()
            now = time.perf_counter()
            done = args.log_every if i % args.log_every == 0 else i % args.log_every
            rate = done * args.batch_size * world_size / (now - last)
            print(f"step {i:4d}/{args.steps}  loss {losses[-1].item():.4f}  {rate:,.1f} samples/s", flush=True)
            last = now
    sync()
    elapsed = time.perf_counter() - start

    attention_forward = type(model.blocks[0].attn).forward
    rank_info = {
        "rank": rank,
        "attention_forward_module": attention_forward.__module__,
        "attention_forward_name": attention_forward.__qualname__,
        "attention_class_is_hiera_class": type(model.blocks[0].attn) is hiera.MaskUnitAttention,
    }
    ranks = [rank_info]
    if world_size > 1:
        ranks = [None] * world_size
        dist.all_gather_object(ranks, rank_info)
    if rank == 0:
        result = {
            "model": args.model,
            "device": str(device),
            "dtype": args.dtype,
            "world_size": world_size,
            "batch_size_per_rank": args.batch_size,
            "input_size": list(size),
            "steps": args.steps,
            "warmup": args.warmup,
            "compile": args.compile,
            "ms_per_step": 1000 * elapsed / max(args.steps, 1),
            "samples_per_s": args.steps * args.batch_size * world_size / elapsed if elapsed > 0 else None,
            "losses": [float(x) for x in torch.stack(losses).float().cpu()],
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "torch": torch.__version__,
            "ranks": ranks,
        }
        print(json.dumps(result), flush=True)
    if world_size > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
