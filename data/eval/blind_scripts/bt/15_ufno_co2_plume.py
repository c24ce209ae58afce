"""U-FNO surrogate for CO2 gas saturation in heterogeneous reservoirs (Wen et al., 2022).

Input: permeability / porosity maps, injection rate, well location, capillary parameters
broadcast on a 96x200 (r, z) grid plus 24 time levels; output: gas saturation at the
24 times. Trained with torchrun; the final test reloads the best weights into a
fresh single-GPU model and writes predictions for plotting.

    torchrun --standalone --nproc_per_node=4 15_ufno_co2_plume.py --data /data/ccs/sg_dataset \
        --out runs/ufno_sg
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


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/ufno_sg")
    ap.add_argument("--modes", type=int, default=10)
    ap.add_argument("--width", type=int, default=36)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=140)
    ap.add_argument("--workers", type=int, default=4)
    return ap.parse_args()


class PlumeDataset(Dataset):
    def __init__(self, root, split):
        self.x = np.load(os.path.join(root, f"{split}_a.npy"), mmap_mode="r")   # (N, 96, 200, 24, 12)
        self.y = np.load(os.path.join(root, f"{split}_u.npy"), mmap_mode="r")   # (N, 96, 200, 24)

    def __len__(self):
        return self.x.shape[0]

    def __getitem__(self, i):
        return torch.from_numpy(np.array(self.x[i], dtype=np.float32)), torch.from_numpy(np.array(self.y[i], dtype=np.float32))


class SpectralConv3d(nn.Module):
    def __init__(self, width, m1, m2, m3):
        super().__init__()
        self.m = (m1, m2, m3)
        s = 1 / (width * width)
        self.weights = nn.Parameter(s * torch.rand(4, width, width, m1, m2, m3, dtype=torch.cfloat))

    def forward(self, x):
        B, C, X, Y, T = x.shape
        m1, m2, m3 = self.m
        xf = torch.fft.rfftn(x, dim=[-3, -2, -1])
        out = torch.zeros(B, C, X, Y, T // 2 + 1, dtype=torch.cfloat, device=x.device)
        for k, (sx, sy) in enumerate([(slice(None, m1), slice(None, m2)), (slice(-m1, None), slice(None, m2)),
                                      (slice(None, m1), slice(-m2, None)), (slice(-m1, None), slice(-m2, None))]):
            out[:, :, sx, sy, :m3] = torch.einsum("bixyz,ioxyz->boxyz", xf[:, :, sx, sy, :m3], self.weights[k])
        return torch.fft.irfftn(out, s=(X, Y, T))


class MiniUNet3d(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv3d(c, c, 3, stride=2, padding=1), nn.LeakyReLU(0.1))
        self.down2 = nn.Sequential(nn.Conv3d(c, c, 3, stride=2, padding=1), nn.LeakyReLU(0.1))
        self.up2 = nn.Sequential(nn.ConvTranspose3d(c, c, 4, stride=2, padding=1), nn.LeakyReLU(0.1))
        self.up1 = nn.ConvTranspose3d(2 * c, c, 4, stride=2, padding=1)

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(d1)
        u2 = self.up2(d2)[..., :d1.shape[-3], :d1.shape[-2], :d1.shape[-1]]
        u1 = self.up1(torch.cat([u2, d1], dim=1))
        return u1[..., :x.shape[-3], :x.shape[-2], :x.shape[-1]]


class UFNO(nn.Module):
    def __init__(self, in_ch=12, modes=10, width=36, n_fourier=3, n_ufourier=3, pad=8):
        super().__init__()
        self.pad = pad
        self.lift = nn.Linear(in_ch, width)
        n = n_fourier + n_ufourier
        self.spec = nn.ModuleList(SpectralConv3d(width, modes, modes, modes) for _ in range(n))
        self.w = nn.ModuleList(nn.Conv3d(width, width, 1) for _ in range(n))
        self.unets = nn.ModuleList(MiniUNet3d(width) for _ in range(n_ufourier))
        self.n_fourier = n_fourier
        self.q = nn.Sequential(nn.Linear(width, 128), nn.GELU(), nn.Linear(128, 1))

    def forward(self, x):
        h = self.lift(x).permute(0, 4, 1, 2, 3)
        h = F.pad(h, [0, self.pad])
        for i in range(len(self.spec)):
            out = self.spec[i](h) + self.w[i](h)
            if i >= self.n_fourier:
                out = out + self.unets[i - self.n_fourier](h)
            h = F.gelu(out) if i < len(self.spec) - 1 else out
        h = h[..., :-self.pad].permute(0, 2, 3, 4, 1)
        return self.q(h).squeeze(-1)


def masked_rel_l2(pred, y, mask):
    B = y.shape[0]
    num = torch.linalg.norm(((pred - y) * mask).reshape(B, -1), dim=1)
    den = torch.linalg.norm((y * mask).reshape(B, -1), dim=1).clamp(min=1e-8)
    return num / den


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2022)

    train_set, val_set = PlumeDataset(args.data, "train"), PlumeDataset(args.data, "val")
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=args.batch_size, num_workers=args.workers)

    model = DDP(UFNO(modes=args.modes, width=args.width).to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.9)

    os.makedirs(args.out, exist_ok=True)
    best_path = os.path.join(args.out, "best_model.pt")
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            mask = (x[..., :1, 0] != 0).float()  # active cells, from permeability
            pred = model(x)
            loss = masked_rel_l2(pred, y, mask).mean()
            # first-derivative (r-direction) term as in the U-FNO paper
            dy = lambda t: t[:, 1:] - t[:, :-1]
            loss = loss + 0.5 * masked_rel_l2(dy(pred), dy(y), mask[:, 1:]).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            agg += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()

        model.eval()
        vagg = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                mask = (x[..., :1, 0] != 0).float()
                vagg += torch.stack([masked_rel_l2(model.module(x), y, mask).sum(),
                                     torch.tensor(float(x.shape[0]), device=device)])
        dist.all_reduce(agg)
        dist.all_reduce(vagg)
        val_l2 = (vagg[0] / vagg[1]).item()
        if rank == 0:
            print(f"epoch {epoch:3d} | {time.time() - t0:.0f}s | train {(agg[0] / agg[1]).item():.4f} "
                  f"| val rel L2 {val_l2:.4f}", flush=True)
            if val_l2 < best:
                torch.save(model.state_dict(), best_path)
        best = min(best, val_l2)
        dist.barrier()

    # test set + prediction dump on one GPU
    if rank == 0:
        test_set = PlumeDataset(args.data, "test")
        net = UFNO(modes=args.modes, width=args.width).to(device)
        net.load_state_dict(torch.load(best_path, map_location=device))
        net.eval()
        errs, preds = [], []
        with torch.no_grad():
            for x, y in DataLoader(test_set, batch_size=args.batch_size, num_workers=args.workers):
                x, y = x.to(device), y.to(device)
                mask = (x[..., :1, 0] != 0).float()
                p = net(x)
                errs.append(masked_rel_l2(p, y, mask).cpu())
                preds.append(p.cpu().numpy().astype(np.float16))
        errs = torch.cat(errs)
        print(f"test rel L2: mean {errs.mean():.4f}  median {errs.median():.4f}  p95 {errs.quantile(0.95):.4f}")
        np.save(os.path.join(args.out, "test_pred.npy"), np.concatenate(preds))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
