"""Agent-centric transformer for the INTERACTION dataset (multi-agent, 1 s history / 3 s future @ 10 Hz).

After training, rank 0 reloads the best checkpoint into a fresh model and writes
the test-set submission (one csv per scenario location).

    torchrun --nproc_per_node=4 18_interaction_joint_pred.py --root /data/INTERACTION/processed
"""
import argparse
import csv
import os
import pickle
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

HIST, FUT, MODES = 10, 30, 6


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/INTERACTION/processed")
    p.add_argument("--run-dir", default="/data/INTERACTION/runs/act")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--resume", default="")
    return p.parse_args()


class InteractionScenes(Dataset):
    def __init__(self, root, split):
        with open(os.path.join(root, f"{split}.pkl"), "rb") as f:
            self.scenes = pickle.load(f)
        self.has_future = split != "test"

    def __len__(self):
        return len(self.scenes)

    def __getitem__(self, i):
        s = self.scenes[i]
        out = {"hist": torch.from_numpy(s["hist"]).float(),          # (A, 10, 5) x y vx vy yaw, scene frame
               "lanes": torch.from_numpy(s["lanes"]).float(),        # (L, 16, 2)
               "track_ids": torch.from_numpy(s["track_ids"]).long(),
               "case_id": s["case_id"], "location": s["location"], "origin": torch.from_numpy(s["origin"]).float()}
        if self.has_future:
            out["fut"] = torch.from_numpy(s["fut"]).float()          # (A, 30, 2)
            out["fut_mask"] = torch.from_numpy(s["fut_mask"]).bool()
        return out


def collate(batch):
    B = len(batch)
    A = max(len(b["hist"]) for b in batch)
    L = max(len(b["lanes"]) for b in batch)
    res = {"hist": torch.zeros(B, A, HIST, 5), "amask": torch.zeros(B, A, dtype=torch.bool),
           "lanes": torch.zeros(B, L, 16, 2), "lmask": torch.zeros(B, L, dtype=torch.bool),
           "track_ids": torch.full((B, A), -1, dtype=torch.long), "origin": torch.stack([b["origin"] for b in batch]),
           "case_id": [b["case_id"] for b in batch], "location": [b["location"] for b in batch]}
    if "fut" in batch[0]:
        res["fut"] = torch.zeros(B, A, FUT, 2)
        res["fut_mask"] = torch.zeros(B, A, FUT, dtype=torch.bool)
    for i, b in enumerate(batch):
        a, l = len(b["hist"]), len(b["lanes"])
        res["hist"][i, :a], res["amask"][i, :a], res["track_ids"][i, :a] = b["hist"], True, b["track_ids"]
        res["lanes"][i, :l], res["lmask"][i, :l] = b["lanes"], True
        if "fut" in b:
            res["fut"][i, :a], res["fut_mask"][i, :a] = b["fut"], b["fut_mask"]
    return res


class AgentCentricTransformer(nn.Module):
    def __init__(self, d=128, layers=3):
        super().__init__()
        self.hist_enc = nn.Sequential(nn.Linear(HIST * 5, d), nn.LayerNorm(d), nn.ReLU(), nn.Linear(d, d))
        self.lane_enc = nn.Sequential(nn.Linear(2, d), nn.ReLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList([nn.TransformerDecoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True)
                                     for _ in range(layers)])
        self.a2a = nn.ModuleList([nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True)
                                  for _ in range(layers)])
        self.modes = nn.Parameter(torch.randn(MODES, d) * 0.02)
        self.head = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, FUT * 2))
        self.score = nn.Linear(d, 1)

    def forward(self, hist, amask, lanes, lmask):
        B, A = hist.shape[:2]
        last = hist[:, :, -1, :2]
        rel = hist.clone()
        rel[..., :2] = rel[..., :2] - last[:, :, None]
        a = self.hist_enc(rel.flatten(2)) + self.lane_enc(last)
        l = self.lane_enc(lanes).max(2).values
        for cross, self_attn in zip(self.blocks, self.a2a):
            a = cross(a, l, memory_key_padding_mask=~lmask)
            a = self_attn(a, src_key_padding_mask=~amask)
        h = a[:, :, None] + self.modes
        traj = self.head(h).view(B, A, MODES, FUT, 2).cumsum(3) + last[:, :, None, None]
        return traj, self.score(h).squeeze(-1)


def loss_fn(traj, score, fut, fut_mask, amask):
    valid = amask & fut_mask.any(-1)
    traj, score, fut, m = traj[valid], score[valid], fut[valid], fut_mask[valid].float()
    d = torch.norm(traj - fut[:, None], dim=-1)
    ade = (d * m[:, None]).sum(-1) / m.sum(-1, keepdim=True).clamp(min=1)
    best = ade.argmin(-1)
    sel = traj[torch.arange(len(best), device=best.device), best]
    reg = (F.smooth_l1_loss(sel, fut, reduction="none").sum(-1) * m).sum() / m.sum()
    return reg + F.cross_entropy(score, best)


@torch.no_grad()
def validate(net, loader, dev):
    net.eval()
    s = torch.zeros(3, device=dev, dtype=torch.float64)
    for b in loader:
        traj, _ = net(b["hist"].to(dev), b["amask"].to(dev), b["lanes"].to(dev), b["lmask"].to(dev))
        full = b["amask"].to(dev) & b["fut_mask"].to(dev).all(-1)
        err = torch.norm(traj[full] - b["fut"].to(dev)[full][:, None], dim=-1)
        s += torch.stack([err.mean(-1).min(-1).values.sum(), err[..., -1].min(-1).values.sum(),
                          full.sum().to(s.dtype)]).to(s.dtype)
    dist.all_reduce(s)
    net.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


@torch.no_grad()
def write_submission(ckpt_path, args, dev):
    net = AgentCentricTransformer(args.d_model, args.layers).to(dev)
    net.load_state_dict(torch.load(ckpt_path, map_location=dev)["model"])
    net.eval()
    loader = DataLoader(InteractionScenes(args.root, "test"), args.bs, collate_fn=collate, num_workers=args.workers)
    rows = defaultdict(list)
    for b in loader:
        traj, score = net(b["hist"].to(dev), b["amask"].to(dev), b["lanes"].to(dev), b["lmask"].to(dev))
        prob = score.softmax(-1).cpu().numpy()
        traj = (traj + b["origin"].to(dev)[:, None, None, None]).cpu().numpy()
        for i in range(traj.shape[0]):
            for j in np.nonzero(b["amask"][i].numpy())[0]:
                for t in range(FUT):
                    row = [b["case_id"][i], int(b["track_ids"][i, j]), 100 * (HIST + t + 1)]
                    for k in range(MODES):
                        row += [float(traj[i, j, k, t, 0]), float(traj[i, j, k, t, 1])]
                    rows[b["location"][i]].append(row + prob[i, j].tolist())
    out_dir = os.path.join(args.run_dir, "submission")
    os.makedirs(out_dir, exist_ok=True)
    for loc, rs in rows.items():
        with open(os.path.join(out_dir, f"{loc}_sub.csv"), "w", newline="") as f:
            csv.writer(f).writerows(rs)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    tr, va = InteractionScenes(args.root, "train"), InteractionScenes(args.root, "val")
    sampler = DistributedSampler(tr, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr, args.bs, sampler=sampler, collate_fn=collate, num_workers=args.workers,
                       pin_memory=True, drop_last=True)
    va_dl = DataLoader(torch.utils.data.Subset(va, range(rank, len(va), world)), args.bs, collate_fn=collate,
                       num_workers=args.workers)

    model = DDP(AgentCentricTransformer(args.d_model, args.layers).to(dev), device_ids=[local_rank])
    lr = args.lr * world * args.bs / 128
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=lr * 0.01)
    start, best = 0, float("inf")
    if args.resume:
        ck = torch.load(args.resume, map_location=dev)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best = ck["epoch"] + 1, ck["best"]
    if rank == 0:
        os.makedirs(args.run_dir, exist_ok=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for b in tr_dl:
            traj, score = model(b["hist"].to(dev, non_blocking=True), b["amask"].to(dev, non_blocking=True),
                                b["lanes"].to(dev, non_blocking=True), b["lmask"].to(dev, non_blocking=True))
            loss = loss_fn(traj, score, b["fut"].to(dev), b["fut_mask"].to(dev), b["amask"].to(dev))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        sched.step()

        ade, fde = validate(model.module, va_dl, dev)
        if rank == 0:
            print(f"epoch {epoch} minADE6 {ade:.3f} minFDE6 {fde:.3f} ({time.time() - t0:.0f}s)", flush=True)
            ck = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                  "epoch": epoch, "best": min(best, fde)}
            torch.save(ck, os.path.join(args.run_dir, "last.pt"))
            if fde < best:
                torch.save(ck, os.path.join(args.run_dir, "best.pt"))
        best = min(best, fde)
        dist.barrier()

    if rank == 0:
        write_submission(os.path.join(args.run_dir, "best.pt"), args, dev)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
