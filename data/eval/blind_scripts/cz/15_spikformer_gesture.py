"""Small Spikformer-style spiking transformer for DVS Gesture (tonic frames, T=16).

Spiking self-attention: Q, K, V are spike tensors, attention = Q K^T V * scale
(no softmax), LIF after every linear map.

    torchrun --nproc_per_node=8 15_spikformer_gesture.py --data /data/tonic --epochs 200
"""
import argparse
import json
import os
import time

import numpy as np
import tonic
import tonic.transforms as tt
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


class HeavisideATan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x >= 0).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g / (1 + (np.pi * x) ** 2)


class MultiStepLIF(nn.Module):
    def __init__(self, tau=2.0, v_th=1.0):
        super().__init__()
        self.tau, self.v_th = tau, v_th

    def forward(self, x):  # [T, ...]
        v = torch.zeros_like(x[0])
        out = []
        for xt in x:
            v = v + (xt - v) / self.tau
            s = HeavisideATan.apply(v - self.v_th)
            v = v * (1.0 - s.detach())
            out.append(s)
        return torch.stack(out)


class TLinearBN(nn.Module):
    """Linear + BatchNorm1d over the channel dim for [T, B, N, C] tensors."""

    def __init__(self, c_in, c_out):
        super().__init__()
        self.fc = nn.Linear(c_in, c_out, bias=False)
        self.bn = nn.BatchNorm1d(c_out)

    def forward(self, x):
        y = self.fc(x)
        return self.bn(y.flatten(0, 2)).view_as(y)


class SSA(nn.Module):
    def __init__(self, dim, heads=8, scale=0.125):
        super().__init__()
        self.heads, self.scale = heads, scale
        self.q, self.k, self.v = TLinearBN(dim, dim), TLinearBN(dim, dim), TLinearBN(dim, dim)
        self.q_lif, self.k_lif, self.v_lif = MultiStepLIF(), MultiStepLIF(), MultiStepLIF()
        self.attn_lif = MultiStepLIF(v_th=0.5)
        self.proj = TLinearBN(dim, dim)
        self.proj_lif = MultiStepLIF()

    def forward(self, x):  # [T, B, N, C]
        T, B, N, C = x.shape
        h = self.heads

        def split(t):
            return t.view(T, B, N, h, C // h).transpose(2, 3)  # [T, B, h, N, d]

        q = split(self.q_lif(self.q(x)))
        k = split(self.k_lif(self.k(x)))
        v = split(self.v_lif(self.v(x)))
        attn = (q @ k.transpose(-2, -1)) * self.scale
        out = (attn @ v).transpose(2, 3).reshape(T, B, N, C)
        return self.proj_lif(self.proj(self.attn_lif(out)))


class Block(nn.Module):
    def __init__(self, dim, mlp_ratio=4):
        super().__init__()
        self.attn = SSA(dim)
        self.fc1, self.lif1 = TLinearBN(dim, dim * mlp_ratio), MultiStepLIF()
        self.fc2, self.lif2 = TLinearBN(dim * mlp_ratio, dim), MultiStepLIF()

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.lif2(self.fc2(self.lif1(self.fc1(x))))


class Spikformer(nn.Module):
    def __init__(self, dim=256, depth=2, num_classes=11, patch=8):
        super().__init__()
        self.patch_embed = nn.Sequential(nn.Conv2d(2, dim // 2, 3, padding=1, bias=False), nn.BatchNorm2d(dim // 2),
                                         nn.Conv2d(dim // 2, dim, patch, stride=patch, bias=False),
                                         nn.BatchNorm2d(dim))
        self.embed_lif = MultiStepLIF()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):  # [B, T, 2, 64, 64]
        B, T = x.shape[:2]
        e = self.patch_embed(x.transpose(0, 1).flatten(0, 1))  # [T*B, C, 8, 8]
        e = e.flatten(2).transpose(1, 2).reshape(T, B, -1, e.shape[1])
        z = self.embed_lif(e)
        for blk in self.blocks:
            z = blk(z)
        return self.head(z.mean(dim=2)).mean(0)


def build_sets(root, T):
    tf = tt.Compose([tt.Downsample(spatial_factor=0.5), tt.ToFrame(sensor_size=(64, 64, 2), n_time_bins=T)])
    return (tonic.datasets.DVSGesture(save_to=root, train=True, transform=tf),
            tonic.datasets.DVSGesture(save_to=root, train=False, transform=tf))


def to_float(batch):
    x = torch.stack([torch.as_tensor(f, dtype=torch.float32).clamp_(max=4) / 4 for f, _ in batch])
    return x, torch.tensor([y for _, y in batch])


@torch.no_grad()
def test_accuracy(net, loader, device):
    net.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        c[0] += (net(x.to(device)).argmax(1).cpu() == y).sum().item()
        c[1] += len(y)
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/tonic")
    ap.add_argument("--out", default="runs/spikformer_gesture")
    ap.add_argument("--T", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3, help="for global batch 64")
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        build_sets(args.data, args.T)
    dist.barrier()
    train_set, test_set = build_sets(args.data, args.T)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, collate_fn=to_float,
                              num_workers=8, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), 32, collate_fn=to_float,
                             num_workers=8, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(Spikformer()).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.06)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=args.warmup)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs - args.warmup)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[args.warmup])

    best_path = os.path.join(args.out, "best.pth")
    best = 0.0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tl = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tl += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tl)

        c = test_accuracy(model.module, test_loader, device)
        dist.all_reduce(c)
        acc = (c[0] / c[1]).item()
        if rank == 0:
            print(f"epoch {epoch:3d} loss {tl[0] / tl[1]:.4f} test {acc:.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
            if acc > best:
                best = acc
                torch.save(model.state_dict(), best_path)

    dist.barrier()
    if rank == 0:
        # reload the best weights into a plain single-GPU model and write the final report
        net = Spikformer().to(device)
        net.load_state_dict(torch.load(best_path, map_location=device))
        full = DataLoader(test_set, 32, collate_fn=to_float, num_workers=8)
        c = test_accuracy(net, full, device)
        report = {"best_test_acc": (c[0] / c[1]).item(), "n_test": int(c[1].item()),
                  "params": sum(p.numel() for p in net.parameters()), "T": args.T}
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump(report, f, indent=2)
        print(report)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
