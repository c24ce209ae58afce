"""DVS Gesture with long event windows (T up to 60 bins) and a recurrent-free LIF CNN.

BPTT over 60 steps does not fit in memory at 128x128, so each time step of the
deep part is wrapped in activation checkpointing and recomputed in backward.

Expected layout (written by tools/export_gesture_npz.py):
    <root>/{train,test}/<user>_<lighting>_<idx>.npz  with keys x, y, t, p, label

Run:
    torchrun --nnodes=1 --nproc_per_node=8 05_gesture_long_T_ckpt.py --root /data/gesture_npz --T 60
"""
import argparse
import glob
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class GestureNPZ(Dataset):
    def __init__(self, root, split, T, size=64, window_us=1_500_000, train=False):
        self.files = sorted(glob.glob(os.path.join(root, split, "*.npz")))
        self.T, self.size, self.window_us, self.train = T, size, window_us, train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        x, y, t, p = d["x"], d["y"], d["t"].astype(np.int64), d["p"].astype(np.int64)
        label = int(d["label"])
        # random (train) or centred (test) crop of window_us in time
        dur = int(t[-1] - t[0]) if t.size else 0
        if dur > self.window_us:
            off = np.random.randint(0, dur - self.window_us) if self.train else (dur - self.window_us) // 2
            lo = np.searchsorted(t, t[0] + off)
            hi = np.searchsorted(t, t[0] + off + self.window_us)
            x, y, t, p = x[lo:hi], y[lo:hi], t[lo:hi], p[lo:hi]
        vox = np.zeros((self.T, 2, self.size, self.size), dtype=np.float32)
        if t.size:
            b = ((t - t[0]) * self.T // (int(t[-1] - t[0]) + 1)).astype(np.int64)
            scale = 128 // self.size
            np.add.at(vox, (b, p, y.astype(np.int64) // scale, x.astype(np.int64) // scale), 1.0)
        if self.train and np.random.rand() < 0.5:
            vox = vox[..., ::-1].copy() if label not in (1, 2, 3, 4, 5, 6) else vox  # left/right-specific classes stay
        return torch.from_numpy(np.log1p(vox)), label


class PLIFCell(nn.Module):
    """Parametric LIF step: learnable decay (Fang et al. 2021), sigmoid surrogate."""

    def __init__(self, init_tau=2.0, v_th=1.0, alpha=4.0):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(-float(np.log(init_tau - 1.0))))
        self.v_th, self.alpha = v_th, alpha

    def forward(self, x, v):
        v = v + (x - v) * torch.sigmoid(self.w)
        sg = torch.sigmoid(self.alpha * (v - self.v_th))
        s = (v >= self.v_th).float().detach() + sg - sg.detach()
        v = v * (1.0 - s.detach())
        return s, v


class LongTNet(nn.Module):
    def __init__(self, ch=64, num_classes=11):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, ch, 3, padding=1, bias=False), nn.GroupNorm(4, ch))
        self.conv2 = nn.Sequential(nn.Conv2d(ch, ch * 2, 3, stride=2, padding=1, bias=False), nn.GroupNorm(8, ch * 2))
        self.conv3 = nn.Sequential(nn.Conv2d(ch * 2, ch * 4, 3, stride=2, padding=1, bias=False), nn.GroupNorm(8, ch * 4))
        self.lif1, self.lif2, self.lif3 = PLIFCell(), PLIFCell(), PLIFCell()
        self.head = nn.Linear(ch * 4, num_classes)

    def _step(self, c1, v1, v2, v3):
        s1, v1 = self.lif1(c1, v1)
        s2, v2 = self.lif2(self.conv2(s1), v2)
        s3, v3 = self.lif3(self.conv3(s2), v3)
        feat = s3.mean(dim=(2, 3))
        return self.head(feat), s1.mean() + s2.mean() + s3.mean(), v1, v2, v3

    def forward(self, x):  # x: [B, T, 2, H, W]
        B, T = x.shape[:2]
        c1 = self.stem(x.flatten(0, 1)).view(B, T, -1, x.shape[-2], x.shape[-1])
        H, W = x.shape[-2:]
        ch = c1.shape[2]
        v1 = c1.new_zeros(B, ch, H, W)
        v2 = c1.new_zeros(B, ch * 2, H // 2, W // 2)
        v3 = c1.new_zeros(B, ch * 4, H // 4, W // 4)
        logits, rate = 0.0, 0.0
        for t in range(T):
            if self.training:
                out, r, v1, v2, v3 = checkpoint(self._step, c1[:, t], v1, v2, v3, use_reentrant=True)
            else:
                out, r, v1, v2, v3 = self._step(c1[:, t], v1, v2, v3)
            logits = logits + out
            rate = rate + r
        return logits / T, rate / (3 * T)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--T", type=int, default=60)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--bs", type=int, default=8, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rate-target", type=float, default=0.08)
    ap.add_argument("--rate-coef", type=float, default=0.5)
    ap.add_argument("--out", default="out/gesture_longT")
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    train_ds = GestureNPZ(args.root, "train", args.T, train=True)
    test_ds = GestureNPZ(args.root, "test", args.T, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, drop_last=True,
                          num_workers=args.workers, pin_memory=True,
                          worker_init_fn=lambda w: np.random.seed((torch.initial_seed() + w) % 2**32))
    test_dl = DataLoader(Subset(test_ds, list(range(rank, len(test_ds), world))), batch_size=args.bs,
                         num_workers=args.workers, pin_memory=True)

    model = LongTNet().to(dev)
    model = DDP(model, device_ids=[local_rank])
    # keep the per-sample lr of the 1-GPU recipe (bs 8, lr 1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr * world, epochs=args.epochs,
                                                steps_per_epoch=len(train_dl), pct_start=0.1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t_start = time.time()
        agg = torch.zeros(3, device=dev)
        for x, y in train_dl:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            logits, rate = model(x)
            loss = F.cross_entropy(logits, y) + args.rate_coef * (rate - args.rate_target) ** 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            agg += torch.stack([loss.detach(), rate.detach(), torch.ones((), device=dev)])
        dist.all_reduce(agg)

        net = model.module
        net.eval()
        hit = torch.zeros(2, device=dev)
        with torch.no_grad():
            for x, y in test_dl:
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                logits, _ = net(x)
                hit += torch.stack([(logits.argmax(1) == y).sum().float(), torch.tensor(float(len(y)), device=dev)])
        dist.all_reduce(hit)
        acc = (hit[0] / hit[1]).item()

        if rank == 0:
            print(f"epoch {epoch:3d} loss {agg[0] / agg[2]:.4f} rate {agg[1] / agg[2]:.3f} "
                  f"test {acc:.4f} ({int(hit[1])} samples) {time.time() - t_start:.0f}s", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save({"epoch": epoch, "model": net.state_dict(), "acc": acc},
                           os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
