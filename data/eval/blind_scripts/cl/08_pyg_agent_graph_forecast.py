"""Agent-centric graph forecaster (PyG) on our in-house drive logs.

Logs are converted by `prep/export_scenarios.py` into one .pt per 8 s scenario
(3 s history, 5 s future @ 10 Hz), grouped in folders per drive/scene.

    torchrun --nproc_per_node=4 08_pyg_agent_graph_forecast.py --root /mnt/fleet/scenarios
"""
import argparse
import os
import random
import time
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_geometric.nn import GATv2Conv, TransformerConv

T_HIST, T_FUT, NUM_MODES = 30, 50, 6


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/mnt/fleet/scenarios")
    p.add_argument("--ckpt-dir", default="/mnt/fleet/runs/agent_graph")
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--radius", type=float, default=50.0)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--epochs", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=2023)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class ScenarioGraph(Data):
    def __inc__(self, key, value, *args, **kwargs):
        if key == "a2a_index":
            return self.agent_x.size(0)
        if key == "l2a_index":
            return torch.tensor([[self.lane_x.size(0)], [self.agent_x.size(0)]])
        return super().__inc__(key, value, *args, **kwargs)


class ScenarioDataset(Dataset):
    def __init__(self, files, radius, train):
        self.files = files
        self.radius = radius
        self.train = train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        s = torch.load(self.files[i])
        hist = s["agent_hist"].float()          # (A, 30, 4) x, y, heading, valid  (ego frame at t=0)
        fut = s["agent_fut"].float()            # (A, 50, 2)
        fut_valid = s["agent_fut_valid"].bool()  # (A, 50)
        lanes = s["lane_feats"].float()         # (L, 10, 2) centerline points
        if self.train and random.random() < 0.5:  # mirror the scene about the x axis
            hist[..., 1], hist[..., 2], fut[..., 1], lanes[..., 1] = -hist[..., 1], -hist[..., 2], -fut[..., 1], -lanes[..., 1]
        pos = hist[:, -1, :2]
        lane_pos = lanes.mean(1)
        d_aa = torch.cdist(pos, pos)
        a2a = ((d_aa < self.radius) & ~torch.eye(len(pos), dtype=torch.bool)).nonzero().t()
        l2a = (torch.cdist(lane_pos, pos) < self.radius).nonzero().t()
        disp = torch.cat([hist[:, 1:, :2] - hist[:, :-1, :2], hist[:, 1:, 3:4]], -1)
        return ScenarioGraph(
            agent_x=disp.flatten(1), agent_pos=pos, lane_x=(lanes - lane_pos[:, None]).flatten(1), lane_pos=lane_pos,
            a2a_index=a2a, l2a_index=l2a, y=fut - pos[:, None], y_valid=fut_valid, num_nodes=len(pos))


class AgentGraphNet(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.agent_enc = nn.Sequential(nn.Linear((T_HIST - 1) * 3, hidden), nn.LayerNorm(hidden), nn.ReLU(),
                                       nn.Linear(hidden, hidden))
        self.lane_enc = nn.Sequential(nn.Linear(20, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.l2a = GATv2Conv((hidden, hidden), hidden // 4, heads=4, edge_dim=2, add_self_loops=False)
        self.a2a = nn.ModuleList([TransformerConv(hidden, hidden // 4, heads=4, edge_dim=2) for _ in range(3)])
        self.norms = nn.ModuleList([nn.LayerNorm(hidden) for _ in range(4)])
        self.traj = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.ReLU(), nn.Linear(2 * hidden, NUM_MODES * T_FUT * 2))
        self.conf = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, NUM_MODES))

    def forward(self, data):
        a = self.agent_enc(data.agent_x)
        l = self.lane_enc(data.lane_x)
        li, ai = data.l2a_index
        ea = data.agent_pos[ai] - data.lane_pos[li]
        a = self.norms[0](a + self.l2a((l, a), data.l2a_index, edge_attr=ea))
        src, dst = data.a2a_index
        eaa = data.agent_pos[dst] - data.agent_pos[src]
        for conv, norm in zip(self.a2a, self.norms[1:]):
            a = norm(a + F.relu(conv(a, data.a2a_index, edge_attr=eaa)))
        return self.traj(a).view(-1, NUM_MODES, T_FUT, 2), self.conf(a)


def wta(pred, conf, y, y_valid):
    keep = y_valid.any(-1)
    pred, conf, y, m = pred[keep], conf[keep], y[keep], y_valid[keep].float()
    l2 = torch.norm(pred - y[:, None], dim=-1)
    ade = (l2 * m[:, None]).sum(-1) / m.sum(-1, keepdim=True).clamp(min=1)
    best = ade.argmin(-1)
    reg = (F.smooth_l1_loss(pred[torch.arange(len(best)), best], y, reduction="none").sum(-1) * m).sum() / m.sum().clamp(min=1)
    return reg + F.cross_entropy(conf, best)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed + rank)

    # split by drive so that overlapping windows of one drive never land in both sets
    drives = sorted(d for d in os.listdir(args.root) if os.path.isdir(os.path.join(args.root, d)))
    random.shuffle(drives)
    n_val = int(len(drives) * args.val_frac)
    val_drives, train_drives = drives[:n_val], drives[n_val:]
    train_files = sorted(f for d in train_drives for f in glob(os.path.join(args.root, d, "*.pt")))
    val_files = sorted(f for d in val_drives for f in glob(os.path.join(args.root, d, "*.pt")))
    if rank == 0:
        print(f"{len(train_drives)} train drives ({len(train_files)} scenarios), "
              f"{len(val_drives)} val drives ({len(val_files)} scenarios)")

    train_ds = ScenarioDataset(train_files, args.radius, train=True)
    val_ds = ScenarioDataset(val_files[rank::world], args.radius, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                              drop_last=True, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.bs, shuffle=False, num_workers=args.workers)

    net = AgentGraphNet(args.hidden).to(device)
    model = DDP(net, device_ids=[local_rank])
    lr = args.lr * world * args.bs / 128
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    best_fde = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for data in train_loader:
            data = data.to(device, non_blocking=True)
            pred, conf = model(data)
            loss = wta(pred, conf, data.y, data.y_valid)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)

        net.eval()
        acc = torch.zeros(3, device=device)  # sum minADE, sum minFDE, count
        with torch.no_grad():
            for data in val_loader:
                data = data.to(device)
                pred, _ = net(data)
                full = data.y_valid.all(-1)
                err = torch.norm(pred[full] - data.y[full][:, None], dim=-1)
                acc += torch.stack([err.mean(-1).min(-1).values.sum(), err[..., -1].min(-1).values.sum(),
                                    torch.tensor(float(full.sum()), device=device)])
        dist.all_reduce(acc)
        ade, fde = (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()
        if rank == 0:
            print(f"epoch {epoch:03d} train_loss {(tot[0] / tot[1]).item():.4f} minADE6 {ade:.3f} "
                  f"minFDE6 {fde:.3f} ({time.time() - t0:.0f}s)", flush=True)
            ck = {"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "args": vars(args)}
            torch.save(ck, os.path.join(args.ckpt_dir, "last.pt"))
            if fde < best_fde:
                torch.save(ck, os.path.join(args.ckpt_dir, "best.pt"))
        best_fde = min(best_fde, fde)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
