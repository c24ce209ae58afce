"""Suction-cup affordance from point clouds (bin picking).

A per-point network predicts the probability that a suction cup placed at the
point along its negative normal seals and lifts the object.  Labels come from
the seal/wrench check in our PyBullet bin-picking simulator.  After each epoch
every rank runs picking episodes in the simulator and we report the pick
success rate over all episodes.

    torchrun --nproc_per_node=4 06_suction_affordance_train.py --config cfg/suction.yaml
"""
import argparse
import glob
import logging
import os
import time

import numpy as np
import pybullet as pb
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from binsim import BinPickingEnv  # simulator package in this repo

log = logging.getLogger(__name__)


class SuctionDataset(Dataset):
    def __init__(self, files, npts, jitter):
        self.files = files
        self.npts = npts
        self.jitter = jitter

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with np.load(self.files[i]) as d:
            xyz, normals, label = d["xyz"], d["normals"], d["suction_ok"]
        idx = np.random.choice(len(xyz), self.npts, replace=len(xyz) < self.npts)
        xyz, normals, label = xyz[idx], normals[idx], label[idx]
        if self.jitter > 0:
            xyz = xyz + np.clip(np.random.randn(*xyz.shape) * self.jitter, -3 * self.jitter, 3 * self.jitter)
        feats = np.concatenate([xyz - xyz.mean(0), normals], 1).astype(np.float32)
        return torch.from_numpy(feats), torch.from_numpy(label.astype(np.float32))


class EdgeConvBlock(nn.Module):
    def __init__(self, cin, cout, k=16):
        super().__init__()
        self.k = k
        self.mlp = nn.Sequential(nn.Conv2d(2 * cin, cout, 1, bias=False), nn.GroupNorm(8, cout), nn.LeakyReLU(0.2))

    def forward(self, x):  # B,C,N
        B, C, N = x.shape
        with torch.no_grad():
            d = torch.cdist(x.transpose(1, 2), x.transpose(1, 2))
            knn = d.topk(self.k, largest=False).indices  # B,N,k
        idx = (knn + torch.arange(B, device=x.device).view(B, 1, 1) * N).reshape(-1)
        nbr = x.transpose(1, 2).reshape(B * N, C)[idx].view(B, N, self.k, C).permute(0, 3, 1, 2)
        center = x.unsqueeze(-1).expand_as(nbr)
        return self.mlp(torch.cat([nbr - center, center], 1)).max(-1)[0]


class SuctionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.e1 = EdgeConvBlock(6, 64)
        self.e2 = EdgeConvBlock(64, 64)
        self.e3 = EdgeConvBlock(64, 128)
        self.head = nn.Sequential(nn.Conv1d(256 + 512, 256, 1), nn.GroupNorm(8, 256), nn.LeakyReLU(0.2),
                                  nn.Conv1d(256, 1, 1))
        self.glob = nn.Conv1d(256, 512, 1)

    def forward(self, x):
        x = x.transpose(1, 2)
        f1 = self.e1(x)
        f2 = self.e2(f1)
        f3 = self.e3(f2)
        f = torch.cat([f1, f2, f3], 1)
        g = self.glob(f).max(-1, keepdim=True)[0].expand(-1, -1, f.shape[-1])
        return self.head(torch.cat([f, g], 1)).squeeze(1)


def pick_episodes(net, env, n_episodes, npts, device):
    net.eval()
    succ = 0
    tried = 0
    for _ in range(n_episodes):
        env.reset()
        while env.objects_in_bin() > 0 and env.consecutive_failures < 3:
            xyz, normals = env.observe()
            idx = np.random.choice(len(xyz), npts, replace=len(xyz) < npts)
            xyz, normals = xyz[idx], normals[idx]
            feats = np.concatenate([xyz - xyz.mean(0), normals], 1).astype(np.float32)
            with torch.no_grad():
                score = torch.sigmoid(net(torch.from_numpy(feats)[None].to(device)))[0]
            best = int(score.argmax())
            ok = env.suction_pick(xyz[best], -normals[best])
            succ += int(ok)
            tried += 1
    net.train()
    return succ, tried


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    files = sorted(glob.glob(os.path.join(cfg["data_dir"], "*.npz")))
    ds = SuctionDataset(files, cfg["num_points"], cfg.get("jitter", 0.002))
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg.get("seed", 0))
    dl = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg.get("workers", 6),
                    pin_memory=True, drop_last=True)

    net = SuctionNet().to(device)
    net = DDP(net, device_ids=[local_rank])
    # cfg lr is for a single GPU; scale linearly with the number of ranks
    opt = torch.optim.Adam(net.parameters(), lr=cfg["lr"] * world)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"])
    pos_weight = torch.tensor(cfg.get("pos_weight", 4.0), device=device)

    env = BinPickingEnv(urdf_root=cfg["object_dir"], connection_mode=pb.DIRECT, seed=1000 + rank)
    episodes_per_rank = int(np.ceil(cfg["eval_episodes"] / world))

    out_dir = cfg["out_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f)

    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        for feats, label in dl:
            feats, label = feats.to(device, non_blocking=True), label.to(device, non_blocking=True)
            logits = net(feats)
            loss = F.binary_cross_entropy_with_logits(logits, label, pos_weight=pos_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats[0] += loss.detach()
            stats[1] += 1
        sched.step()
        dist.all_reduce(stats)
        log.info("epoch %d train bce %.4f (%.0fs)", epoch, (stats[0] / stats[1]).item(), time.time() - t0)

        if (epoch + 1) % cfg.get("eval_every", 2) == 0:
            succ, tried = pick_episodes(net.module, env, episodes_per_rank, cfg["num_points"], device)
            counts = torch.tensor([succ, tried], dtype=torch.float64)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
            rate = (counts[0] / counts[1].clamp(min=1)).item()
            log.info("epoch %d sim pick success %.3f over %d picks", epoch, rate, int(counts[1]))
            if rank == 0:
                torch.save({"epoch": epoch, "model": net.module.state_dict(), "opt": opt.state_dict(),
                            "pick_success": rate}, os.path.join(out_dir, f"suction_ep{epoch:03d}.pt"))
        dist.barrier()

    env.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
