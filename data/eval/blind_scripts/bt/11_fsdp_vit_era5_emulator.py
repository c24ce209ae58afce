"""ViT weather emulator (1.40625 deg, 69 channels) trained with FSDP.

~1.1B parameters: too large for plain DDP with AdamW state on 40GB cards, so the
transformer blocks are sharded with FULL_SHARD, bf16 compute, and non-reentrant
activation checkpointing.

    srun --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 \
        torchrun --nnodes=4 --nproc_per_node=8 --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d \
        --rdzv_endpoint=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1):29500 \
        11_fsdp_vit_era5_emulator.py --data /lus/shared/era5_1p4 --out /lus/shared/runs/vit1b
"""
import argparse
import functools
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--patch", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2, help="per GPU")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--max-steps", type=int, default=150000)
    p.add_argument("--val-every", type=int, default=5000)
    p.add_argument("--ckpt-every", type=int, default=2500)
    return p.parse_args()


class NpyShards(Dataset):
    """Hourly states stored as one (C, 128, 256) float16 .npy per time step; pairs 6 h apart."""

    def __init__(self, root, split, lead_hours=6):
        self.files = sorted(os.path.join(root, split, f) for f in os.listdir(os.path.join(root, split)))
        self.lead = lead_hours
        stats = np.load(os.path.join(root, "normalize_1979_2015.npz"))
        self.mean = stats["mean"][:, None, None].astype(np.float32)
        self.std = stats["std"][:, None, None].astype(np.float32)

    def __len__(self):
        return len(self.files) - self.lead

    def _read(self, i):
        return (np.load(self.files[i]).astype(np.float32) - self.mean) / self.std

    def __getitem__(self, i):
        return torch.from_numpy(self._read(i)), torch.from_numpy(self._read(i + self.lead))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class WeatherViT(nn.Module):
    def __init__(self, channels=69, img=(128, 256), patch=2, dim=2048, depth=20, heads=16):
        super().__init__()
        self.c, self.p = channels, patch
        self.gh, self.gw = img[0] // patch, img[1] // patch
        self.embed = nn.Conv2d(channels, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, self.gh * self.gw, dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, channels * patch * patch)

    def forward(self, x):
        b = x.shape[0]
        h = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        for blk in self.blocks:
            h = blk(h)
        h = self.head(self.norm(h)).view(b, self.gh, self.gw, self.c, self.p, self.p)
        return x + h.permute(0, 3, 1, 4, 2, 5).reshape(b, self.c, self.gh * self.p, self.gw * self.p)


def lat_weights(device):
    lat = torch.linspace(-90 + 0.703125, 90 - 0.703125, 128, device=device)
    w = torch.cos(torch.deg2rad(lat))
    return (w / w.mean()).view(1, 1, -1, 1)


def save_checkpoint(model, optimizer, step, epoch, path, rank):
    # every rank takes part in gathering the full state; only rank 0 ends up with it
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        torch.save({"model": model_state, "optim": optim_state, "step": step, "epoch": epoch}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = NpyShards(args.data, "train")
    val_ds = NpyShards(args.data, "val")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    # the FSDP forward is collective, so every rank needs the same number of val batches
    n_val = (len(range(0, len(val_ds), 24)) // world) * world
    val_idx = list(range(0, len(val_ds), 24))[:n_val][rank::world]
    val_loader = DataLoader(Subset(val_ds, val_idx), batch_size=1, num_workers=2)

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "full_state.pt")
    # mmap: the eight ranks of a node share the page cache instead of each holding a copy
    ckpt = torch.load(ckpt_path, map_location="cpu", mmap=True) if os.path.exists(ckpt_path) else None

    net = WeatherViT(patch=args.patch, dim=args.dim, depth=args.depth, heads=args.heads)
    if ckpt is not None:
        net.load_state_dict(ckpt["model"])
    model = FSDP(
        net,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        device_id=local_rank,
        limit_all_gathers=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block),
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step, epoch = 0, 0
    if ckpt is not None:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=False)):
            osd = FSDP.optim_state_dict_to_load(model=model, optim=optimizer, optim_state_dict=ckpt["optim"])
        optimizer.load_state_dict(osd)
        step, epoch = ckpt["step"], ckpt["epoch"]
        del ckpt

    def lr_at(s):
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        return 0.5 * args.lr * (1 + math.cos(math.pi * min(1.0, (s - args.warmup) / (args.max_steps - args.warmup))))

    w = lat_weights(device)
    tic = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step)
            model.train()
            pred = model(x)
            loss = (w * (pred.float() - y) ** 2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            step += 1

            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"step {step} loss {l.item() / world:.4f} lr {lr_at(step):.2e} "
                          f"{(time.time() - tic) / 100:.2f}s/it", flush=True)
                tic = time.time()
            if step % args.val_every == 0:
                model.eval()
                acc = torch.zeros(2, device=device)
                with torch.no_grad():
                    for vx, vy in val_loader:
                        vx, vy = vx.to(device), vy.to(device)
                        acc[0] += (w * (model(vx).float() - vy) ** 2).mean()
                        acc[1] += 1
                dist.all_reduce(acc)
                if rank == 0:
                    print(f"step {step} val wMSE {(acc[0] / acc[1]).item():.4f}", flush=True)
            if step % args.ckpt_every == 0 or step == args.max_steps:
                save_checkpoint(model, optimizer, step, epoch, ckpt_path, rank)
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
