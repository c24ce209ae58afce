"""
Full-resolution (1 mm, 192x224x192) brain MR registration: affine + deformable, one network.

Stage A (first --affine-epochs epochs): only the affine head is trained (the dense flow is frozen
at zero by not using it). Stage B: the deformable branch is trained on top of the affine warp and
the affine head is kept fixed by no longer feeding it to the loss.
The full-res decoder is activation-checkpointed, otherwise one pair does not fit in 40 GB.

    torchrun --nproc_per_node=8 11_highres_affine_deform_ckpt.py --train /data/brains/train.csv \
        --val /data/brains/val.csv --out runs/highres
"""
import argparse
import csv
import os
import time

import nibabel as nib
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class CsvPairs(Dataset):
    def __init__(self, csv_path, with_labels=False):
        with open(csv_path) as f:
            self.rows = list(csv.DictReader(f))
        self.with_labels = with_labels

    def __len__(self):
        return len(self.rows)

    @staticmethod
    def _img(path):
        v = nib.load(path).get_fdata(dtype=np.float32)
        p99 = np.percentile(v, 99.5)
        return torch.from_numpy(np.clip(v / p99, 0, 1))[None]

    def __getitem__(self, i):
        r = self.rows[i]
        out = {"moving": self._img(r["moving"]), "fixed": self._img(r["fixed"])}
        if self.with_labels:
            out["moving_seg"] = torch.from_numpy(np.asarray(nib.load(r["moving_seg"]).dataobj, np.int64))[None]
            out["fixed_seg"] = torch.from_numpy(np.asarray(nib.load(r["fixed_seg"]).dataobj, np.int64))[None]
        return out


def block(i, o, s=1):
    return nn.Sequential(nn.Conv3d(i, o, 3, s, 1), nn.LeakyReLU(0.2, True), nn.Conv3d(o, o, 3, 1, 1), nn.LeakyReLU(0.2, True))


class AffineDeformNet(nn.Module):
    def __init__(self, c=16, use_checkpoint=True):
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.enc = nn.ModuleList([block(2, c), block(c, 2 * c, 2), block(2 * c, 4 * c, 2),
                                  block(4 * c, 8 * c, 2), block(8 * c, 8 * c, 2)])
        self.affine_head = nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(8 * c, 64),
                                         nn.ReLU(True), nn.Linear(64, 12))
        nn.init.zeros_(self.affine_head[-1].weight)
        with torch.no_grad():
            self.affine_head[-1].bias.copy_(torch.eye(3, 4).flatten())
        self.dec = nn.ModuleList([block(16 * c, 8 * c), block(12 * c, 4 * c), block(6 * c, 2 * c), block(3 * c, c)])
        self.flow = nn.Conv3d(c, 3, 3, padding=1)
        nn.init.normal_(self.flow.weight, 0, 1e-5)
        nn.init.zeros_(self.flow.bias)

    def _run(self, mod, *xs):
        if self.use_checkpoint and self.training:
            return cp.checkpoint(mod, *xs, use_reentrant=True)
        return mod(*xs)

    def forward(self, moving, fixed, stage):
        x = torch.cat([moving, fixed], 1)
        feats = []
        for e in self.enc:
            x = e(x)
            feats.append(x)
        theta = self.affine_head(feats[-1]).view(-1, 3, 4)
        if stage == "affine":
            return theta, None
        y = feats[-1]
        for d, skip in zip(self.dec, feats[-2::-1]):
            y = F.interpolate(y, size=skip.shape[2:], mode="trilinear", align_corners=False)
            y = self._run(d, torch.cat([y, skip], 1))
        return theta.detach(), self.flow(y)


def compose_warp(src, theta, flow, mode="bilinear"):
    """Warp src by the affine theta followed by the dense displacement (in voxels, fixed space)."""
    b = src.shape[0]
    size = src.shape[2:]
    grid = F.affine_grid(theta, (b, 1, *size), align_corners=True)  # (B, D, H, W, 3) xyz in [-1, 1]
    if flow is not None:
        scale = torch.tensor([2.0 / (s - 1) for s in size[::-1]], device=src.device)
        grid = grid + flow.permute(0, 2, 3, 4, 1)[..., [2, 1, 0]] * scale
    return F.grid_sample(src, grid, mode=mode, padding_mode="border", align_corners=True)


def ncc(a, b, win=9):
    k = torch.ones(1, 1, win, win, win, device=a.device) / win ** 3
    m = lambda t: F.conv3d(t, k, padding=win // 2)
    ua, ub = m(a), m(b)
    cov = m(a * b) - ua * ub
    return -(cov ** 2 / ((m(a * a) - ua ** 2) * (m(b * b) - ub ** 2) + 1e-5)).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", default="runs/highres")
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--affine-epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--reg", type=float, default=1.5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    tr = CsvPairs(args.train)
    va = CsvPairs(args.val, with_labels=True)
    tr_s = DistributedSampler(tr, shuffle=True, drop_last=True)
    va_s = DistributedSampler(va, shuffle=False, drop_last=True)
    tr_l = DataLoader(tr, batch_size=1, sampler=tr_s, num_workers=6, pin_memory=True)
    va_l = DataLoader(va, batch_size=1, sampler=va_s, num_workers=4)

    net = AffineDeformNet().to(dev)
    # affine head is unused in stage B, the decoder in stage A
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        stage = "affine" if epoch < args.affine_epochs else "deform"
        tr_s.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=dev)
        for b in tr_l:
            mov, fix = b["moving"].to(dev, non_blocking=True), b["fixed"].to(dev, non_blocking=True)
            theta, flow = model(mov, fix, stage)
            warped = compose_warp(mov, theta, flow)
            loss = ncc(warped, fix)
            if flow is not None:
                loss = loss + args.reg * sum(flow.diff(dim=d).pow(2).mean() for d in (2, 3, 4))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=dev)])
        dist.all_reduce(tot)

        model.eval()
        dsum = torch.zeros(2, device=dev)
        with torch.no_grad():
            for b in va_l:
                mov, fix = b["moving"].to(dev), b["fixed"].to(dev)
                ms, fs = b["moving_seg"].to(dev).float(), b["fixed_seg"].to(dev)
                theta, flow = net(mov, fix, stage)
                w = compose_warp(ms, theta, flow, mode="nearest").long()
                labels = [l for l in torch.unique(fs).tolist() if l != 0]
                d = [2 * ((w == l) & (fs == l)).sum() / ((w == l).sum() + (fs == l).sum()).clamp(min=1) for l in labels]
                dsum += torch.stack([torch.stack(d).float().mean(), torch.ones((), device=dev)])
        dist.all_reduce(dsum)

        if rank == 0:
            print(f"[{stage}] epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} "
                  f"val dice {(dsum[0] / dsum[1]).item():.4f} {time.time() - t0:.0f}s", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
