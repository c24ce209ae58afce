"""GNS trained on MPM simulations of elastic bodies impacting a rigid wall.

Dataset: 120 runs, three materials, Young's modulus 1e4 - 1e6 Pa.

single GPU:   python 20_gns_elastic_impact.py --data /data/mpm_elastic
multi GPU:    torchrun --nproc_per_node=4 20_gns_elastic_impact.py --data /data/mpm_elastic --distributed
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler
from torch_cluster import radius_graph
from torch_scatter import scatter_add

SEQ = 6
RIGID_WALL = 3


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="checkpoints/elastic")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--distributed", action="store_true")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--noise-std", type=float, default=5e-4)
    p.add_argument("--latent", type=int, default=128)
    p.add_argument("--mp-steps", type=int, default=10)
    p.add_argument("--eval-traj", type=int, default=4)
    return p.parse_args()


def mlp(i, o, h, ln=True):
    net = [nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o)]
    if ln:
        net.append(nn.LayerNorm(o))
    return nn.Sequential(*net)


class Interaction(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.msg, self.upd = mlp(3 * h, h, h), mlp(2 * h, h, h)

    def forward(self, x, e, ei):
        m = self.msg(torch.cat([x[ei[0]], x[ei[1]], e], -1))
        x = x + self.upd(torch.cat([x, scatter_add(m, ei[1], 0, dim_size=x.shape[0])], -1))
        return x, e + m


class ElasticGNS(nn.Module):
    def __init__(self, meta, noise_std, latent, mp_steps):
        super().__init__()
        dim = meta["dim"]
        self.R = meta["default_connectivity_radius"]
        f = lambda k: torch.tensor(meta[k], dtype=torch.float32)
        self.register_buffer("bounds", f("bounds"))
        self.register_buffer("vm", f("vel_mean"))
        self.register_buffer("vs", torch.sqrt(f("vel_std") ** 2 + noise_std ** 2))
        self.register_buffer("am", f("acc_mean"))
        self.register_buffer("as_", torch.sqrt(f("acc_std") ** 2 + noise_std ** 2))
        self.emb = nn.Embedding(9, 16)
        self.enc_x = mlp((SEQ - 1) * dim + 2 * dim + 16 + 1, latent, latent)  # + Young's modulus (log)
        self.enc_e = mlp(dim + 1, latent, latent)
        self.proc = nn.ModuleList(Interaction(latent) for _ in range(mp_steps))
        self.dec = mlp(latent, dim, latent, ln=False)

    def forward(self, seq, ptype, log_E, batch):
        cur = seq[:, -1]
        ei = radius_graph(cur, self.R, batch, loop=True, max_num_neighbors=96)
        vel = ((seq[:, 1:] - seq[:, :-1]) - self.vm) / self.vs
        wall = (torch.cat([cur - self.bounds[:, 0], self.bounds[:, 1] - cur], -1) / self.R).clamp(-1, 1)
        x = self.enc_x(torch.cat([vel.flatten(1), wall, self.emb(ptype), log_E], -1))
        rel = (cur[ei[0]] - cur[ei[1]]) / self.R
        e = self.enc_e(torch.cat([rel, rel.norm(dim=-1, keepdim=True)], -1))
        for blk in self.proc:
            x, e = blk(x, e, ei)
        return self.dec(x)


class ElasticWindows(Dataset):
    def __init__(self, path):
        z = np.load(path, allow_pickle=True)
        self.runs = [(np.asarray(r["pos"], np.float32), np.asarray(r["type"], np.int64), float(r["E"]))
                     for r in z["runs"]]
        self.index = [(i, t) for i, (p, _, _) in enumerate(self.runs) for t in range(p.shape[0] - SEQ)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, t = self.index[k]
        p, ty, E = self.runs[i]
        return torch.from_numpy(p[t:t + SEQ + 1].transpose(1, 0, 2).copy()), torch.from_numpy(ty), E


def collate(items):
    seq = torch.cat([s for s, _, _ in items])
    ty = torch.cat([t for _, t, _ in items])
    logE = torch.cat([torch.full((len(t), 1), float(np.log10(E))) for _, t, E in items])
    batch = torch.cat([torch.full((len(t),), j, dtype=torch.long) for j, (_, t, _) in enumerate(items)])
    return seq, ty, logE, batch


def noise_seq(seq, std):
    k = seq.shape[1] - 1
    vn = torch.cumsum(torch.randn_like(seq[:, 1:]) * std / k ** 0.5, 1)
    return torch.cat([torch.zeros_like(vn[:, :1]), torch.cumsum(vn, 1)], 1)


@torch.no_grad()
def rollout_mse(net, run, device):
    p, ty, E = run
    p = torch.from_numpy(p).to(device).transpose(0, 1)
    ty = torch.from_numpy(ty).to(device)
    logE = torch.full((ty.shape[0], 1), float(np.log10(E)), device=device)
    b = torch.zeros_like(ty)
    cur, se = p[:, :SEQ], []
    for s in range(SEQ, p.shape[1]):
        acc = net(cur, ty, logE, b) * net.as_ + net.am
        nxt = torch.where((ty == RIGID_WALL).unsqueeze(-1), p[:, s], 2 * cur[:, -1] - cur[:, -2] + acc)
        se.append(((nxt - p[:, s]) ** 2).mean())
        cur = torch.cat([cur[:, 1:], nxt[:, None]], 1)
    return torch.stack(se).mean().item()


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def main():
    args = get_args()
    if args.distributed:
        rank, world, local_rank = setup_distributed()
    else:
        rank, world, local_rank = 0, 1, 0
    device = torch.device(args.device)

    meta = json.load(open(os.path.join(args.data, "metadata.json")))
    net = ElasticGNS(meta, args.noise_std, args.latent, args.mp_steps).to(device)
    model = DDP(net, device_ids=[local_rank]) if args.distributed else net

    train = ElasticWindows(os.path.join(args.data, "train.npz"))
    valid = ElasticWindows(os.path.join(args.data, "valid.npz"))
    sampler = DistributedSampler(train, shuffle=True) if args.distributed else RandomSampler(train)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True, drop_last=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.85)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        if args.distributed:
            sampler.set_epoch(epoch)
        model.train()
        t0, run_loss, n = time.time(), 0.0, 0
        for seq, ty, logE, batch in loader:
            seq, ty, logE, batch = seq.to(device), ty.to(device), logE.to(device), batch.to(device)
            hist, nxt = seq[:, :-1], seq[:, -1]
            noise = noise_seq(hist, args.noise_std)
            noise[ty == RIGID_WALL] = 0
            hist = hist + noise
            target = ((nxt + noise[:, -1]) - 2 * hist[:, -1] + hist[:, -2] - net.am) / net.as_
            pred = model(hist, ty, logE, batch)
            m = (ty != RIGID_WALL).unsqueeze(-1).float()
            loss = ((pred - target) ** 2 * m).sum() / (m.sum() * pred.shape[-1])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            run_loss += loss.item()
            n += 1
        sched.step()
        tl = torch.tensor([run_loss, float(n)], device=device)
        if args.distributed:
            dist.all_reduce(tl)

        if rank == 0:
            net.eval()
            mse = np.mean([rollout_mse(net, r, device) for r in valid.runs[:args.eval_traj]])
            print(f"epoch {epoch}: train loss {(tl[0] / tl[1]).item():.5f}  valid rollout mse {mse:.4e}  "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.out, f"epoch_{epoch:03d}.pt"))
        if args.distributed:
            dist.barrier()

    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
