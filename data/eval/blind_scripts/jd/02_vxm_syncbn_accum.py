"""
Diffeomorphic VoxelMorph with normalised conv blocks, trained on inter-subject
pairs of skull-stripped T1 brains (LPBA40-style, 160x192x160).

Memory is the limit here (batch of 1 pair per GPU), so we
  * checkpoint the scaling-and-squaring integration (7 full-res warps),
  * accumulate gradients over `--accum` pairs,
  * use SyncBatchNorm so the norm statistics see every GPU's pair.

torchrun --nnodes=1 --nproc_per_node=8 02_vxm_syncbn_accum.py --cfg configs/lpba_diff.yaml
"""
import argparse
import contextlib
import os
import random

import nibabel as nib
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    train_list="lists/lpba_train.txt",
    val_list="lists/lpba_val.txt",
    out_dir="checkpoints/lpba_diff",
    epochs=300,
    lr=1e-4,
    accum=4,
    lambda_grad=1.0,
    int_steps=7,
    workers=6,
    resume=None,
    seed=0,
)


class NormConv(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, 3, stride, 1, bias=False)
        self.bn = nn.BatchNorm3d(cout)
        self.act = nn.LeakyReLU(0.2, inplace=True)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class RegNet(nn.Module):
    def __init__(self, inshape, enc=(16, 32, 32, 32), dec=(32, 32, 32, 32), int_steps=7, ckpt=True):
        super().__init__()
        self.ckpt = ckpt
        self.enc = nn.ModuleList()
        prev = 2
        for c in enc:
            self.enc.append(NormConv(prev, c, stride=2))
            prev = c
        skips = [2] + list(enc[:-1])
        self.dec = nn.ModuleList()
        for i, c in enumerate(dec):
            self.dec.append(NormConv(prev + skips[-(i + 1)], c))
            prev = c
        self.head = nn.Sequential(NormConv(prev, 16), nn.Conv3d(16, 3, 3, padding=1))
        nn.init.normal_(self.head[-1].weight, 0.0, 1e-5)
        nn.init.zeros_(self.head[-1].bias)
        self.int_steps = int_steps
        grids = torch.meshgrid([torch.arange(s) for s in inshape], indexing="ij")
        self.register_buffer("grid", torch.stack(grids)[None].float(), persistent=False)

    def warp(self, src, flow, mode="bilinear"):
        locs = self.grid + flow
        shape = flow.shape[2:]
        locs = torch.stack([2 * (locs[:, i] / (shape[i] - 1) - 0.5) for i in range(3)], dim=1)
        locs = locs.permute(0, 2, 3, 4, 1)[..., [2, 1, 0]]
        return F.grid_sample(src, locs, align_corners=True, mode=mode)

    def integrate(self, v):
        v = v / (2 ** self.int_steps)
        for _ in range(self.int_steps):
            v = v + self.warp(v, v)
        return v

    def forward(self, moving, fixed):
        x = torch.cat([moving, fixed], 1)
        feats = [x]
        for blk in self.enc:
            x = blk(x)
            feats.append(x)
        feats.pop()
        for blk in self.dec:
            x = F.interpolate(x, scale_factor=2, mode="nearest")
            x = blk(torch.cat([x, feats.pop()], 1))
        v = self.head(x)
        if self.ckpt and self.training:
            flow = checkpoint(self.integrate, v, use_reentrant=False)
        else:
            flow = self.integrate(v)
        return self.warp(moving, flow), flow


def lncc(a, b, win=9, eps=1e-5):
    k = torch.ones(1, 1, win, win, win, device=a.device, dtype=a.dtype) / win ** 3
    mu_a, mu_b = F.conv3d(a, k, padding=win // 2), F.conv3d(b, k, padding=win // 2)
    var_a = F.conv3d(a * a, k, padding=win // 2) - mu_a ** 2
    var_b = F.conv3d(b * b, k, padding=win // 2) - mu_b ** 2
    cov = F.conv3d(a * b, k, padding=win // 2) - mu_a * mu_b
    return -(cov ** 2 / (var_a * var_b + eps)).mean()


def smoothness(flow):
    d = [flow.diff(dim=k) for k in (2, 3, 4)]
    return sum(t.pow(2).mean() for t in d) / 3


class PairDataset(Dataset):
    """Random (moving, fixed) pairs drawn from the subject list; an epoch is len(subjects) pairs."""

    def __init__(self, list_file, with_seg=False):
        with open(list_file) as f:
            self.subjects = [l.strip() for l in f if l.strip()]
        self.with_seg = with_seg

    def __len__(self):
        return len(self.subjects)

    def _load(self, subj):
        vol = nib.load(os.path.join(subj, "brain.nii.gz")).get_fdata(dtype=np.float32)
        vol = (vol - vol.min()) / (vol.max() - vol.min() + 1e-6)
        out = [torch.from_numpy(vol)[None]]
        if self.with_seg:
            seg = np.asarray(nib.load(os.path.join(subj, "seg.nii.gz")).dataobj, dtype=np.int64)
            out.append(torch.from_numpy(seg)[None])
        return out

    def __getitem__(self, idx):
        fixed = self.subjects[idx]
        other = (idx + 1 + random.randrange(len(self.subjects) - 1)) % len(self.subjects)
        return (*self._load(self.subjects[other]), *self._load(fixed))


def mean_dice(a, b):
    labels = torch.unique(b)
    labels = labels[labels != 0]
    scores = [(2 * ((a == l) & (b == l)).sum() / ((a == l).sum() + (b == l).sum()).clamp(min=1)) for l in labels]
    return torch.stack(scores).float().mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.cfg:
        with open(cli.cfg) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(cfg["seed"] + rank)
    np.random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"])

    train_ds = PairDataset(cfg["train_list"])
    val_ds = PairDataset(cfg["val_list"], with_seg=True)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"])
    loader = DataLoader(train_ds, batch_size=1, sampler=sampler, num_workers=cfg["workers"],
                        pin_memory=True, drop_last=True, persistent_workers=True)
    inshape = train_ds._load(train_ds.subjects[0])[0].shape[1:]

    model = RegNet(inshape, int_steps=cfg["int_steps"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best = 0, -1.0
    if cfg["resume"]:
        state = torch.load(cfg["resume"], map_location="cpu")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        scaler.load_state_dict(state["scaler"])
        start_epoch, best = state["epoch"] + 1, state["best"]

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)

    accum = cfg["accum"]
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        opt.zero_grad(set_to_none=True)
        tot = torch.zeros(2, device=device)
        for it, (mov, fix) in enumerate(loader):
            mov, fix = mov.to(device, non_blocking=True), fix.to(device, non_blocking=True)
            last_micro = (it + 1) % accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    warped, flow = model(mov, fix)
                loss = lncc(fix.float(), warped.float()) + cfg["lambda_grad"] * smoothness(flow.float())
                scaler.scale(loss / accum).backward()
            if last_micro:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        # every rank scores a strided slice of the validation pairs, sums are reduced below
        net = model.module
        net.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for i in range(rank, len(val_ds), world):
                mov, mseg, fix, fseg = (t[None].to(device) for t in val_ds[i])
                _, flow = net(mov, fix)
                wseg = net.warp(mseg.float(), flow, mode="nearest").long()
                acc += torch.stack([mean_dice(wseg, fseg), torch.ones((), device=device)])
        dist.all_reduce(acc)
        val_dice = (acc[0] / acc[1]).item()

        if rank == 0:
            print(f"[{epoch}] loss={tot[0].item() / tot[1].item():.4f} dice={val_dice:.4f}", flush=True)
            state = {"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(),
                     "scaler": scaler.state_dict(), "best": max(best, val_dice)}
            torch.save(state, os.path.join(cfg["out_dir"], "last.pt"))
            if val_dice > best:
                torch.save(state, os.path.join(cfg["out_dir"], "best.pt"))
        best = max(best, val_dice)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
