"""
DiT-XL/2 with DeepSpeed ZeRO-3 + bf16 on cached SD-VAE latents, class-conditional with CFG label dropout.
EMA weights are kept in fp32 on every GPU for sampling.

    deepspeed --num_gpus 8 12_dit_xl_deepspeed.py --latents /data/in256_latents.npy \
        --labels /data/in256_labels.npy --save_dir /shared/ckpt/dit_ds
"""
import argparse
import math
import os
import time
from copy import deepcopy

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class LatentDataset(Dataset):
    def __init__(self, latents, labels):
        self.x = np.load(latents, mmap_mode="r")
        self.y = np.load(labels)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(np.array(self.x[i], dtype=np.float32)), int(self.y[i])


class AdaBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.n1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.n2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.mod = nn.Linear(d, 6 * d)

    def forward(self, x, c):
        B, N, D = x.shape
        s1, k1, g1, s2, k2, g2 = self.mod(F.silu(c))[:, None].chunk(6, -1)
        q, k, v = self.qkv(self.n1(x) * (1 + k1) + s1).view(B, N, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        x = x + g1 * self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D))
        return x + g2 * self.mlp(self.n2(x) * (1 + k2) + s2)


class DiT(nn.Module):
    def __init__(self, size=32, patch=2, ch=4, d=1152, depth=28, heads=16, n_cls=1000):
        super().__init__()
        self.size, self.patch, self.ch, self.n_cls = size, patch, ch, n_cls
        self.x_emb = nn.Conv2d(ch, d, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, (size // patch) ** 2, d))
        self.t_mlp = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d))
        self.y_emb = nn.Embedding(n_cls + 1, d)
        self.blocks = nn.ModuleList(AdaBlock(d, heads) for _ in range(depth))
        self.n_out = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.mod_out = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, patch * patch * ch)
        nn.init.normal_(self.pos, std=0.02)
        for b in self.blocks:
            nn.init.zeros_(b.mod.weight)
            nn.init.zeros_(b.mod.bias)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x, t, y):
        half = 128
        f = torch.exp(-math.log(1e4) * torch.arange(half, device=x.device) / half)
        temb = torch.cat([torch.cos(t[:, None] * f), torch.sin(t[:, None] * f)], -1).to(x.dtype)
        c = self.t_mlp(temb) + self.y_emb(y)
        h = self.x_emb(x).flatten(2).transpose(1, 2) + self.pos
        for b in self.blocks:
            h = b(h, c)
        s, k = self.mod_out(F.silu(c))[:, None].chunk(2, -1)
        h = self.out(self.n_out(h) * (1 + k) + s)
        g, p = self.size // self.patch, self.patch
        h = h.view(-1, g, g, p, p, self.ch).permute(0, 5, 1, 3, 2, 4)
        return h.reshape(-1, self.ch, self.size, self.size)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--latents", required=True)
    p.add_argument("--labels", required=True)
    p.add_argument("--save_dir", required=True)
    p.add_argument("--micro_batch", type=int, default=32)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--ema_decay", type=float, default=0.9999)
    p.add_argument("--p_uncond", type=float, default=0.1)
    p.add_argument("--save_interval", type=int, default=10_000)
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_batch * args.grad_accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 1000,
    }

    torch.manual_seed(args.seed)
    model = DiT()
    ema = deepcopy(model).to(device).requires_grad_(False).eval()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    torch.manual_seed(args.seed + rank)

    abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64), 0).float().to(device)
    data = LatentDataset(args.latents, args.labels)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"{len(data)} samples, global batch {ds_config['train_batch_size']}", flush=True)

    step, tic = 0, time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for x, y in loader:
            x = x.to(device, non_blocking=True).to(torch.bfloat16)
            y = y.to(device, non_blocking=True)
            y = torch.where(torch.rand_like(y, dtype=torch.float) < args.p_uncond, torch.full_like(y, 1000), y)
            t = torch.randint(0, 1000, (x.shape[0],), device=device)
            eps = torch.randn_like(x)
            a = abar[t].view(-1, 1, 1, 1).to(x.dtype)
            pred = engine(a.sqrt() * x + (1 - a).sqrt() * eps, t.float(), y)
            loss = F.mse_loss(pred.float(), eps.float())
            engine.backward(loss)
            engine.step()

            if engine.is_gradient_accumulation_boundary():
                step += 1
                with torch.no_grad():
                    for pe, p in zip(ema.parameters(), engine.module.parameters()):
                        pe.mul_(args.ema_decay).add_(p.detach().float(), alpha=1 - args.ema_decay)

                if step % 100 == 0:
                    l = loss.detach().float()
                    dist.all_reduce(l, op=dist.ReduceOp.AVG)
                    if rank == 0:
                        print(f"ep {epoch} step {step} loss {l.item():.4f} ({100 / (time.time() - tic):.2f} it/s)",
                              flush=True)
                    tic = time.time()

                if step % args.save_interval == 0:
                    engine.save_checkpoint(args.save_dir, tag=f"step{step}")
                    if rank == 0:
                        torch.save(ema.state_dict(), os.path.join(args.save_dir, f"ema_step{step}.pt"))
                    dist.barrier()

    engine.save_checkpoint(args.save_dir, tag="final")
    if rank == 0:
        torch.save(ema.state_dict(), os.path.join(args.save_dir, "ema_final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
