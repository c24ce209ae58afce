"""Neural unsigned distance fields (NDF) for open / non-watertight garments and scenes.

Sparse point cloud -> voxelised input grid -> multi-scale 3D conv features -> UDF at query points.
Single node, one process per GPU via torch.multiprocessing:

    python 20_ndf_spawn.py --config configs/ndf_garments.yaml
"""
import argparse
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class UDFSamples(Dataset):
    def __init__(self, root, split, res=256, n_input=10000, n_query=50000, sigmas=(0.08, 0.02, 0.003),
                 ratios=(0.01, 0.49, 0.5)):
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.items = [os.path.join(root, l.strip()) for l in f if l.strip()]
        self.res, self.n_input = res, n_input
        self.parts = [(s, int(n_query * r)) for s, r in zip(sigmas, ratios)]

    def __len__(self):
        return len(self.items)

    def voxelize(self, pts):
        grid = np.zeros((self.res,) * 3, dtype=np.float32)
        idx = np.clip(((pts + 0.5) * self.res).astype(np.int64), 0, self.res - 1)
        grid[idx[:, 0], idx[:, 1], idx[:, 2]] = 1.0
        return grid

    def __getitem__(self, i):
        d = self.items[i]
        pc = np.load(os.path.join(d, "surface_points.npy"))
        inp = pc[np.random.choice(len(pc), self.n_input, replace=False)]
        qs, ds = [], []
        for sigma, n in self.parts:
            b = np.load(os.path.join(d, f"boundary_{sigma}_samples.npz"))
            sel = np.random.randint(len(b["points"]), size=n)
            qs.append(b["points"][sel])
            ds.append(b["df"][sel])
        return (torch.from_numpy(self.voxelize(inp)), torch.from_numpy(np.concatenate(qs).astype(np.float32)),
                torch.from_numpy(np.concatenate(ds).astype(np.float32)))


class NDF(nn.Module):
    def __init__(self, hidden=256):
        super().__init__()
        chans = [1, 16, 32, 64, 128, 128]
        self.convs = nn.ModuleList()
        for cin, cout in zip(chans[:-1], chans[1:]):
            self.convs.append(nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), nn.ReLU(inplace=True),
                                            nn.Conv3d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout),
                                            nn.ReLU(inplace=True)))
        feat = sum(chans) * 7
        self.fc = nn.Sequential(nn.Conv1d(feat, hidden * 2, 1), nn.ReLU(), nn.Conv1d(hidden * 2, hidden, 1),
                                nn.ReLU(), nn.Conv1d(hidden, hidden, 1), nn.ReLU(), nn.Conv1d(hidden, 1, 1))
        d = 1.0 / 256
        offs = [[0, 0, 0]] + [[s * d * (k == j) for j in range(3)] for k in range(3) for s in (-1, 1)]
        self.register_buffer("offsets", torch.tensor(offs, dtype=torch.float32))

    def forward(self, p, vox):
        # grid_sample wants (z, y, x) order in [-1, 1]
        g = (p * 2)[..., [2, 1, 0]]
        g = torch.stack([g + o for o in self.offsets[:, [2, 1, 0]] * 2], 2).unsqueeze(1)  # B,1,N,7,3
        x = vox.unsqueeze(1)
        feats = [F.grid_sample(x, g, align_corners=False)]
        for k, conv in enumerate(self.convs):
            x = conv(x)
            feats.append(F.grid_sample(x, g, align_corners=False))
            if k < len(self.convs) - 1:
                x = F.max_pool3d(x, 2)
        f = torch.cat(feats, 1)                                  # B, C, 1, N, 7
        B, C, _, N, K = f.shape
        f = f.permute(0, 1, 4, 2, 3).reshape(B, C * K, N)
        return F.relu(self.fc(f).squeeze(1))                     # unsigned distances >= 0


def train_worker(rank, world_size, cfg):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{cfg['port']}",
                            rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(cfg["seed"] + rank)
    np.random.seed(cfg["seed"] + rank)

    train_ds = UDFSamples(cfg["data_root"], "train", n_query=cfg["n_query"])
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"],
                        pin_memory=True, drop_last=True)

    model = DDP(NDF().to(device), device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    clamp = cfg["max_dist"]

    exp_dir = cfg["exp_dir"]
    start_epoch = 0
    last = os.path.join(exp_dir, "last.tar")
    if os.path.isfile(last):
        ck = torch.load(last, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for vox, q, df in loader:
            vox, q, df = vox.to(device, non_blocking=True), q.to(device, non_blocking=True), df.to(device, non_blocking=True)
            pred = model(q, vox)
            loss = (pred.clamp(max=clamp) - df.clamp(max=clamp)).abs().sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(meter)
        if rank == 0:
            print(f"epoch {epoch}  loss {(meter[0] / meter[1]).item():.4f}  {time.time() - t0:.0f}s", flush=True)
            if (epoch + 1) % cfg["ckpt_every"] == 0 or epoch + 1 == cfg["epochs"]:
                state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}
                torch.save(state, os.path.join(exp_dir, f"checkpoint_{epoch + 1}.tar"))
                torch.save(state, last)
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--gpus", type=int, default=0, help="0 = all visible GPUs")
    a = ap.parse_args()
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    cfg.setdefault("port", free_port())
    os.makedirs(cfg["exp_dir"], exist_ok=True)
    world_size = a.gpus or torch.cuda.device_count()
    print(f"training NDF on {world_size} GPUs, exp dir {cfg['exp_dir']}")
    mp.spawn(train_worker, args=(cfg, world_size), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
