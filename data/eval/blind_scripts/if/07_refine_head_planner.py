"""Imitation-learned ego planner for nuPlan with a two-stage (propose -> refine) trajectory decoder.

Stage 1 regresses K candidate ego plans from the scene encoding; from `refine_start_epoch` on, a
refinement decoder attends from the selected plan back to the scene and predicts residuals.

    torchrun --nproc_per_node=8 07_refine_head_planner.py --cache /lustre/nuplan/cache_planner_v2 \
        --exp-dir /lustre/exp/planner_refine
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

PLAN_STEPS = 80  # 8 s @ 10 Hz
HIST_STEPS = 21


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--cache", required=True)
    p.add_argument("--exp-dir", required=True)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--refine-start-epoch", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--num-plans", type=int, default=12)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


class PlannerCache(Dataset):
    """Features cached by the nuPlan feature builders: ego history, agents, route-lane polylines, expert plan."""

    def __init__(self, root, split):
        self.files = np.loadtxt(os.path.join(root, f"{split}_tokens.txt"), dtype=str)
        self.root = root

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(os.path.join(self.root, "features", self.files[i] + ".npz"))
        return {
            "ego_hist": torch.from_numpy(d["ego_hist"].astype(np.float32)),  # [21, 7]
            "agents": torch.from_numpy(d["agents"].astype(np.float32)),  # [64, 21, 8]
            "agents_mask": torch.from_numpy(d["agents_mask"]),  # [64]
            "lanes": torch.from_numpy(d["lanes"].astype(np.float32)),  # [192, 20, 6]
            "lanes_mask": torch.from_numpy(d["lanes_mask"]),  # [192]
            "on_route": torch.from_numpy(d["on_route"].astype(np.float32)),  # [192]
            "expert": torch.from_numpy(d["expert_plan"].astype(np.float32)),  # [80, 3] x, y, yaw
        }


class SceneEncoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ego = nn.Sequential(nn.Linear(HIST_STEPS * 7, dim), nn.GELU(), nn.Linear(dim, dim))
        self.agent = nn.Sequential(nn.Linear(HIST_STEPS * 8, dim), nn.GELU(), nn.Linear(dim, dim))
        self.lane_pt = nn.Sequential(nn.Linear(6, dim), nn.GELU(), nn.Linear(dim, dim))
        self.route_emb = nn.Linear(1, dim)
        layer = nn.TransformerEncoderLayer(dim, 8, 4 * dim, 0.1, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 4)

    def forward(self, b):
        ego = self.ego(b["ego_hist"].flatten(1))[:, None]
        agents = self.agent(b["agents"].flatten(2))
        lanes = self.lane_pt(b["lanes"]).max(2).values + self.route_emb(b["on_route"][..., None])
        x = torch.cat([ego, agents, lanes], 1)
        ones = torch.ones_like(b["agents_mask"][:, :1])
        pad = ~torch.cat([ones, b["agents_mask"], b["lanes_mask"]], 1)
        return self.blocks(x, src_key_padding_mask=pad), pad


class ProposalHead(nn.Module):
    def __init__(self, dim, k):
        super().__init__()
        self.k = k
        self.queries = nn.Parameter(torch.randn(k, dim) * 0.02)
        self.attn = nn.MultiheadAttention(dim, 8, batch_first=True)
        self.traj = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, PLAN_STEPS * 3))
        self.score = nn.Linear(dim, 1)

    def forward(self, scene, pad):
        q = self.queries[None].expand(scene.shape[0], -1, -1) + scene[:, :1]
        h = q + self.attn(q, scene, scene, key_padding_mask=pad)[0]
        return self.traj(h).view(-1, self.k, PLAN_STEPS, 3), self.score(h).squeeze(-1)


class RefineHead(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.plan_in = nn.Sequential(nn.Linear(3, dim), nn.GELU(), nn.Linear(dim, dim))
        self.step_emb = nn.Parameter(torch.zeros(PLAN_STEPS, dim))
        self.attn = nn.MultiheadAttention(dim, 8, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, 3)

    def forward(self, plan, scene, pad):
        q = self.plan_in(plan) + self.step_emb
        h = self.norm(q + self.attn(q, scene, scene, key_padding_mask=pad)[0])
        return plan + self.out(h)


class TwoStagePlanner(nn.Module):
    def __init__(self, dim, k):
        super().__init__()
        self.encoder = SceneEncoder(dim)
        self.proposals = ProposalHead(dim, k)
        self.refiner = RefineHead(dim)

    def forward(self, b, refine=True):
        scene, pad = self.encoder(b)
        trajs, scores = self.proposals(scene, pad)
        best = trajs[torch.arange(len(scores)), scores.argmax(-1)]
        refined = self.refiner(best.detach(), scene, pad) if refine else None
        return trajs, scores, refined


def planning_loss(trajs, scores, refined, expert):
    err = (trajs[..., :2] - expert[:, None, :, :2]).norm(dim=-1).mean(-1)  # [B, K]
    tgt = err.argmin(-1)
    r = torch.arange(len(tgt), device=trajs.device)
    reg = F.smooth_l1_loss(trajs[r, tgt], expert)
    cls = F.cross_entropy(scores, tgt)
    loss = reg + cls
    if refined is not None:
        loss = loss + F.smooth_l1_loss(refined, expert)
    return loss


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    train_ds, val_ds = PlannerCache(args.cache, "train"), PlannerCache(args.cache, "val")
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    tr_loader = DataLoader(train_ds, args.batch_size, sampler=tr_sampler, num_workers=args.workers,
                           pin_memory=True, drop_last=True, persistent_workers=True)
    va_loader = DataLoader(val_ds, args.batch_size, sampler=va_sampler, num_workers=args.workers)

    model = DDP(TwoStagePlanner(args.dim, args.num_plans).to(dev), device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    iters = len(tr_loader)
    warm = args.warmup_epochs * iters
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + np.cos(np.pi * (s - warm) / (args.epochs * iters - warm))))

    writer = SummaryWriter(os.path.join(args.exp_dir, "tb")) if rank == 0 else None
    best_fde = float("inf")
    step = 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        use_refine = epoch >= args.refine_start_epoch
        tic = time.time()
        for b in tr_loader:
            b = {k: v.to(dev, non_blocking=True) for k, v in b.items()}
            trajs, scores, refined = model(b, refine=use_refine)
            loss = planning_loss(trajs, scores, refined, b["expert"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            step += 1
            if writer is not None and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

        model.eval()
        stats = torch.zeros(4, device=dev)
        with torch.no_grad():
            for b in va_loader:
                b = {k: v.to(dev, non_blocking=True) for k, v in b.items()}
                trajs, scores, refined = model.module(b, refine=use_refine)
                plan = refined if refined is not None else trajs[torch.arange(len(scores)), scores.argmax(-1)]
                d = (plan[..., :2] - b["expert"][..., :2]).norm(dim=-1)
                yaw_err = torch.remainder(plan[..., 2] - b["expert"][..., 2] + np.pi, 2 * np.pi) - np.pi
                stats += torch.stack([d.mean(-1).sum(), d[:, -1].sum(), yaw_err.abs()[:, -1].sum(),
                                      torch.tensor(float(len(d)), device=dev)])
        dist.all_reduce(stats)
        ade, fde, ahe = (stats[:3] / stats[3]).tolist()

        if rank == 0:
            print(f"epoch {epoch} refine={use_refine} planADE {ade:.3f} planFDE {fde:.3f} "
                  f"planAHE {ahe:.3f} ({time.time() - tic:.0f}s)", flush=True)
            writer.add_scalar("val/planADE", ade, epoch)
            writer.add_scalar("val/planFDE", fde, epoch)
            os.makedirs(args.exp_dir, exist_ok=True)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(args.exp_dir, "last.pth"))
            if fde < best_fde:
                best_fde = fde
                torch.save(ckpt, os.path.join(args.exp_dir, "best.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
