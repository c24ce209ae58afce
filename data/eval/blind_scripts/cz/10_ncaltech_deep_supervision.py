"""N-Caltech101 with a 4-stage LIF CNN and an auxiliary (deep supervision) head.

The auxiliary classifier on stage-2 features is only used during the first
--aux-epochs epochs to get gradients into the early spiking layers; afterwards
the network is trained on the main head alone.

Data: events exported as <root>/<class>/<image_xxxx>.npy (structured x, y, t, p).

    torchrun --nproc_per_node=4 10_ncaltech_deep_supervision.py --root /data/ncaltech101_npy
"""
import argparse
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

H, W = 180, 240


def list_split(root, test_frac=0.2, seed=0):
    """Per-class split with a fixed RNG -> identical on every rank and every run."""
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    rng = np.random.RandomState(seed)
    train, test = [], []
    for ci, c in enumerate(classes):
        files = sorted(os.listdir(os.path.join(root, c)))
        perm = rng.permutation(len(files))
        n_test = max(1, int(round(len(files) * test_frac)))
        for k, j in enumerate(perm):
            (test if k < n_test else train).append((os.path.join(root, c, files[j]), ci))
    return classes, train, test


class EventFrames(Dataset):
    def __init__(self, items, T, out_hw=(90, 120), train=False):
        self.items, self.T, self.out_hw, self.train = items, T, out_hw, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        ev = np.load(path)
        x = np.clip(ev["x"].astype(np.int64), 0, W - 1)
        y = np.clip(ev["y"].astype(np.int64), 0, H - 1)
        t = ev["t"].astype(np.int64)
        p = (ev["p"] > 0).astype(np.int64)
        frames = np.zeros((self.T, 2, H, W), dtype=np.float32)
        if t.size:
            # equal event count per frame: robust to the saccade-driven bursts
            b = (np.arange(t.size) * self.T // t.size).astype(np.int64)
            np.add.at(frames, (b, p, y, x), 1.0)
        fr = torch.from_numpy(frames)
        fr = F.interpolate(fr, size=self.out_hw, mode="area")
        if self.train and torch.rand(()) < 0.5:
            fr = fr.flip(-1)
        return fr / (fr.amax(dim=(1, 2, 3), keepdim=True) + 1e-6), label


class SpikeAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u):
        ctx.save_for_backward(u)
        return (u > 0).float()

    @staticmethod
    def backward(ctx, g):
        (u,) = ctx.saved_tensors
        return g * (1.0 / (1.0 + (np.pi * u) ** 2))


class LIFSeq(nn.Module):
    def __init__(self, tau=2.0, v_th=1.0):
        super().__init__()
        self.k, self.v_th = 1.0 / tau, v_th

    def forward(self, x):  # [T, B, ...]
        v, out = torch.zeros_like(x[0]), []
        for xt in x:
            v = v + self.k * (xt - v)
            s = SpikeAct.apply(v - self.v_th)
            v = v * (1 - s.detach())
            out.append(s)
        return torch.stack(out)


class Stage(nn.Module):
    def __init__(self, c_in, c_out):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.norm = nn.GroupNorm(8, c_out)
        self.lif = LIFSeq()

    def forward(self, x):  # [T, B, C, H, W]
        T, B = x.shape[:2]
        y = self.norm(self.conv(x.flatten(0, 1)))
        y = F.max_pool2d(y, 2, ceil_mode=True)
        return self.lif(y.view(T, B, *y.shape[1:]))


class DSNet(nn.Module):
    def __init__(self, num_classes=101):
        super().__init__()
        self.s1, self.s2 = Stage(2, 64), Stage(64, 128)
        self.s3, self.s4 = Stage(128, 256), Stage(256, 256)
        self.aux_head = nn.Linear(128, num_classes)
        self.head = nn.Linear(256, num_classes)

    def forward(self, x, with_aux=False):  # x: [B, T, 2, H, W]
        x = x.transpose(0, 1)
        f1 = self.s1(x)
        f2 = self.s2(f1)
        f4 = self.s4(self.s3(f2))
        logits = self.head(f4.mean(dim=(0, 3, 4)))
        rates = torch.stack([f1.mean(), f2.mean(), f4.mean()])
        if with_aux:
            return logits, self.aux_head(f2.mean(dim=(0, 3, 4))), rates
        return logits, None, rates


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--T", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--aux-epochs", type=int, default=20)
    ap.add_argument("--aux-weight", type=float, default=0.3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3, help="per 64 samples")
    ap.add_argument("--rate-coef", type=float, default=0.05)
    ap.add_argument("--out", default="runs/ncaltech_ds")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    classes, train_items, test_items = list_split(args.root)
    train_set = EventFrames(train_items, args.T, train=True)
    test_set = EventFrames(test_items[rank::world], args.T)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, args.batch_size, num_workers=8, pin_memory=True)

    model = DDP(DSNet(len(classes)).to(device), device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs, eta_min=lr * 0.01)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(classes)} classes, {len(train_items)} train / {len(test_items)} test, lr {lr:.2e}")

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        use_aux = epoch < args.aux_epochs
        t0 = time.time()
        tot = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, aux, rates = model(x, with_aux=use_aux)
            loss = F.cross_entropy(logits, y, label_smoothing=0.1)
            if aux is not None:
                loss = loss + args.aux_weight * F.cross_entropy(aux, y)
            loss = loss + args.rate_coef * F.relu(rates - 0.15).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), rates.mean().detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)

        net = model.module.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                logits, _, _ = net(x.to(device))
                hits[0] += (logits.argmax(1).cpu() == y).sum().item()
                hits[1] += y.numel()
        dist.all_reduce(hits)
        acc = (hits[0] / hits[1]).item()

        if rank == 0:
            print(f"ep {epoch:3d} aux={int(use_aux)} loss {tot[0] / tot[2]:.4f} rate {tot[1] / tot[2]:.3f} "
                  f"test acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            ck = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                  "classes": classes, "acc": acc}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save(ck, os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
