"""Distributed training of a graph network simulator on the Goop (viscoplastic) dataset.

Usage:
    torchrun --nproc_per_node=4 06_gns_goop.py --data /datasets/Goop --out /results/goop_gns
"""
import argparse
import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_cluster import radius_graph
from torch_scatter import scatter

logger = logging.getLogger(__name__)
SEQ_LEN = 6
BOUNDARY_TYPE = 3


def get_parser():
    parser = argparse.ArgumentParser("gns-goop")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--latent", type=int, default=128)
    parser.add_argument("--message-passing", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--noise", type=float, default=3e-4)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--log-every", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    return parser


class MLP(nn.Module):
    def __init__(self, din, dout, hidden, layernorm=True):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(din, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, dout))
        self.ln = nn.LayerNorm(dout) if layernorm else nn.Identity()

    def forward(self, x):
        return self.ln(self.net(x))


class GNBlock(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.phi_e = MLP(3 * h, h, h)
        self.phi_v = MLP(2 * h, h, h)

    def forward(self, v, e, ei):
        e2 = self.phi_e(torch.cat([v[ei[0]], v[ei[1]], e], 1))
        v2 = self.phi_v(torch.cat([v, scatter(e2, ei[1], 0, dim_size=v.shape[0], reduce="sum")], 1))
        return v + v2, e + e2


class GNS(nn.Module):
    def __init__(self, meta, latent, n_mp, noise):
        super().__init__()
        self.dim = meta["dim"]
        self.radius = meta["default_connectivity_radius"]
        self.register_buffer("bounds", torch.tensor(meta["bounds"]).float())
        self.register_buffer("v_mu", torch.tensor(meta["vel_mean"]).float())
        self.register_buffer("v_sd", torch.tensor(meta["vel_std"]).float().pow(2).add(noise ** 2).sqrt())
        self.register_buffer("a_mu", torch.tensor(meta["acc_mean"]).float())
        self.register_buffer("a_sd", torch.tensor(meta["acc_std"]).float().pow(2).add(noise ** 2).sqrt())
        self.embed = nn.Embedding(9, 16)
        self.enc_v = MLP((SEQ_LEN - 1) * self.dim + 2 * self.dim + 16, latent, latent)
        self.enc_e = MLP(self.dim + 1, latent, latent)
        self.blocks = nn.ModuleList([GNBlock(latent) for _ in range(n_mp)])
        self.dec = MLP(latent, self.dim, latent, layernorm=False)

    def forward(self, pos, ptype, batch):
        cur = pos[:, -1]
        ei = radius_graph(cur, self.radius, batch, loop=True, max_num_neighbors=128)
        vel = (pos[:, 1:] - pos[:, :-1] - self.v_mu) / self.v_sd
        wall = torch.cat([cur - self.bounds[:, 0], self.bounds[:, 1] - cur], 1).div(self.radius).clamp(-1, 1)
        v = self.enc_v(torch.cat([vel.flatten(1), wall, self.embed(ptype)], 1))
        rel = (cur[ei[0]] - cur[ei[1]]) / self.radius
        e = self.enc_e(torch.cat([rel, rel.norm(dim=1, keepdim=True)], 1))
        for blk in self.blocks:
            v, e = blk(v, e, ei)
        return self.dec(v)

    def integrate(self, pos, norm_acc):
        acc = norm_acc * self.a_sd + self.a_mu
        return 2 * pos[:, -1] - pos[:, -2] + acc


class Windows(Dataset):
    def __init__(self, npz):
        z = np.load(npz, allow_pickle=True)
        self.traj = [(np.asarray(p, np.float32), np.asarray(t, np.int64)) for p, t in z["gns_data"]]
        self.idx = [(k, s) for k, (p, _) in enumerate(self.traj) for s in range(p.shape[0] - SEQ_LEN)]

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        k, s = self.idx[i]
        p, t = self.traj[k]
        w = np.swapaxes(p[s:s + SEQ_LEN + 1], 0, 1)
        return torch.from_numpy(w), torch.from_numpy(t)


def collate(batch):
    pos = torch.cat([b[0] for b in batch])
    ptype = torch.cat([b[1] for b in batch])
    bidx = torch.cat([torch.full((b[0].shape[0],), i) for i, b in enumerate(batch)])
    return pos, ptype, bidx


def random_walk(pos, std):
    nvel = pos.shape[1] - 1
    dv = torch.randn(pos.shape[0], nvel, pos.shape[2], device=pos.device) * (std / math.sqrt(nvel))
    vnoise = dv.cumsum(1)
    return torch.cat([torch.zeros_like(vnoise[:, :1]), vnoise.cumsum(1)], 1)


class Trainer:
    def __init__(self, args):
        self.args = args
        torch.cuda.set_device(args.local_rank)
        dist.init_process_group(backend="nccl", init_method="env://")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", args.local_rank)
        torch.manual_seed(args.seed)

        meta = json.loads((args.data / "metadata.json").read_text())
        self.net = GNS(meta, args.latent, args.message_passing, args.noise).to(self.device)
        self.model = DistributedDataParallel(self.net, device_ids=[args.local_rank], output_device=args.local_rank)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr * self.world,
                                     weight_decay=args.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 0.1 ** (s / 5e6) + 0.01)

        self.train_set = Windows(args.data / "train.npz")
        self.sampler = DistributedSampler(self.train_set, shuffle=True, seed=args.seed)
        self.loader = DataLoader(self.train_set, batch_size=args.batch_size, sampler=self.sampler,
                                 num_workers=4, collate_fn=collate, pin_memory=True, drop_last=True)
        self.valid = np.load(args.data / "valid.npz", allow_pickle=True)["gns_data"]
        self.step = 0
        if self.rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)

    def train_step(self, pos, ptype, bidx):
        noise = random_walk(pos[:, :-1], self.args.noise)
        noise[ptype == BOUNDARY_TYPE] = 0
        inp = pos[:, :-1] + noise
        target = pos[:, -1] + noise[:, -1]
        acc = target - 2 * inp[:, -1] + inp[:, -2]
        acc = (acc - self.net.a_mu) / self.net.a_sd
        pred = self.model(inp, ptype, bidx)
        m = (ptype != BOUNDARY_TYPE).unsqueeze(1)
        loss = ((pred - acc) ** 2 * m).sum() / (m.sum() * pred.shape[1])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.sched.step()
        return loss.detach()

    @torch.no_grad()
    def evaluate(self):
        self.net.eval()
        err = torch.zeros(2, device=self.device)
        for k in range(self.rank, len(self.valid), self.world):
            p, t = self.valid[k]
            p = torch.from_numpy(np.swapaxes(np.asarray(p, np.float32), 0, 1)).to(self.device)
            t = torch.from_numpy(np.asarray(t, np.int64)).to(self.device)
            b = torch.zeros_like(t)
            window = p[:, :SEQ_LEN]
            fixed = (t == BOUNDARY_TYPE).unsqueeze(1)
            for s in range(SEQ_LEN, p.shape[1]):
                nxt = self.net.integrate(window, self.net(window, t, b))
                nxt = torch.where(fixed, p[:, s], nxt)
                err[0] += ((nxt - p[:, s]) ** 2).mean()
                err[1] += 1
                window = torch.cat([window[:, 1:], nxt[:, None]], 1)
        dist.all_reduce(err)
        self.net.train()
        return (err[0] / err[1]).item()

    def save(self):
        if self.rank == 0:
            torch.save({"net": self.net.state_dict(), "opt": self.opt.state_dict(),
                        "sched": self.sched.state_dict(), "step": self.step},
                       self.args.out / f"gns-{self.step:08d}.pt")
        dist.barrier()

    def fit(self):
        epoch = 0
        self.model.train()
        while self.step < self.args.steps:
            self.sampler.set_epoch(epoch)
            for pos, ptype, bidx in self.loader:
                pos, ptype, bidx = (x.to(self.device, non_blocking=True) for x in (pos, ptype, bidx))
                loss = self.train_step(pos, ptype, bidx)
                self.step += 1
                if self.step % self.args.log_every == 0:
                    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
                    if self.rank == 0:
                        logger.info("step %d loss %.5f lr %.3e", self.step, loss.item(),
                                    self.sched.get_last_lr()[0])
                if self.step % self.args.eval_every == 0:
                    mse = self.evaluate()
                    if self.rank == 0:
                        logger.info("step %d rollout mse %.4e", self.step, mse)
                    self.save()
                if self.step >= self.args.steps:
                    break
            epoch += 1


def main():
    args = get_parser().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(levelname)s] %(message)s")
    trainer = Trainer(args)
    trainer.fit()
    trainer.save()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
