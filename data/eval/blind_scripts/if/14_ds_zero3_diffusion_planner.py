"""Diffusion planner: a DiT-style denoiser over the ego plan and neighbour futures, conditioned on
agent and lane tokens (nuPlan). Trained with DeepSpeed ZeRO-3; an EMA copy is kept for evaluation.

    deepspeed --num_gpus 8 14_ds_zero3_diffusion_planner.py \
        --cache /mnt/fsx/nuplan/diffplan_cache --out /mnt/fsx/exp/diffplan_z3
"""
import argparse
import copy
import math
import os

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

T_PLAN = 80
N_NEIGH = 10
DIFF_STEPS = 1000


class DiffPlanCache(Dataset):
    def __init__(self, root, split):
        self.root = os.path.join(root, split)
        self.files = sorted(os.listdir(self.root))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(os.path.join(self.root, self.files[i]))
        return {
            "agents": torch.from_numpy(d["neighbor_past"].astype(np.float32)),  # [32, 21, 11]
            "lanes": torch.from_numpy(d["lanes"].astype(np.float32)),  # [70, 20, 12]
            "route": torch.from_numpy(d["route_lanes"].astype(np.float32)),  # [25, 20, 12]
            "ego_state": torch.from_numpy(d["ego_current_state"].astype(np.float32)),  # [10]
            "futures": torch.from_numpy(d["futures"].astype(np.float32)),  # [1 + N_NEIGH, 80, 4]
            "futures_valid": torch.from_numpy(d["futures_valid"]),  # [1 + N_NEIGH]
        }


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], -1)


class DiTBlock(nn.Module):
    def __init__(self, d, heads=8):
        super().__init__()
        self.n1 = nn.LayerNorm(d, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.n2 = nn.LayerNorm(d)
        self.cross = nn.MultiheadAttention(d, heads, batch_first=True)
        self.n3 = nn.LayerNorm(d, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))

    def forward(self, x, c, ctx, ctx_pad):
        s1, b1, g1, s2, b2, g2 = self.ada(c)[:, None].chunk(6, -1)
        h = self.n1(x) * (1 + s1) + b1
        x = x + g1 * self.attn(h, h, h, need_weights=False)[0]
        x = x + self.cross(self.n2(x), ctx, ctx, key_padding_mask=ctx_pad, need_weights=False)[0]
        h = self.n3(x) * (1 + s2) + b2
        return x + g2 * self.mlp(h)


class DiffusionPlanner(nn.Module):
    def __init__(self, d=256, depth=8):
        super().__init__()
        self.d = d
        self.agent_enc = nn.Sequential(nn.Linear(21 * 11, d), nn.GELU(), nn.Linear(d, d))
        self.lane_enc = nn.Sequential(nn.Linear(12, d), nn.GELU(), nn.Linear(d, d))
        self.route_enc = nn.Sequential(nn.Linear(12, d), nn.GELU(), nn.Linear(d, d))
        self.ego_enc = nn.Linear(10, d)
        self.traj_in = nn.Linear(T_PLAN * 4, d)
        self.t_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(DiTBlock(d) for _ in range(depth))
        self.out = nn.Linear(d, T_PLAN * 4)

    def forward(self, b, noisy, t):
        a = self.agent_enc(b["agents"].flatten(2))
        ln = self.lane_enc(b["lanes"]).max(2).values
        rt = self.route_enc(b["route"]).max(2).values
        ctx = torch.cat([a, ln, rt], 1)
        ctx_pad = torch.cat([b["agents"].abs().sum((2, 3)) == 0, b["lanes"].abs().sum((2, 3)) == 0,
                             b["route"].abs().sum((2, 3)) == 0], 1)
        ctx_pad[:, 0] = False
        c = self.t_mlp(timestep_embedding(t, self.d)) + self.ego_enc(b["ego_state"])
        x = self.traj_in(noisy.flatten(2))
        for blk in self.blocks:
            x = blk(x, c, ctx, ctx_pad)
        return self.out(x).view_as(noisy)  # predicts x0


def cosine_alphas(steps):
    s = 0.008
    x = torch.linspace(0, steps, steps + 1)
    ac = torch.cos(((x / steps) + s) / (1 + s) * math.pi / 2) ** 2
    return (ac / ac[0])[1:]


@torch.no_grad()
def ema_update(ema_model, model, decay):
    for p_ema, p in zip(ema_model.parameters(), model.parameters()):
        p_ema.mul_(decay).add_(p.detach().to(p_ema.dtype), alpha=1 - decay)


@torch.no_grad()
def ddim_sample(model, b, alphas_cum, steps=10):
    B = b["ego_state"].shape[0]
    x = torch.randn(B, 1 + N_NEIGH, T_PLAN, 4, device=b["ego_state"].device)
    ts = torch.linspace(DIFF_STEPS - 1, 0, steps, device=x.device).long()
    for i, t in enumerate(ts):
        x0 = model(b, x, t.expand(B))
        if i + 1 == len(ts):
            x = x0
            break
        a_t, a_next = alphas_cum[t], alphas_cum[ts[i + 1]]
        eps = (x - a_t.sqrt() * x0) / (1 - a_t).sqrt()
        x = a_next.sqrt() * x0 + (1 - a_next).sqrt() * eps
    return x


def make_ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 5.0,
        "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 1e-2, "betas": [0.9, 0.999]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                                     "warmup_num_steps": 5000}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "stage3_param_persistence_threshold": 1e4},
        "steps_per_print": 1000,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--ema-decay", type=float, default=0.999)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()

    deepspeed.init_distributed()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(3407)
    micro = args.micro_batch

    model = DiffusionPlanner()
    ema = copy.deepcopy(model).to(device).eval()
    for p in ema.parameters():
        p.requires_grad_(False)

    train_ds, val_ds = DiffPlanCache(args.cache, "train"), DiffPlanCache(args.cache, "val")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=micro, sampler=sampler, num_workers=8, pin_memory=True,
                          drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=micro, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                        num_workers=8)

    engine, optimizer, _, lr_sched = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                          config=make_ds_config(args))
    alphas_cum = cosine_alphas(DIFF_STEPS).to(device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for b in train_dl:
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            x0 = b["futures"]
            t = torch.randint(0, DIFF_STEPS, (x0.shape[0],), device=device)
            a = alphas_cum[t][:, None, None, None]
            noisy = a.sqrt() * x0 + (1 - a).sqrt() * torch.randn_like(x0)
            pred = engine(b, noisy, t)
            w = b["futures_valid"].float()[..., None, None]
            loss = (F.mse_loss(pred, x0, reduction="none") * w).sum() / (w.sum() * T_PLAN * 4).clamp(min=1)
            engine.backward(loss)
            engine.step()
            if engine.is_gradient_accumulation_boundary():
                ema_update(ema, engine.module, args.ema_decay)
            if rank == 0 and engine.global_steps % 500 == 0:
                print(f"epoch {epoch} step {engine.global_steps} loss {loss.item():.5f}", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            stats = torch.zeros(3, device=device)
            for b in val_dl:
                b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
                plan = ddim_sample(ema, b, alphas_cum)[:, 0]
                gt = b["futures"][:, 0]
                err = (plan[..., :2] - gt[..., :2]).norm(dim=-1)
                stats += torch.stack([err.mean(-1).sum(), err[:, -1].sum(), torch.tensor(float(len(err)), device=device)])
            dist.all_reduce(stats)
            if rank == 0:
                print(f"epoch {epoch} EMA planner ADE {(stats[0] / stats[2]).item():.3f} "
                      f"FDE {(stats[1] / stats[2]).item():.3f}", flush=True)
                torch.save(ema.state_dict(), os.path.join(args.out, f"ema_ep{epoch}.pt"))
            engine.save_checkpoint(args.out, tag=f"ep{epoch}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
