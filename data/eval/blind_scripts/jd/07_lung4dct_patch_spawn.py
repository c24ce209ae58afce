"""
Patch-based deformable registration of inhale/exhale lung CT (4D-CT, resampled to 1.5 mm iso).

Training uses random 96^3 patch pairs taken inside the lung bounding box; evaluation registers
whole (cropped) volumes and reports TRE on the 300 expert landmarks plus lung-mask Dice.

Single node, one process per visible GPU (started with torch.multiprocessing):
    python 07_lung4dct_patch_spawn.py --data /data/4dct_npz --epochs 400 --port 29533
"""
import argparse
import glob
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="folder of case*.npz (insp, exp, insp_mask, exp_mask, lm_insp, lm_exp, spacing)")
    p.add_argument("--val-cases", default="case01,case02,case03,case04")
    p.add_argument("--patch", type=int, default=96)
    p.add_argument("--patches-per-case", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--alpha", type=float, default=2.0, help="diffusion regulariser weight")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--out", default="out/lung_patch")
    return p.parse_args()


class PatchPairs(Dataset):
    """Random aligned patches from (inspiration=moving, expiration=fixed) volumes."""

    def __init__(self, files, patch, per_case):
        self.cases = []
        for f in files:
            d = np.load(f)
            lo, hi = np.argwhere(d["exp_mask"] > 0).min(0), np.argwhere(d["exp_mask"] > 0).max(0)
            self.cases.append((d["insp"].astype(np.float32), d["exp"].astype(np.float32), lo, hi))
        self.patch = patch
        self.per_case = per_case

    def __len__(self):
        return len(self.cases) * self.per_case

    def __getitem__(self, idx):
        mov, fix, lo, hi = self.cases[idx // self.per_case]
        p = self.patch
        start = [np.random.randint(max(lo[a] - p // 4, 0), max(min(hi[a] - 3 * p // 4, mov.shape[a] - p), lo[a]) + 1)
                 for a in range(3)]
        start = [min(s, mov.shape[a] - p) for a, s in enumerate(start)]
        sl = tuple(slice(s, s + p) for s in start)
        m, f = mov[sl], fix[sl]
        if np.random.rand() < 0.5:  # left/right flip, both images
            m, f = m[:, :, ::-1], f[:, :, ::-1]
        return torch.from_numpy(m.copy())[None], torch.from_numpy(f.copy())[None]


def seed_worker(worker_id):
    s = torch.initial_seed() % 2 ** 32
    np.random.seed(s)
    random.seed(s)


def conv(i, o, s=1):
    return nn.Sequential(nn.Conv3d(i, o, 3, s, 1), nn.InstanceNorm3d(o, affine=True), nn.LeakyReLU(0.1, True))


class PatchRegNet(nn.Module):
    def __init__(self, c=24):
        super().__init__()
        self.e1, self.e2, self.e3 = conv(2, c), conv(c, 2 * c, 2), conv(2 * c, 4 * c, 2)
        self.e4 = conv(4 * c, 4 * c, 2)
        self.d3, self.d2, self.d1 = conv(8 * c, 4 * c), conv(6 * c, 2 * c), conv(3 * c, c)
        self.flow = nn.Conv3d(c, 3, 3, padding=1)
        nn.init.zeros_(self.flow.weight)
        nn.init.zeros_(self.flow.bias)

    def forward(self, mov, fix):
        x1 = self.e1(torch.cat([mov, fix], 1))
        x2 = self.e2(x1)
        x3 = self.e3(x2)
        x4 = self.e4(x3)
        up = lambda t, ref: F.interpolate(t, size=ref.shape[2:], mode="trilinear", align_corners=False)
        y = self.d3(torch.cat([up(x4, x3), x3], 1))
        y = self.d2(torch.cat([up(y, x2), x2], 1))
        y = self.d1(torch.cat([up(y, x1), x1], 1))
        return self.flow(y)


def warp(img, flow, mode="bilinear"):
    b, _, d, h, w = flow.shape
    grid = torch.stack(torch.meshgrid(*[torch.arange(n, device=flow.device, dtype=flow.dtype) for n in (d, h, w)],
                                      indexing="ij"), 0)[None]
    loc = grid + flow
    loc = torch.stack([2 * loc[:, i] / (n - 1) - 1 for i, n in enumerate((d, h, w))], -1)[..., [2, 1, 0]]
    return F.grid_sample(img, loc, mode=mode, padding_mode="border", align_corners=True)


def ncc_global(a, b):
    a = a.flatten(1) - a.flatten(1).mean(1, keepdim=True)
    b = b.flatten(1) - b.flatten(1).mean(1, keepdim=True)
    return -((a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1) + 1e-6)).mean()


def diffusion(flow):
    return sum(flow.diff(dim=k).pow(2).mean() for k in (2, 3, 4))


@torch.no_grad()
def evaluate_case(net, path, device):
    d = np.load(path)
    mov = torch.from_numpy(d["insp"].astype(np.float32))[None, None].to(device)
    fix = torch.from_numpy(d["exp"].astype(np.float32))[None, None].to(device)
    shape = fix.shape[2:]
    pad = [(-s) % 8 for s in shape]
    padding = (0, pad[2], 0, pad[1], 0, pad[0])
    flow = net(F.pad(mov, padding), F.pad(fix, padding))[..., : shape[0], : shape[1], : shape[2]]
    wmask = warp(torch.from_numpy(d["insp_mask"]).float()[None, None].to(device), flow, "nearest")
    fmask = torch.from_numpy(d["exp_mask"]).float()[None, None].to(device)
    dice = (2 * (wmask * fmask).sum() / (wmask.sum() + fmask.sum())).item()
    # flow maps fixed-space points to moving space: x_exp + u(x_exp) ~ x_insp
    lm_exp = torch.from_numpy(d["lm_exp"]).long().to(device)
    u = flow[0][:, lm_exp[:, 0], lm_exp[:, 1], lm_exp[:, 2]].T
    pred = lm_exp.float() + u
    spacing = torch.from_numpy(d["spacing"]).float().to(device)
    tre = ((pred - torch.from_numpy(d["lm_insp"]).float().to(device)) * spacing).norm(dim=1).mean().item()
    return os.path.basename(path), tre, dice


def main_worker(gpu, ngpus, args):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=gpu, world_size=ngpus)
    device = torch.device("cuda", gpu)
    # different patch draws per rank; DDP broadcasts rank 0's initial weights anyway
    torch.manual_seed(1000 + gpu)

    files = sorted(glob.glob(os.path.join(args.data, "case*.npz")))
    val_names = set(args.val_cases.split(","))
    train_files = [f for f in files if os.path.basename(f)[:-4] not in val_names]
    val_files = [f for f in files if os.path.basename(f)[:-4] in val_names]

    ds = PatchPairs(train_files, args.patch, args.patches_per_case)
    sampler = DistributedSampler(ds, num_replicas=ngpus, rank=gpu, shuffle=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        worker_init_fn=seed_worker, pin_memory=True, drop_last=True, persistent_workers=True)

    model = DDP(PatchRegNet().to(device), device_ids=[gpu])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
    if gpu == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        stats = torch.zeros(2, device=device)
        for mov, fix in loader:
            mov, fix = mov.to(device, non_blocking=True), fix.to(device, non_blocking=True)
            flow = model(mov, fix)
            loss = ncc_global(warp(mov, flow), fix) + args.alpha * diffusion(flow)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(stats)

        if epoch % 20 == 19 or epoch == args.epochs - 1:
            model.eval()
            mine = [evaluate_case(model.module, f, device) for f in val_files[gpu::ngpus]]
            everything = [None] * ngpus
            dist.all_gather_object(everything, mine)
            if gpu == 0:
                rows = sorted(r for part in everything for r in part)
                for name, tre, dsc in rows:
                    print(f"   {name}: TRE {tre:.2f} mm  lung Dice {dsc:.4f}")
                print(f"epoch {epoch}: loss {(stats[0] / stats[1]).item():.4f}  "
                      f"mean TRE {np.mean([r[1] for r in rows]):.2f} mm", flush=True)
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()},
                           os.path.join(args.out, f"epoch_{epoch + 1}.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    ngpus = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus, args=(ngpus, args), join=True)
