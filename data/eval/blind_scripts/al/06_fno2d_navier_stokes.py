# Fourier Neural Operator (2D + autoregressive in time) for Navier-Stokes vorticity, nu=1e-4.
# Following Li et al. (2021): input = first 10 time steps, predict the next T steps one at a time.
#
#   torchrun --standalone --nproc_per_node=4 06_fno2d_navier_stokes.py --data ns_V1e-4_N10000_T30.pt
import argparse
import os
import time
from timeit import default_timer

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class LpLoss:
    """Relative L2 loss, summed over the batch (divide by the number of samples yourself)."""

    def __call__(self, x, y):
        b = x.shape[0]
        diff = torch.norm(x.reshape(b, -1) - y.reshape(b, -1), 2, 1)
        return (diff / torch.norm(y.reshape(b, -1), 2, 1)).sum()


class SpectralConv2d(nn.Module):
    def __init__(self, cin, cout, m1, m2):
        super().__init__()
        self.m1, self.m2 = m1, m2
        scale = 1 / (cin * cout)
        self.w1 = nn.Parameter(scale * torch.rand(cin, cout, m1, m2, dtype=torch.cfloat))
        self.w2 = nn.Parameter(scale * torch.rand(cin, cout, m1, m2, dtype=torch.cfloat))

    def forward(self, x):
        B, _, H, W = x.shape
        xf = torch.fft.rfft2(x)
        out = torch.zeros(B, self.w1.shape[1], H, W // 2 + 1, dtype=torch.cfloat, device=x.device)
        out[:, :, : self.m1, : self.m2] = torch.einsum("bixy,ioxy->boxy", xf[:, :, : self.m1, : self.m2], self.w1)
        out[:, :, -self.m1:, : self.m2] = torch.einsum("bixy,ioxy->boxy", xf[:, :, -self.m1:, : self.m2], self.w2)
        return torch.fft.irfft2(out, s=(H, W))


class FNO2d(nn.Module):
    def __init__(self, modes, width, t_in=10):
        super().__init__()
        self.p = nn.Linear(t_in + 2, width)
        self.convs = nn.ModuleList([SpectralConv2d(width, width, modes, modes) for _ in range(4)])
        self.ws = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(4)])
        self.q = nn.Sequential(nn.Linear(width, 128), nn.GELU(), nn.Linear(128, 1))

    @staticmethod
    def grid(shape, device):
        B, X, Y = shape[0], shape[1], shape[2]
        gx = torch.linspace(0, 1, X, device=device).view(1, X, 1, 1).expand(B, X, Y, 1)
        gy = torch.linspace(0, 1, Y, device=device).view(1, 1, Y, 1).expand(B, X, Y, 1)
        return torch.cat([gx, gy], -1)

    def forward(self, x):  # x: (B, X, Y, t_in)
        x = torch.cat([x, self.grid(x.shape, x.device)], -1)
        x = self.p(x).permute(0, 3, 1, 2)
        for i, (k, w) in enumerate(zip(self.convs, self.ws)):
            x = k(x) + w(x)
            if i < 3:
                x = F.gelu(x)
        return self.q(x.permute(0, 2, 3, 1))  # (B, X, Y, 1)


def rollout_loss(model, xx, yy, T, step, crit):
    loss = 0.0
    preds = []
    for t in range(0, T, step):
        y = yy[..., t:t + step]
        im = model(xx)
        loss = loss + crit(im, y)
        preds.append(im)
        xx = torch.cat((xx[..., step:], im), dim=-1)
    return loss, torch.cat(preds, -1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ntrain", type=int, default=9800)
    ap.add_argument("--ntest", type=int, default=200)
    ap.add_argument("--modes", type=int, default=12)
    ap.add_argument("--width", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--T-in", type=int, default=10)
    ap.add_argument("--T", type=int, default=20)
    ap.add_argument("--save", default="model/fno2d_ns.pt")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # u: (N, 64, 64, T_total)
    u = torch.load(args.data, map_location="cpu")["u"].float()
    train_a = u[: args.ntrain, ..., : args.T_in]
    train_u = u[: args.ntrain, ..., args.T_in: args.T_in + args.T]
    test_a = u[-args.ntest:, ..., : args.T_in]
    test_u = u[-args.ntest:, ..., args.T_in: args.T_in + args.T]
    del u

    train_set = TensorDataset(train_a, train_u)
    test_set = TensorDataset(test_a[rank::world], test_u[rank::world])
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, shuffle=False)

    model = FNO2d(args.modes, args.width, args.T_in).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)
    myloss = LpLoss()

    start_ep = 0
    if os.path.exists(args.save):
        ck = torch.load(args.save, map_location=device)
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_ep = ck["epoch"] + 1
        if rank == 0:
            print(f"resuming from epoch {start_ep}")

    for ep in range(start_ep, args.epochs):
        model.train()
        t1 = default_timer()
        stats = torch.zeros(3, device=device)  # step loss, full loss, n
        for xx, yy in train_loader:
            xx = xx.to(device, non_blocking=True)
            yy = yy.to(device, non_blocking=True)
            loss, pred = rollout_loss(model, xx, yy, args.T, 1, myloss)
            l2_full = myloss(pred.detach(), yy)

            optimizer.zero_grad()
            (loss / xx.shape[0]).backward()
            optimizer.step()

            stats[0] += loss.detach()
            stats[1] += l2_full
            stats[2] += xx.shape[0]
        scheduler.step()

        model.eval()
        tstats = torch.zeros(3, device=device)
        with torch.no_grad():
            for xx, yy in test_loader:
                xx, yy = xx.to(device), yy.to(device)
                loss, pred = rollout_loss(model.module, xx, yy, args.T, 1, myloss)
                tstats[0] += loss
                tstats[1] += myloss(pred, yy)
                tstats[2] += xx.shape[0]

        dist.all_reduce(stats)
        dist.all_reduce(tstats)
        t2 = default_timer()
        if rank == 0:
            n, nt = stats[2].item(), tstats[2].item()
            print(f"{ep} {t2 - t1:.2f}s train_step {stats[0].item() / n / args.T:.5f} "
                  f"train_full {stats[1].item() / n:.5f} test_step {tstats[0].item() / nt / args.T:.5f} "
                  f"test_full {tstats[1].item() / nt:.5f}", flush=True)
            if (ep + 1) % 10 == 0 or ep == args.epochs - 1:
                os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "epoch": ep}, args.save)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
