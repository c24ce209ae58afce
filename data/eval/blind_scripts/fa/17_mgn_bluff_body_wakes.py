"""MGN for unsteady wake flow behind randomly shaped bluff bodies (in-house Nektar++ data).

Tracks experiments in Weights & Biases (project "mgn-wakes").

    torchrun --nproc_per_node=4 17_mgn_bluff_body_wakes.py --data /scratch/wakes --run-name mgn_l15_n2e-2
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_scatter import scatter_add

INTERIOR, WALL, INFLOW, OUTFLOW = 0, 1, 2, 3
NT = 4


def mlp(i, o, h=128, ln=True):
    mods = [nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o)]
    return nn.Sequential(*mods, nn.LayerNorm(o)) if ln else nn.Sequential(*mods)


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.e_fn, self.n_fn = mlp(3 * h, h), mlp(2 * h, h)

    def forward(self, x, e, ei):
        e_new = self.e_fn(torch.cat([x[ei[0]], x[ei[1]], e], -1))
        x_new = self.n_fn(torch.cat([x, scatter_add(e_new, ei[1], 0, dim_size=len(x))], -1))
        return x + x_new, e + e_new


class WakeMGN(nn.Module):
    def __init__(self, stats, h=128, layers=15):
        super().__init__()
        for k, v in stats.items():
            self.register_buffer(k, torch.tensor(v, dtype=torch.float32))
        self.enc_n = mlp(3 + NT, h)   # u, v, Re + type
        self.enc_e = mlp(3, h)
        self.proc = nn.ModuleList(Block(h) for _ in range(layers))
        self.dec = mlp(h, 3, ln=False)  # du, dv, p

    def forward(self, x, e, ei):
        x = self.enc_n((x - self.node_mean) / self.node_std)
        e = self.enc_e((e - self.edge_mean) / self.edge_std)
        for blk in self.proc:
            x, e = blk(x, e, ei)
        return self.dec(x)


def make_inputs(uv, re, nt, pos, ei):
    x = torch.cat([uv, re.expand(uv.shape[0], 1), F.one_hot(nt, NT).float()], -1)
    r = pos[ei[0]] - pos[ei[1]]
    return x, torch.cat([r, r.norm(dim=-1, keepdim=True)], -1)


class WakeSteps(Dataset):
    def __init__(self, folder, noise_std=0.0):
        self.paths = sorted(os.path.join(folder, p) for p in os.listdir(folder) if p.endswith(".npz"))
        self.noise_std = noise_std
        self.n_t = [int(np.load(p)["uv"].shape[0]) - 1 for p in self.paths]
        self.lookup = [(i, t) for i, n in enumerate(self.n_t) for t in range(n)]

    def __len__(self):
        return len(self.lookup)

    def __getitem__(self, k):
        i, t = self.lookup[k]
        z = np.load(self.paths[i])
        nt = torch.from_numpy(z["node_type"]).long()
        uv0 = torch.from_numpy(z["uv"][t]).float()
        uv1 = torch.from_numpy(z["uv"][t + 1]).float()
        p1 = torch.from_numpy(z["p"][t + 1]).float().unsqueeze(-1)
        if self.noise_std > 0:
            uv0 = uv0 + torch.randn_like(uv0) * self.noise_std * (nt == INTERIOR).unsqueeze(-1)
        return (uv0, torch.tensor([float(z["Re"])]), nt, torch.from_numpy(z["pos"]).float(),
                torch.from_numpy(z["edges"]).long(), torch.cat([uv1 - uv0, p1], -1))


def collate(batch):
    uv, re, nt, pos, ei, y = [], [], [], [], [], []
    off = 0
    for g, (a, b, c, d, e, f) in enumerate(batch):
        uv.append(a); re.append(b.expand(a.shape[0], 1)); nt.append(c); pos.append(d)
        ei.append(e + off); y.append(f)
        off += a.shape[0]
    return torch.cat(uv), torch.cat(re), torch.cat(nt), torch.cat(pos), torch.cat(ei, 1), torch.cat(y)


@torch.no_grad()
def rollout_errors(net, path, device, horizon):
    z = np.load(path)
    nt = torch.from_numpy(z["node_type"]).long().to(device)
    pos = torch.from_numpy(z["pos"]).float().to(device)
    ei = torch.from_numpy(z["edges"]).long().to(device)
    gt = torch.from_numpy(z["uv"]).float().to(device)
    re = torch.tensor([[float(z["Re"])]], device=device)
    free = (nt == INTERIOR) | (nt == OUTFLOW)
    uv, err = gt[0], []
    for t in range(min(horizon, gt.shape[0] - 1)):
        x, e = make_inputs(uv, re, nt, pos, ei)
        out = net(x, e, ei) * net.out_std + net.out_mean
        uv = torch.where(free.unsqueeze(-1), uv + out[:, :2], gt[t + 1])
        err.append(((uv - gt[t + 1]) ** 2).sum(-1).mean().sqrt().item())
    return np.array(err)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--out", default="/scratch/wakes/runs")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--noise-std", type=float, default=2e-2)
    ap.add_argument("--horizon", type=int, default=250)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    run = wandb.init(project="mgn-wakes", name=args.run_name, config={**vars(args), "world_size": world})

    stats = dict(np.load(os.path.join(args.data, "stats.npz")))
    net = WakeMGN(stats).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    train = WakeSteps(os.path.join(args.data, "train"), args.noise_std)
    sampler = DistributedSampler(train, shuffle=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=6, pin_memory=True, drop_last=True)
    valid_paths = sorted(os.path.join(args.data, "valid", p) for p in os.listdir(os.path.join(args.data, "valid")))
    out_dir = os.path.join(args.out, run.name)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for uv, re, nt, pos, ei, y in loader:
            uv, re, nt, pos, ei, y = (v.to(device, non_blocking=True) for v in (uv, re, nt, pos, ei, y))
            x, e = make_inputs(uv, re, nt, pos, ei)
            pred = model(x, e, ei)
            yn = (y - net.out_mean) / net.out_std
            free = (nt == INTERIOR) | (nt == OUTFLOW)
            loss = ((pred - yn) ** 2)[free].sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                wandb.log({"train/loss": l.item(), "lr": sched.get_last_lr()[0]}, step=step)
        sched.step()

        if rank == 0:
            net.eval()
            errs = np.stack([rollout_errors(net, p, device, args.horizon) for p in valid_paths[:8]])
            wandb.log({"val/rmse_1": errs[:, 0].mean(), "val/rmse_50": errs[:, 49].mean(),
                       "val/rmse_all": errs.mean(), "epoch": epoch, "epoch_time": time.time() - t0}, step=step)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(out_dir, "last.pt"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
