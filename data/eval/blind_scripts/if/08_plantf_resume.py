"""PlanTF-style transformer planner (nuPlan) with state dropout, trained from a feature cache.

Supports --resume for long runs on the shared cluster (jobs get preempted every 24 h).

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29400 \
        08_plantf_resume.py --cache /shared/nuplan/plantf_cache --out /shared/runs/plantf_4n \
        --resume /shared/runs/plantf_4n/latest.pth
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    p = argparse.ArgumentParser("plantf")
    p.add_argument("--cache", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", default="")
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3, help="base lr for a global batch of 128")
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=int, default=3)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--state-dropout", type=float, default=0.75)
    p.add_argument("--modes", type=int, default=6)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--seed", type=int, default=2024)
    return p


class NuplanFeatureCache(Dataset):
    def __init__(self, root, split):
        with open(os.path.join(root, f"{split}.lst")) as f:
            self.tokens = [l.strip() for l in f if l.strip()]
        self.root = root

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, idx):
        d = torch.load(os.path.join(self.root, "feature", self.tokens[idx] + ".pt"))
        return d  # dict: agent_pos, agent_heading, agent_vel, agent_shape, agent_mask, map_*, ego_future, agent_future


class AgentEncoder(nn.Module):
    def __init__(self, dim, hist=21, state_dropout=0.75):
        super().__init__()
        self.state_dropout = state_dropout
        self.hist_proj = nn.Sequential(nn.Linear((hist - 1) * 4, dim), nn.GELU(), nn.Linear(dim, dim))
        self.ego_state = nn.Sequential(nn.Linear(6, dim), nn.GELU(), nn.Linear(dim, dim))
        self.type_emb = nn.Embedding(4, dim)

    def forward(self, f):
        pos, head = f["agent_pos"], f["agent_heading"]
        disp = pos[:, :, 1:] - pos[:, :, :-1]
        dhead = head[:, :, 1:] - head[:, :, :-1]
        feat = torch.cat([disp, torch.cos(dhead)[..., None], torch.sin(dhead)[..., None]], -1)
        x = self.hist_proj(feat.flatten(2)) + self.type_emb(f["agent_type"])
        # ego token from current kinematic state only, with state dropout against shortcut learning
        ego = torch.cat([f["ego_vel"], f["ego_acc"], f["ego_steer"][..., None], f["ego_yaw_rate"][..., None]], -1)
        if self.training and self.state_dropout > 0:
            keep = (torch.rand(ego.shape[0], 1, device=ego.device) > self.state_dropout).float()
            ego = ego * keep
        x[:, 0] = x[:, 0] + self.ego_state(ego)
        return x


class MapEncoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.pt = nn.Sequential(nn.Linear(8, dim), nn.GELU(), nn.Linear(dim, dim))
        self.kind = nn.Embedding(3, dim)
        self.speed = nn.Linear(1, dim)

    def forward(self, f):
        x = self.pt(f["map_points"]).max(2).values
        return x + self.kind(f["map_type"]) + self.speed(f["map_speed_limit"][..., None])


class PlanningModel(nn.Module):
    def __init__(self, dim=128, depth=4, modes=6, fut=80, state_dropout=0.75):
        super().__init__()
        self.modes, self.fut = modes, fut
        self.agent_enc = AgentEncoder(dim, state_dropout=state_dropout)
        self.map_enc = MapEncoder(dim)
        self.pos = nn.Sequential(nn.Linear(4, dim), nn.GELU(), nn.Linear(dim, dim))
        layer = nn.TransformerEncoderLayer(dim, 8, 4 * dim, 0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.plan_q = nn.Parameter(torch.randn(modes, dim) * 0.02)
        self.plan_attn = nn.MultiheadAttention(dim, 8, batch_first=True)
        self.plan_head = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, fut * 4))
        self.plan_score = nn.Linear(dim, 1)
        self.pred_head = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, fut * 2))

    def forward(self, f):
        a = self.agent_enc(f)
        m = self.map_enc(f)
        a_pos = torch.cat([f["agent_pos"][:, :, -1], torch.cos(f["agent_heading"][:, :, -1:]),
                           torch.sin(f["agent_heading"][:, :, -1:])], -1)
        m_pos = torch.cat([f["map_points"][:, :, 0, :2], f["map_points"][:, :, 0, 2:4]], -1)
        x = torch.cat([a, m], 1) + self.pos(torch.cat([a_pos, m_pos], 1))
        pad = ~torch.cat([f["agent_mask"], f["map_mask"]], 1)
        x = self.encoder(x, src_key_padding_mask=pad)
        B, A = a.shape[:2]
        q = self.plan_q[None].expand(B, -1, -1) + x[:, :1]
        q = q + self.plan_attn(q, x, x, key_padding_mask=pad)[0]
        plan = self.plan_head(q).view(B, self.modes, self.fut, 4)  # x, y, cos, sin
        pred = self.pred_head(x[:, 1:A]).view(B, A - 1, self.fut, 2)
        return plan, self.plan_score(q).squeeze(-1), pred


def compute_loss(plan, score, pred, f):
    gt = f["ego_future"]  # [B, 80, 3]
    gt4 = torch.cat([gt[..., :2], torch.cos(gt[..., 2:]), torch.sin(gt[..., 2:])], -1)
    ade = (plan[..., :2] - gt[:, None, :, :2]).norm(dim=-1).mean(-1)
    best = ade.argmin(-1)
    r = torch.arange(len(best), device=plan.device)
    reg = F.smooth_l1_loss(plan[r, best], gt4)
    cls = F.cross_entropy(score, best)
    am = f["agent_future_mask"][:, 1:]
    pred_loss = (F.smooth_l1_loss(pred, f["agent_future"][:, 1:], reduction="none").sum(-1) * am).sum() / am.sum().clamp(min=1)
    return reg + cls + pred_loss, ade.min(-1).values


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_set = NuplanFeatureCache(args.cache, "train")
    val_set = NuplanFeatureCache(args.cache, "val")
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = PlanningModel(args.dim, modes=args.modes, state_dropout=args.state_dropout).to(device)
    lr = args.lr * args.batch_size * world / 128
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    iters = len(train_loader)
    total, warm = args.epochs * iters, args.warmup_epochs * iters
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    start_epoch = 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}", flush=True)

    model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, f in enumerate(train_loader):
            f = {k: v.to(device, non_blocking=True) for k, v in f.items()}
            plan, score, pred = model(f)
            loss, _ = compute_loss(plan, score, pred, f)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 200 == 0:
                print(f"ep {epoch} [{it}/{iters}] loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}",
                      flush=True)

        model.eval()
        tot = torch.zeros(3, device=device)
        with torch.no_grad():
            for f in val_loader:
                f = {k: v.to(device, non_blocking=True) for k, v in f.items()}
                plan, score, pred = model(f)
                _, min_ade = compute_loss(plan, score, pred, f)
                top = plan[torch.arange(len(score)), score.argmax(-1)]
                fde = (top[:, -1, :2] - f["ego_future"][:, -1, :2]).norm(dim=-1)
                tot += torch.stack([min_ade.sum(), fde.sum(), torch.tensor(float(len(fde)), device=device)])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} val minADE {(tot[0] / tot[2]).item():.3f} "
                  f"top1 FDE {(tot[1] / tot[2]).item():.3f} ({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(args.out, f"epoch_{epoch:02d}.pth"))
            torch.save(state, os.path.join(args.out, "latest.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
