"""
Multimodal MR -> CT deformable registration (head & neck, paired scans of the same patient)
with a MIND-SSC similarity and diffusion regularisation. Long jobs on a preemptible partition,
so training auto-resumes from <out>/latest.pth.

    torchrun --nproc_per_node=4 20_mr_ct_mind_resume.py --data /data/hn_mrct --out runs/mrct_mind
"""
import argparse
import glob
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


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/mrct_mind")
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--alpha", type=float, default=0.25)
    p.add_argument("--val-every", type=int, default=10)
    return p.parse_args()


class MRCTPairs(Dataset):
    """npz per patient: mr (moving), ct (fixed), mr_seg / ct_seg (organs at risk), all 160x160x128."""

    def __init__(self, files, train=True):
        self.files, self.train = files, train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        mr = d["mr"].astype(np.float32)
        ct = np.clip((d["ct"].astype(np.float32) + 1000) / 2000, 0, 1)
        out = [torch.from_numpy(mr)[None], torch.from_numpy(ct)[None]]
        if not self.train:
            out += [torch.from_numpy(d["mr_seg"].astype(np.int64))[None], torch.from_numpy(d["ct_seg"].astype(np.int64))[None]]
        return out


def mind_ssc(img, radius=2, dilation=2):
    """MIND-SSC descriptor (Heinrich et al. 2013), 12 channels."""
    kernel_size = radius * 2 + 1
    six = torch.tensor([[0, 1, 1], [1, 1, 0], [1, 0, 1], [1, 1, 2], [2, 1, 1], [1, 2, 1]], device=img.device).long()
    dist_ = ((six[:, None] - six[None]) ** 2).sum(-1)
    x, y = torch.meshgrid(torch.arange(6, device=img.device), torch.arange(6, device=img.device), indexing="ij")
    m = (x > y) & (dist_ == 2)
    idx1 = six[None].repeat(6, 1, 1)[m]
    idx2 = six[:, None].repeat(1, 6, 1)[m]
    s1 = torch.zeros(12, 1, 3, 3, 3, device=img.device)
    s2 = torch.zeros(12, 1, 3, 3, 3, device=img.device)
    ar = torch.arange(12, device=img.device)
    s1[ar, 0, idx1[:, 0], idx1[:, 1], idx1[:, 2]] = 1
    s2[ar, 0, idx2[:, 0], idx2[:, 1], idx2[:, 2]] = 1
    rpad1, rpad2 = nn.ReplicationPad3d(dilation), nn.ReplicationPad3d(radius)
    ssd = F.avg_pool3d(rpad2((F.conv3d(rpad1(img), s1, dilation=dilation) -
                              F.conv3d(rpad1(img), s2, dilation=dilation)) ** 2), kernel_size, stride=1)
    mind = ssd - ssd.min(1, keepdim=True)[0]
    var = mind.mean(1, keepdim=True).clamp(mind.mean().item() * 0.001, mind.mean().item() * 1000)
    mind = torch.exp(-mind / var)
    return mind[:, [6, 8, 1, 11, 2, 10, 0, 7, 9, 4, 5, 3]]


class RegUNet(nn.Module):
    def __init__(self, c=(16, 32, 64, 64)):
        super().__init__()
        conv = lambda i, o, s=1: nn.Sequential(nn.Conv3d(i, o, 3, s, 1), nn.InstanceNorm3d(o), nn.LeakyReLU(0.2))
        self.enc = nn.ModuleList([conv(2, c[0])] + [conv(c[i], c[i + 1], 2) for i in range(len(c) - 1)])
        self.dec = nn.ModuleList([conv(c[i + 1] + c[i], c[i]) for i in reversed(range(len(c) - 1))])
        self.flow = nn.Conv3d(c[0], 3, 3, padding=1)
        nn.init.normal_(self.flow.weight, 0, 1e-5)
        nn.init.zeros_(self.flow.bias)

    def forward(self, mov, fix):
        x = torch.cat([mov, fix], 1)
        feats = []
        for e in self.enc:
            x = e(x)
            feats.append(x)
        for d, skip in zip(self.dec, feats[-2::-1]):
            x = d(torch.cat([F.interpolate(x, size=skip.shape[2:], mode="trilinear", align_corners=False), skip], 1))
        return self.flow(x)


def warp(x, flow, mode="bilinear"):
    sh = flow.shape[2:]
    g = torch.stack(torch.meshgrid([torch.arange(s, device=x.device, dtype=flow.dtype) for s in sh], indexing="ij"))[None]
    loc = g + flow
    loc = torch.stack([2 * loc[:, i] / (sh[i] - 1) - 1 for i in range(3)], -1)[..., [2, 1, 0]]
    return F.grid_sample(x, loc, mode=mode, padding_mode="border", align_corners=True)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    files = sorted(glob.glob(os.path.join(args.data, "*.npz")))
    n_val = max(len(files) // 10, world)
    tds, vds = MRCTPairs(files[n_val:]), MRCTPairs(files[:n_val], train=False)
    sampler = DistributedSampler(tds, shuffle=True)
    loader = DataLoader(tds, args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    model = RegUNet().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=1e-6)

    start_epoch, best = 0, 0.0
    latest = os.path.join(args.out, "latest.pth")
    if os.path.isfile(latest):
        ckpt = torch.load(latest)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        if rank == 0:
            print(f"resumed from {latest} at epoch {start_epoch}", flush=True)
    model = DDP(model, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=dev)
        for mr, ct in loader:
            mr, ct = mr.to(dev, non_blocking=True), ct.to(dev, non_blocking=True)
            flow = model(mr, ct)
            sim = F.mse_loss(mind_ssc(warp(mr, flow)), mind_ssc(ct))
            reg = sum(flow.diff(dim=k).pow(2).mean() for k in (2, 3, 4))
            loss = sim + args.alpha * reg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=dev)])
        sched.step()
        dist.all_reduce(tot)

        val_dice = None
        if (epoch + 1) % args.val_every == 0:
            net = model.module
            net.eval()
            acc = torch.zeros(2, device=dev)
            with torch.no_grad():
                for i in range(rank, len(vds), world):
                    mr, ct, ms, cs = (t[None].to(dev) for t in vds[i])
                    w = warp(ms.float(), net(mr, ct), mode="nearest").long()
                    labels = [l for l in torch.unique(cs).tolist() if l > 0]
                    d = torch.stack([2 * ((w == l) & (cs == l)).sum() / ((w == l).sum() + (cs == l).sum()).clamp(min=1)
                                     for l in labels]).float().mean()
                    acc += torch.stack([d, torch.ones((), device=dev)])
            dist.all_reduce(acc)
            val_dice = (acc[0] / acc[1]).item()

        if rank == 0:
            msg = f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} ({time.time() - t0:.0f}s)"
            if val_dice is not None:
                msg += f" val OAR dice {val_dice:.4f}"
                if val_dice > best:
                    best = val_dice
                    torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))
            print(msg, flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "best": best}, latest + ".tmp")
            os.replace(latest + ".tmp", latest)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
