"""
Symmetric diffeomorphic registration of longitudinal T1 pairs (ADNI baseline -> 24-month follow-up),
with inverse-consistency loss. After training, rank 0 reloads the best checkpoint and reports
Dice (FreeSurfer aseg labels) and the fraction of folding voxels (det J <= 0) on the test pairs.

    torchrun --nproc_per_node=4 15_longitudinal_sym_diffeo.py --pairs /data/adni_long/pairs.json
"""
import argparse
import json
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

ASEG_LABELS = [2, 3, 4, 7, 8, 10, 11, 12, 13, 16, 17, 18, 26, 28, 41, 42, 43, 46, 47, 49, 50, 51, 52, 53, 54, 58, 60]


class LongitudinalPairs(Dataset):
    def __init__(self, entries, with_seg=False):
        self.entries = entries
        self.with_seg = with_seg

    def __len__(self):
        return len(self.entries)

    def __getitem__(self, i):
        e = self.entries[i]
        bl, fu = np.load(e["baseline"]), np.load(e["followup"])
        out = [torch.from_numpy(bl["vol"].astype(np.float32))[None], torch.from_numpy(fu["vol"].astype(np.float32))[None]]
        if self.with_seg:
            out += [torch.from_numpy(bl["aseg"].astype(np.int64))[None], torch.from_numpy(fu["aseg"].astype(np.int64))[None]]
        return out


def cbr(i, o, s=1):
    return nn.Sequential(nn.Conv3d(i, o, 3, s, 1), nn.LeakyReLU(0.2))


class SymNet(nn.Module):
    def __init__(self, inshape, c=16, steps=7):
        super().__init__()
        self.enc = nn.ModuleList([cbr(2, c, 2), cbr(c, 2 * c, 2), cbr(2 * c, 2 * c, 2), cbr(2 * c, 2 * c, 2)])
        self.dec = nn.ModuleList([cbr(4 * c, 2 * c), cbr(4 * c, 2 * c), cbr(3 * c, 2 * c), cbr(2 * c + 2, c)])
        self.vel = nn.Conv3d(c, 3, 3, padding=1)
        nn.init.normal_(self.vel.weight, 0, 1e-5)
        nn.init.zeros_(self.vel.bias)
        self.steps = steps
        grid = torch.stack(torch.meshgrid([torch.arange(s) for s in inshape], indexing="ij"))[None].float()
        self.register_buffer("grid", grid, persistent=False)

    def warp(self, x, disp, mode="bilinear"):
        loc = self.grid + disp
        shape = disp.shape[2:]
        loc = torch.stack([2 * loc[:, i] / (shape[i] - 1) - 1 for i in range(3)], -1)[..., [2, 1, 0]]
        return F.grid_sample(x, loc, mode=mode, padding_mode="border", align_corners=True)

    def exp(self, v):
        d = v / 2 ** self.steps
        for _ in range(self.steps):
            d = d + self.warp(d, d)
        return d

    def forward(self, a, b):
        x = torch.cat([a, b], 1)
        skips = [x]
        for e in self.enc:
            x = e(x)
            skips.append(x)
        skips.pop()
        for d in self.dec:
            x = F.interpolate(x, scale_factor=2, mode="trilinear", align_corners=False)
            x = d(torch.cat([x, skips.pop()], 1))
        v = self.vel(x)
        return self.exp(v), self.exp(-v)


def lncc(a, b, w=9):
    k = torch.ones(1, 1, w, w, w, device=a.device) / w ** 3
    f = lambda t: F.conv3d(t, k, padding=w // 2)
    ua, ub = f(a), f(b)
    cov = f(a * b) - ua * ub
    return -(cov ** 2 / ((f(a * a) - ua ** 2) * (f(b * b) - ub ** 2) + 1e-5)).mean()


def jacobian_det(disp):
    d = disp[0]
    grads = [torch.gradient(d[i], dim=(0, 1, 2)) for i in range(3)]
    J = torch.stack([torch.stack(g) for g in grads]) + torch.eye(3, device=d.device)[..., None, None, None]
    return torch.det(J.permute(2, 3, 4, 0, 1))


def dice(a, b, labels):
    return float(np.mean([(2 * ((a == l) & (b == l)).sum() / max(((a == l).sum() + (b == l).sum()).item(), 1)).item()
                          for l in labels]))


@torch.no_grad()
def test(ckpt_path, inshape, entries, device):
    net = SymNet(inshape).to(device)
    net.load_state_dict(torch.load(ckpt_path, map_location=device))
    net.eval()
    ds = LongitudinalPairs(entries, with_seg=True)
    dices, folds = [], []
    for i in range(len(ds)):
        bl, fu, bl_seg, fu_seg = (t[None].to(device) for t in ds[i])
        fwd, _ = net(bl, fu)
        w = net.warp(bl_seg.float(), fwd, mode="nearest").long()
        dices.append(dice(w, fu_seg, ASEG_LABELS))
        folds.append((jacobian_det(fwd) <= 0).float().mean().item())
    print(f"TEST  Dice {np.mean(dices):.4f} +- {np.std(dices):.4f}   |J|<=0: {100 * np.mean(folds):.4f}%")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", required=True, help="json with train/val/test lists of {baseline, followup}")
    ap.add_argument("--out", default="runs/long_sym")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--w-smooth", type=float, default=1.0)
    ap.add_argument("--w-ic", type=float, default=0.1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{local_rank}")

    with open(args.pairs) as f:
        splits = json.load(f)
    train_ds = LongitudinalPairs(splits["train"])
    val_ds = LongitudinalPairs(splits["val"])
    inshape = tuple(train_ds[0][0].shape[1:])
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=1, sampler=sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=2,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))

    model = DDP(SymNet(inshape).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    best_path = os.path.join(args.out, "best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = float("inf")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for bl, fu in loader:
            bl, fu = bl.to(device), fu.to(device)
            fwd, bwd = model(bl, fu)
            net = model.module
            sim = lncc(net.warp(bl, fwd), fu) + lncc(net.warp(fu, bwd), bl)
            smooth = sum(fwd.diff(dim=d).pow(2).mean() for d in (2, 3, 4))
            ic = (fwd + net.warp(bwd, fwd)).pow(2).mean()
            loss = sim + args.w_smooth * smooth + args.w_ic * ic
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        model.eval()
        vl = torch.zeros(2, device=device)
        with torch.no_grad():
            for bl, fu in val_loader:
                bl, fu = bl.to(device), fu.to(device)
                fwd, _ = model.module(bl, fu)
                vl += torch.stack([lncc(model.module.warp(bl, fwd), fu), torch.ones((), device=device)])
        dist.all_reduce(vl)
        val_loss = (vl[0] / vl[1]).item()
        if rank == 0:
            print(f"epoch {epoch} val lncc {val_loss:.5f} ({time.time() - t0:.0f}s)", flush=True)
            if val_loss < best:
                best = val_loss
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    if rank == 0:
        test(best_path, inshape, splits["test"], device)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
