"""MultiPath++-lite on Argoverse 2 motion forecasting: context-gating encoders, learned anchors,
Laplace mixture head. Reports minADE6 / minFDE6 / MR6 / brier-minFDE6 on the val split.

    torchrun --nproc_per_node=8 15_multipathpp_lite_av2.py --data-root /data/av2_mf_cache
"""
import argparse
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

OBS, PRED, K = 50, 60, 6


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/data/av2_mf_cache")
    p.add_argument("--output-dir", default="outputs/mpp_lite")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=4e-4, help="for global batch 256")
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class AV2Cache(Dataset):
    """npz per scenario, focal-agent frame: agents (A, 50, 6), lanes (L, 20, 3), focal future (60, 2)."""

    def __init__(self, root, split):
        self.files = sorted(Path(root, split).glob("*.npz"))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        z = np.load(self.files[i])
        return torch.from_numpy(z["agents"]).float(), torch.from_numpy(z["lanes"]).float(), \
            torch.from_numpy(z["focal_future"]).float()


def collate(batch):
    A = max(b[0].shape[0] for b in batch)
    L = max(b[1].shape[0] for b in batch)
    agents = torch.zeros(len(batch), A, OBS, 6)
    lanes = torch.zeros(len(batch), L, 20, 3)
    am = torch.zeros(len(batch), A, dtype=torch.bool)
    lm = torch.zeros(len(batch), L, dtype=torch.bool)
    for i, (a, l, _) in enumerate(batch):
        agents[i, : len(a)], am[i, : len(a)] = a, True
        lanes[i, : len(l)], lm[i, : len(l)] = l, True
    return agents, am, lanes, lm, torch.stack([b[2] for b in batch])


class ContextGating(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.s = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.ReLU())
        self.c = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.ReLU())

    def forward(self, s, c, mask):
        # s: (B, N, d) elements, c: (B, d) context
        s = self.s(s) * self.c(c)[:, None]
        c_new = s.masked_fill(~mask[..., None], -1e4).max(1).values
        return s, c_new


class MultiPathPPLite(nn.Module):
    def __init__(self, d=128):
        super().__init__()
        self.agent_gru = nn.GRU(6, d, batch_first=True)
        self.lane_pt = nn.Sequential(nn.Linear(3, d), nn.ReLU(), nn.Linear(d, d))
        self.focal_mlp = nn.Sequential(nn.Linear(OBS * 6, d), nn.ReLU(), nn.Linear(d, d))
        self.agent_cg = nn.ModuleList([ContextGating(d) for _ in range(2)])
        self.lane_cg = nn.ModuleList([ContextGating(d) for _ in range(2)])
        self.anchors = nn.Parameter(torch.randn(K, d) * 0.1)
        self.decoder = nn.Sequential(nn.Linear(4 * d, 2 * d), nn.ReLU(), nn.Linear(2 * d, 2 * d), nn.ReLU())
        self.mu = nn.Linear(2 * d, PRED * 2)
        self.log_b = nn.Linear(2 * d, PRED * 2)
        self.logit = nn.Linear(2 * d, 1)

    def forward(self, agents, am, lanes, lm):
        B, A = agents.shape[:2]
        _, h = self.agent_gru(agents.flatten(0, 1))
        a_tok = h[-1].view(B, A, -1)
        l_tok = self.lane_pt(lanes).max(2).values
        ctx = self.focal_mlp(agents[:, 0].flatten(1))
        a_ctx = l_ctx = ctx
        for cg in self.agent_cg:
            a_tok, a_ctx = cg(a_tok, a_ctx, am)
        for cg in self.lane_cg:
            l_tok, l_ctx = cg(l_tok, l_ctx, lm)
        fused = torch.cat([ctx, a_ctx, l_ctx], -1)
        h = self.decoder(torch.cat([fused[:, None].expand(-1, K, -1), self.anchors.expand(B, -1, -1)], -1))
        return (self.mu(h).view(B, K, PRED, 2).cumsum(2), self.log_b(h).view(B, K, PRED, 2).clamp(-5, 5),
                self.logit(h).squeeze(-1))


def laplace_wta_loss(mu, log_b, logits, gt):
    fde = torch.norm(mu[:, :, -1] - gt[:, None, -1], dim=-1)
    ade = torch.norm(mu - gt[:, None], dim=-1).mean(-1)
    best = (ade + fde).argmin(1)
    ar = torch.arange(len(best), device=gt.device)
    m, lb = mu[ar, best], log_b[ar, best]
    nll = (lb + (gt - m).abs() * torch.exp(-lb)).mean()
    return nll + F.cross_entropy(logits, best)


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    ade_sum = fde_sum = miss = brier = 0.0
    count = 0
    for agents, am, lanes, lm, fut in loader:
        mu, _, logits = net(agents.to(device), am.to(device), lanes.to(device), lm.to(device))
        fut = fut.to(device)
        prob = logits.softmax(-1)
        err = torch.norm(mu - fut[:, None], dim=-1)
        fde_k = err[..., -1]
        best = fde_k.argmin(-1)
        ar = torch.arange(len(best), device=device)
        ade_sum += err.mean(-1)[ar, best].sum().item()
        fde_sum += fde_k[ar, best].sum().item()
        miss += (fde_k[ar, best] > 2.0).sum().item()
        brier += (fde_k[ar, best] + (1 - prob[ar, best]) ** 2).sum().item()
        count += len(fut)
    stats = torch.tensor([ade_sum, fde_sum, miss, brier, count], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    net.train()
    n = stats[4].item()
    return {"minADE6": stats[0].item() / n, "minFDE6": stats[1].item() / n, "MR6": stats[2].item() / n,
            "brier-minFDE6": stats[3].item() / n}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set, val_set = AV2Cache(args.data_root, "train"), AV2Cache(args.data_root, "val")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)), args.batch_size,
                            collate_fn=collate, num_workers=args.workers)

    net = MultiPathPPLite(args.dim).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps = len(train_loader)
    warm, total = args.warmup_epochs * steps, args.epochs * steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for agents, am, lanes, lm, fut in train_loader:
            agents, am = agents.to(device, non_blocking=True), am.to(device, non_blocking=True)
            lanes, lm = lanes.to(device, non_blocking=True), lm.to(device, non_blocking=True)
            fut = fut.to(device, non_blocking=True)
            mu, log_b, logits = model(agents, am, lanes, lm)
            loss = laplace_wta_loss(mu, log_b, logits, fut)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_acc)

        metrics = validate(net, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} train {(loss_acc[0] / loss_acc[1]).item():.4f} "
                  + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()) + f" ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.output_dir, "last.ckpt"))
            if metrics["brier-minFDE6"] < best:
                best = metrics["brier-minFDE6"]
                torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.output_dir, "best.ckpt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
