"""MeshGraphNets / cylinder_flow -- long run with preemption-safe checkpoints.

Job is requeued by the scheduler; every restart resumes from <run>/ckpt.pt.
Gradient accumulation over --accum micro-batches; micro-batches whose merged
graph exceeds --max-nodes are dropped on all ranks together.

    torchrun --standalone --nproc_per_node=4 09_mgn_cylinder_resume.py \
        --data /data/cylinder_flow --run /checkpoints/cyl_mgn --accum 2
"""
import argparse
import contextlib
import math
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
from torch_scatter import scatter_add

NORMAL, INFLOW, OUTFLOW, WALL = 0, 4, 5, 6
NT = 9


def mlp(i, o, h=128, ln=True):
    net = [nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o)]
    return nn.Sequential(*net, *([nn.LayerNorm(o)] if ln else []))


class Processor(nn.Module):
    def __init__(self, h, n):
        super().__init__()
        self.edge = nn.ModuleList(mlp(3 * h, h) for _ in range(n))
        self.node = nn.ModuleList(mlp(2 * h, h) for _ in range(n))

    def forward(self, x, e, ei):
        for fe, fn in zip(self.edge, self.node):
            de = fe(torch.cat([x[ei[0]], x[ei[1]], e], -1))
            x = x + fn(torch.cat([x, scatter_add(de, ei[1], 0, dim_size=x.shape[0])], -1))
            e = e + de
        return x


class MGN(nn.Module):
    def __init__(self, stats, h=128, n_mp=15):
        super().__init__()
        for k, v in stats.items():
            self.register_buffer(k, torch.as_tensor(v).float())
        self.enc_x, self.enc_e = mlp(2 + NT, h), mlp(3, h)
        self.proc = Processor(h, n_mp)
        self.dec = mlp(h, 2, ln=False)

    def forward(self, vel, nt, mesh_pos, ei):
        x = torch.cat([vel, F.one_hot(nt, NT).float()], -1)
        rel = mesh_pos[ei[0]] - mesh_pos[ei[1]]
        e = torch.cat([rel, rel.norm(dim=-1, keepdim=True)], -1)
        x = self.enc_x((x - self.x_mean) / self.x_std)
        e = self.enc_e((e - self.e_mean) / self.e_std)
        return self.dec(self.proc(x, e, ei))


def to_edges(cells):
    e = np.concatenate([cells[:, [0, 1]], cells[:, [1, 2]], cells[:, [2, 0]]])
    e = np.unique(np.sort(e, 1), axis=0)
    return np.concatenate([e, e[:, ::-1]]).T.copy()


class CylinderSteps(Dataset):
    def __init__(self, root, split, noise=0.02):
        self.files = sorted(os.path.join(root, split, f) for f in os.listdir(os.path.join(root, split)))
        self.noise = noise
        self.T = np.load(self.files[0])["velocity"].shape[0] - 1

    def __len__(self):
        return len(self.files) * self.T

    def __getitem__(self, i):
        f, t = divmod(i, self.T)
        d = np.load(self.files[f])
        nt = torch.from_numpy(d["node_type"]).long().view(-1)
        v0 = torch.from_numpy(d["velocity"][t]).float()
        v1 = torch.from_numpy(d["velocity"][t + 1]).float()
        if self.noise > 0:
            v0 = v0 + torch.randn_like(v0) * self.noise * (nt == NORMAL).unsqueeze(-1)
        return v0, v1 - v0, nt, torch.from_numpy(d["mesh_pos"]).float(), torch.from_numpy(to_edges(d["cells"]))


def collate(batch):
    v, dv, nt, mp, ei, off = [], [], [], [], [], 0
    for a, b, c, d, e in batch:
        v.append(a); dv.append(b); nt.append(c); mp.append(d); ei.append(e + off)
        off += a.shape[0]
    return torch.cat(v), torch.cat(dv), torch.cat(nt), torch.cat(mp), torch.cat(ei, 1).long()


def training_stats(root, n_files=100):
    files = sorted(os.listdir(os.path.join(root, "train")))[:n_files]
    acc = {k: [0, 0, 0] for k in ("x", "e", "y")}
    for fn in files:
        d = np.load(os.path.join(root, "train", fn))
        nt = np.eye(NT)[d["node_type"].reshape(-1)]
        ei = to_edges(d["cells"])
        rel = d["mesh_pos"][ei[0]] - d["mesh_pos"][ei[1]]
        e = np.concatenate([rel, np.linalg.norm(rel, axis=-1, keepdims=True)], -1)
        vel = d["velocity"]
        x = np.concatenate([vel[:-1], np.broadcast_to(nt, vel[:-1].shape[:-1] + (NT,))], -1).reshape(-1, 2 + NT)
        y = (vel[1:] - vel[:-1]).reshape(-1, 2)
        for k, a in (("x", x), ("e", e), ("y", y)):
            acc[k][0] = acc[k][0] + a.sum(0)
            acc[k][1] = acc[k][1] + (a.astype(np.float64) ** 2).sum(0)
            acc[k][2] += a.shape[0]
    out = {}
    for k, (s, s2, n) in acc.items():
        out[f"{k}_mean"] = s / n
        out[f"{k}_std"] = np.maximum(np.sqrt(np.maximum(s2 / n - (s / n) ** 2, 0)), 1e-8)
    return out


def get_stats(root, run_dir, rank):
    path = os.path.join(run_dir, "stats.npz")
    if rank == 0 and not os.path.exists(path):
        stats = training_stats(root)
        np.savez(path + ".tmp.npz", **stats)
        os.replace(path + ".tmp.npz", path)
    dist.barrier()
    return dict(np.load(path))


@torch.no_grad()
def rollout_error(net, path, device, steps=600):
    d = np.load(path)
    nt = torch.from_numpy(d["node_type"]).long().view(-1).to(device)
    mp = torch.from_numpy(d["mesh_pos"]).float().to(device)
    ei = torch.from_numpy(to_edges(d["cells"])).long().to(device)
    gt = torch.from_numpy(d["velocity"]).float().to(device)
    upd = ((nt == NORMAL) | (nt == OUTFLOW)).unsqueeze(-1)
    v, sq = gt[0], 0.0
    n = min(steps, gt.shape[0] - 1)
    for t in range(n):
        dv = net(v, nt, mp, ei) * net.y_std + net.y_mean
        v = torch.where(upd, v + dv, gt[t + 1])
        sq += ((v - gt[t + 1]) ** 2).sum(-1).mean().item()
    return sq, n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--max-nodes", type=int, default=8000)
    ap.add_argument("--lr", type=float, default=1e-4, help="for 8 graphs per optimizer step")
    ap.add_argument("--epochs", type=int, default=40)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.run, exist_ok=True)
    stats = get_stats(args.data, args.run, rank)

    net = MGN(stats).to(device)
    model = DDP(net, device_ids=[local_rank])
    graphs_per_step = args.micro_batch * args.accum * world
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * graphs_per_step / 8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda ep: 0.1 ** (ep / args.epochs))

    ckpt_path = os.path.join(args.run, "ckpt.pt")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1
        if rank == 0:
            print(f"resuming from epoch {start_epoch}", flush=True)

    ds = CylinderSteps(args.data, "train")
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, collate_fn=collate,
                        num_workers=6, pin_memory=True, persistent_workers=True)
    valid_files = sorted(os.path.join(args.data, "valid", f) for f in os.listdir(os.path.join(args.data, "valid")))

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        opt.zero_grad(set_to_none=True)
        micro, skipped, t0 = 0, 0, time.time()
        run = torch.zeros(2, device=device)
        for v, dv, nt, mp, ei in loader:
            too_big = torch.tensor(int(v.shape[0] > args.max_nodes), device=device)
            dist.all_reduce(too_big, op=dist.ReduceOp.MAX)
            if too_big.item():
                skipped += 1
                continue
            v, dv, nt, mp, ei = (x.to(device, non_blocking=True) for x in (v, dv, nt, mp, ei))
            micro += 1
            sync_now = micro % args.accum == 0
            with contextlib.nullcontext() if sync_now else model.no_sync():
                pred = model(v, nt, mp, ei)
                target = (dv - net.y_mean) / net.y_std
                mask = (nt == NORMAL) | (nt == OUTFLOW)
                loss = ((pred - target) ** 2).sum(-1)[mask].mean()
                (loss / args.accum).backward()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()

        # rollout on every rank over its share of validation trajectories
        net.eval()
        err = torch.zeros(2, device=device, dtype=torch.float64)
        for f in valid_files[rank::world]:
            sq, n = rollout_error(net, f, device)
            err[0] += sq
            err[1] += n
        dist.all_reduce(err)
        dist.all_reduce(run)
        if rank == 0:
            print(f"epoch {epoch} loss {(run[0] / run[1]).item():.4e} skipped {skipped} "
                  f"rollout rmse {math.sqrt((err[0] / err[1]).item()):.4e} ({time.time() - t0:.0f}s)",
                  flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
