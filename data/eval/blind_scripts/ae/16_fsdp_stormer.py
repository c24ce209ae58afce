"""Stormer-style weather transformer (randomised lead-time conditioning) trained with FSDP.

    srun -N 4 --ntasks-per-node=1 --gpus-per-node=8 bash -c \
      'torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 --rdzv_id=$SLURM_JOB_ID \
       --rdzv_backend=c10d --rdzv_endpoint=$(scontrol show hostnames $SLURM_NODELIST | head -n1):29400 \
       16_fsdp_stormer.py --config configs/stormer_1.40625.yaml'
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
import torch.nn.functional as F
import yaml
from torch.distributed.fsdp import (BackwardPrefetch, FullStateDictConfig,
                                    FullyShardedDataParallel as FSDP, MixedPrecision,
                                    StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class NpyShardDataset(Dataset):
    """Pre-normalised hourly snapshots stored as one .npy per year: [T, C, H, W]."""

    def __init__(self, root, years, lead_times):
        self.arrays = [np.load(os.path.join(root, f"{y}.npy"), mmap_mode="r") for y in years]
        self.max_lead = max(lead_times)
        self.lead_times = lead_times
        self.index = [(a, t) for a, arr in enumerate(self.arrays)
                      for t in range(arr.shape[0] - self.max_lead)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        a, t = self.index[i]
        lead = self.lead_times[np.random.randint(len(self.lead_times))]
        x = torch.from_numpy(np.ascontiguousarray(self.arrays[a][t]))
        y = torch.from_numpy(np.ascontiguousarray(self.arrays[a][t + lead]))
        return x, y, torch.tensor(lead, dtype=torch.float32)


class AdaLNBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * dim, dim))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c):
        s1, b1, g1, s2, b2, g2 = self.ada(c).unsqueeze(1).chunk(6, dim=-1)
        h = self.norm1(x) * (1 + s1) + b1
        x = x + g1 * self.attn(h, h, h, need_weights=False)[0]
        h = self.norm2(x) * (1 + s2) + b2
        return x + g2 * self.mlp(h)


class Stormer(nn.Module):
    def __init__(self, channels, img, patch, dim, depth, heads):
        super().__init__()
        self.c, self.p = channels, patch
        self.gh, self.gw = img[0] // patch, img[1] // patch
        self.embed = nn.Conv2d(channels, dim, patch, patch)
        self.pos = nn.Parameter(torch.randn(1, self.gh * self.gw, dim) * 0.02)
        self.lead_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(AdaLNBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, channels * patch * patch)

    def forward(self, x, lead):
        b = x.size(0)
        c = self.lead_embed(lead.view(-1, 1) / 100.0)
        h = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        for blk in self.blocks:
            h = blk(h, c)
        h = self.head(self.norm(h)).view(b, self.gh, self.gw, self.c, self.p, self.p)
        h = h.permute(0, 3, 1, 4, 2, 5).reshape(b, self.c, self.gh * self.p, self.gw * self.p)
        return x + h


def cosine_warmup(step, warmup, total):
    if step < warmup:
        return step / max(1, warmup)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))
    np.random.seed(cfg.get("seed", 0) + rank)  # lead-time draws differ per rank

    lat = np.load(os.path.join(cfg["data_root"], "lat.npy"))
    w_lat = torch.tensor(np.cos(np.deg2rad(lat)) / np.cos(np.deg2rad(lat)).mean(),
                         dtype=torch.float32, device=device).view(1, 1, -1, 1)
    train_ds = NpyShardDataset(cfg["data_root"], cfg["train_years"], cfg["lead_times"])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler,
                        num_workers=cfg.get("workers", 8), pin_memory=True, drop_last=True,
                        persistent_workers=True,
                        worker_init_fn=lambda w: np.random.seed(np.random.get_state()[1][0] + w))

    model = Stormer(cfg["channels"], tuple(cfg["img_size"]), cfg["patch"], cfg["dim"],
                    cfg["depth"], cfg["heads"])
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={AdaLNBlock})
    model = FSDP(model, auto_wrap_policy=policy, device_id=device,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32),
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE, limit_all_gathers=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95),
                            weight_decay=cfg.get("weight_decay", 1e-5))
    total = cfg["epochs"] * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: cosine_warmup(s, cfg.get("warmup_steps", 1000), total))

    save_policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    out_dir = cfg["out_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        print(f"{world} GPUs, {len(loader)} steps/epoch, {total} total", flush=True)

    step = 0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, y, lead in loader:
            x, y, lead = (t.to(device, non_blocking=True) for t in (x, y, lead))
            pred = model(x, lead)
            loss = (F.mse_loss(pred.float(), y, reduction="none") * w_lat).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(cfg.get("clip", 1.0))
            opt.step()
            sched.step()
            step += 1
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
            if step % 100 == 0 and rank == 0:
                print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
        dist.all_reduce(acc)

        if rank == 0:
            print(f"epoch {epoch} mean loss {(acc[0] / acc[1]).item():.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if (epoch + 1) % cfg.get("save_every", 1) == 0:
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_policy):
                    cpu_state = model.state_dict()
                torch.save({"model": cpu_state, "epoch": epoch, "cfg": cfg},
                           os.path.join(out_dir, f"stormer_ep{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
