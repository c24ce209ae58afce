"""Recurrent spiking U-Net for optical flow on DSEC-Flow.

The 15-bin voxel grid is fed one bin per time step; full-resolution BPTT over
15 steps does not fit at batch 4, so each time step is recomputed in the
backward pass (activation checkpointing through time).

Two DSEC training sequences are held out for validation (the public test GT
is only available through the benchmark server).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        13_dsec_flow_ckpt_through_time.py --root /shared/dsec_flow_prep --out /shared/exp/dsec_srunet
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
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VAL_SEQS = {"thun_00_a", "zurich_city_07_a"}


class DSECFlowClips(Dataset):
    """<root>/<seq>/<k>.npz: 'voxel' [15, 2, 480, 640] float16, 'flow' [2, 480, 640], 'valid' [480, 640]."""

    def __init__(self, root, val, crop=(288, 384)):
        seqs = sorted(os.path.basename(d) for d in glob.glob(os.path.join(root, "*")) if os.path.isdir(d))
        seqs = [s for s in seqs if (s in VAL_SEQS) == val]
        self.files = sorted(f for s in seqs for f in glob.glob(os.path.join(root, s, "*.npz")))
        self.val, self.crop = val, crop

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        vox = torch.from_numpy(d["voxel"].astype(np.float32))
        flow = torch.from_numpy(d["flow"].astype(np.float32))
        valid = torch.from_numpy(d["valid"].astype(np.float32))
        if not self.val:
            H, W = flow.shape[-2:]
            y0 = np.random.randint(0, H - self.crop[0] + 1)
            x0 = np.random.randint(0, W - self.crop[1] + 1)
            sl = (slice(y0, y0 + self.crop[0]), slice(x0, x0 + self.crop[1]))
            vox, flow, valid = vox[..., sl[0], sl[1]], flow[:, sl[0], sl[1]], valid[sl]
        return vox, flow, valid


class SurrogateHeaviside(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x >= 0).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g / (1 + (10 * x).abs()) ** 2


class ConvLIF(nn.Module):
    def __init__(self, cin, cout, stride=1, decay=0.5, th=1.0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm = nn.GroupNorm(8, cout)
        self.decay, self.th = decay, th

    def forward(self, x, v):
        v = self.decay * v + self.norm(self.conv(x))
        s = SurrogateHeaviside.apply(v - self.th)
        return s, v - s * self.th  # soft reset keeps the residual


class SpikingUNet(nn.Module):
    def __init__(self, base=32):
        super().__init__()
        c = [base, base * 2, base * 4, base * 8]
        self.enc = nn.ModuleList([ConvLIF(2, c[0]), ConvLIF(c[0], c[1], 2), ConvLIF(c[1], c[2], 2), ConvLIF(c[2], c[3], 2)])
        self.dec = nn.ModuleList([ConvLIF(c[3] + c[2], c[2]), ConvLIF(c[2] + c[1], c[1]), ConvLIF(c[1] + c[0], c[0])])
        self.head = nn.Conv2d(c[0], 2, 1)
        # (channels, stride) of every membrane, encoder first
        self.state_layout = [(c[0], 1), (c[1], 2), (c[2], 4), (c[3], 8), (c[2], 4), (c[1], 2), (c[0], 1)]

    def step(self, x, *vs):
        vs = list(vs)
        skips, h, k = [], x, 0
        for layer in self.enc:
            h, vs[k] = layer(h, vs[k])
            skips.append(h)
            k += 1
        for layer, skip in zip(self.dec, reversed(skips[:-1])):
            h = F.interpolate(h, size=skip.shape[-2:], mode="nearest")
            h, vs[k] = layer(torch.cat([h, skip], 1), vs[k])
            k += 1
        # the flow head reads the (non-spiking) membrane of the last decoder layer
        return (self.head(vs[-1]), *vs)

    def init_state(self, x):
        N, _, H, W = x.shape
        return [x.new_zeros(N, ch, -(-H // s), -(-W // s)) for ch, s in self.state_layout]

    def forward(self, vox, use_ckpt=True):
        # vox [N, T, 2, H, W]; membranes start at zero for every clip
        vs = self.init_state(vox[:, 0])
        flow = None
        for t in range(vox.size(1)):
            if use_ckpt and self.training:
                out = checkpoint(self.step, vox[:, t], *vs, use_reentrant=False)
            else:
                out = self.step(vox[:, t], *vs)
            flow, vs = out[0], list(out[1:])
        return flow


def epe_stats(pred, flow, valid):
    epe = torch.norm(pred - flow, dim=1)
    m = valid > 0
    return torch.stack([epe[m].sum(), (epe[m] > 3).float().sum(), m.sum().float()])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True, help="shared filesystem, visible from every node")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set, val_set = DSECFlowClips(args.root, val=False), DSECFlowClips(args.root, val=True)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)), batch_size=1,
                            num_workers=2, pin_memory=True)

    net = SpikingUNet().to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total + 100,
                                                    pct_start=0.05, anneal_strategy="linear")

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        acc = torch.zeros(2, device=device)
        for vox, flow, valid in train_loader:
            vox = vox.to(device, non_blocking=True)
            flow, valid = flow.to(device, non_blocking=True), valid.to(device, non_blocking=True)
            pred = model(vox)
            loss = (torch.norm(pred - flow, dim=1) * valid).sum() / valid.sum().clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)

        net.eval()
        stats = torch.zeros(3, device=device)
        with torch.no_grad():
            for vox, flow, valid in val_loader:
                pred = net(vox.to(device), use_ckpt=False)
                stats += epe_stats(pred, flow.to(device), valid.to(device))
        dist.all_reduce(stats)

        if rank == 0:
            print(f"epoch {epoch}: train EPE {(acc[0] / acc[1]).item():.3f} | val EPE {(stats[0] / stats[2]).item():.3f} "
                  f"3PE {100 * (stats[1] / stats[2]).item():.2f}% | {time.time() - tic:.0f}s", flush=True)
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"epoch_{epoch:03d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
