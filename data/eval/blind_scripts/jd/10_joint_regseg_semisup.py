"""
Joint registration + segmentation (DeepAtlas-style, shared encoder) on abdominal CT,
semi-supervised: only ~25% of the training scans have organ labels.

For every pair (moving, fixed):
  * registration branch predicts a dense displacement, trained with LNCC + diffusion;
  * if the fixed scan is labelled, the segmentation head is trained with Dice+CE on it, and an
    anatomy loss compares the warped moving labels with the fixed labels.

    torchrun --nproc_per_node=4 10_joint_regseg_semisup.py --cfg cfg/abdomen_ct.yaml
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def conv_in(i, o, s=1):
    return nn.Sequential(nn.Conv3d(i, o, 3, s, 1, bias=False), nn.InstanceNorm3d(o, affine=True), nn.LeakyReLU(0.2, True))


class Encoder(nn.Module):
    def __init__(self, cin, chs):
        super().__init__()
        self.stages = nn.ModuleList()
        prev = cin
        for i, c in enumerate(chs):
            self.stages.append(nn.Sequential(conv_in(prev, c, 1 if i == 0 else 2), conv_in(c, c)))
            prev = c

    def forward(self, x):
        feats = []
        for s in self.stages:
            x = s(x)
            feats.append(x)
        return feats


class Decoder(nn.Module):
    def __init__(self, chs):
        super().__init__()
        self.blocks = nn.ModuleList()
        for hi, lo in zip(chs[::-1][:-1], chs[::-1][1:]):
            self.blocks.append(conv_in(hi + lo, lo))

    def forward(self, feats):
        x = feats[-1]
        for blk, skip in zip(self.blocks, feats[::-1][1:]):
            x = F.interpolate(x, size=skip.shape[2:], mode="trilinear", align_corners=False)
            x = blk(torch.cat([x, skip], 1))
        return x


class JointNet(nn.Module):
    def __init__(self, n_classes, chs=(16, 32, 64, 96, 128)):
        super().__init__()
        self.encoder = Encoder(2, chs)
        self.reg_decoder = Decoder(chs)
        self.flow = nn.Conv3d(chs[0], 3, 3, padding=1)
        nn.init.normal_(self.flow.weight, 0, 1e-5)
        nn.init.zeros_(self.flow.bias)
        self.seg_decoder = Decoder(chs)
        self.seg_out = nn.Conv3d(chs[0], n_classes, 1)

    def forward(self, moving, fixed, need_seg=False):
        feats = self.encoder(torch.cat([moving, fixed], 1))
        flow = self.flow(self.reg_decoder(feats))
        seg_logits = self.seg_out(self.seg_decoder(feats)) if need_seg else None
        return flow, seg_logits


def warp(x, flow, mode="bilinear"):
    shape = flow.shape[2:]
    mesh = torch.meshgrid([torch.arange(s, device=flow.device, dtype=flow.dtype) for s in shape], indexing="ij")
    loc = torch.stack(mesh)[None] + flow
    loc = torch.stack([2 * loc[:, i] / (shape[i] - 1) - 1 for i in range(3)], -1)[..., [2, 1, 0]]
    return F.grid_sample(x, loc, mode=mode, padding_mode="border", align_corners=True)


def lncc(a, b, win=7):
    k = torch.ones(1, 1, win, win, win, device=a.device) / win ** 3
    f = lambda t: F.conv3d(t, k, padding=win // 2)
    ma, mb = f(a), f(b)
    va, vb, cov = f(a * a) - ma * ma, f(b * b) - mb * mb, f(a * b) - ma * mb
    return 1 - (cov * cov / (va * vb + 1e-5)).mean()


def soft_dice(prob, onehot, eps=1e-5):
    dims = (0, 2, 3, 4)
    inter = (prob * onehot).sum(dims)
    return 1 - ((2 * inter + eps) / (prob.sum(dims) + onehot.sum(dims) + eps))[1:].mean()


class AbdomenPairs(Dataset):
    """Pairs of preprocessed scans (192x160x192, HU clipped to [-500, 800], scaled to [0, 1])."""

    def __init__(self, root, names, n_classes, labelled):
        self.root, self.names, self.C, self.labelled = root, names, n_classes, set(labelled)

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        fixed_name = self.names[i]
        moving_name = random.choice([n for n in self.names if n != fixed_name])
        mov = np.load(os.path.join(self.root, "img", moving_name + ".npy"))
        fix = np.load(os.path.join(self.root, "img", fixed_name + ".npy"))
        has = fixed_name in self.labelled and moving_name in self.labelled
        if has:
            mseg = np.load(os.path.join(self.root, "seg", moving_name + ".npy")).astype(np.int64)
            fseg = np.load(os.path.join(self.root, "seg", fixed_name + ".npy")).astype(np.int64)
        else:
            mseg = fseg = np.zeros(fix.shape, np.int64)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a))[None]
        return t(mov.astype(np.float32)), t(fix.astype(np.float32)), t(mseg), t(fseg), torch.tensor(has)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))
    root, C = cfg["root"], cfg["n_classes"]

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(cfg.get("seed", 0) + rank)

    with open(os.path.join(root, "splits.yaml")) as f:
        split = yaml.safe_load(f)
    train_ds = AbdomenPairs(root, split["train"], C, split["train_labelled"])
    val_ds = AbdomenPairs(root, split["val"], C, split["val"])
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=1, sampler=sampler, num_workers=cfg.get("workers", 6),
                        pin_memory=True, drop_last=True)

    model = DDP(JointNet(C).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.get("lr", 2e-4), weight_decay=1e-5)
    w_reg, w_seg, w_ana = cfg.get("w_reg", 1.0), cfg.get("w_seg", 1.0), cfg.get("w_anat", 0.5)
    out_dir = cfg.get("out", "runs/joint_regseg")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)

    for epoch in range(cfg.get("epochs", 300)):
        sampler.set_epoch(epoch)
        model.train()
        meter = torch.zeros(3, device=device)
        for mov, fix, mseg, fseg, has in loader:
            mov, fix = mov.to(device, non_blocking=True), fix.to(device, non_blocking=True)
            labelled = bool(has.all())
            flow, seg_logits = model(mov, fix, need_seg=labelled)
            warped = warp(mov, flow)
            loss = lncc(warped, fix) + w_reg * sum(flow.diff(dim=d).pow(2).mean() for d in (2, 3, 4))
            if labelled:
                fseg, mseg = fseg.to(device), mseg.to(device)
                f_oh = F.one_hot(fseg[:, 0], C).permute(0, 4, 1, 2, 3).float()
                m_oh = F.one_hot(mseg[:, 0], C).permute(0, 4, 1, 2, 3).float()
                prob = seg_logits.softmax(1)
                loss = loss + w_seg * (soft_dice(prob, f_oh) + F.cross_entropy(seg_logits, fseg[:, 0]))
                loss = loss + w_ana * soft_dice(warp(m_oh, flow), f_oh)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            meter += torch.tensor([loss.item(), float(labelled), 1.0], device=device)
        dist.all_reduce(meter)

        # validation: anatomy Dice of warped moving labels, pairs strided over ranks
        net = model.module
        net.eval()
        vd = torch.zeros(2, device=device)
        with torch.no_grad():
            for i in range(rank, len(val_ds), world):
                mov, fix, mseg, fseg, _ = (x[None].to(device) for x in val_ds[i])
                flow, _ = net(mov, fix)
                w = warp(mseg.float(), flow, mode="nearest").long()
                ds = [2 * ((w == c) & (fseg == c)).sum() / ((w == c).sum() + (fseg == c).sum()).clamp(min=1)
                      for c in range(1, C)]
                vd += torch.stack([torch.stack(ds).float().mean(), torch.ones((), device=device)])
        dist.all_reduce(vd)
        if rank == 0:
            print(f"epoch {epoch}: loss {(meter[0] / meter[2]).item():.4f}, labelled pairs {int(meter[1])}, "
                  f"val Dice {(vd[0] / vd[1]).item():.4f}", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict()},
                       os.path.join(out_dir, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
