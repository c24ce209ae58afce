"""Deep-learning surrogate for RANS flow around airfoils (Thuerey et al. style U-Net):
inputs are freestream velocity (x, y) and the airfoil mask on a 128x128 grid,
outputs are pressure and velocity fields, normalised by the freestream magnitude.

    torchrun --nproc_per_node=4 19_airfoil_rans_unet.py --data /nfs/cfd/airfoil_rans/ --expo 7
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
from torch.utils.tensorboard import SummaryWriter


class AirfoilRANS(Dataset):
    """npz files with 'inputs' (3,128,128) and 'targets' (3,128,128).

    Targets are made dimensionless with the freestream speed and the mean pressure removed."""

    def __init__(self, files, max_in=None, max_out=None):
        self.files = files
        self.max_in, self.max_out = max_in, max_out

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        inp, tgt = d["inputs"].astype(np.float32), d["targets"].astype(np.float32)
        v2 = inp[0].max() ** 2 + inp[1].max() ** 2
        tgt[0] = (tgt[0] - tgt[0].mean()) / v2
        tgt[1:] = tgt[1:] / np.sqrt(v2)
        inp = inp / self.max_in[:, None, None]
        tgt = tgt / self.max_out[:, None, None]
        return torch.from_numpy(inp), torch.from_numpy(tgt)


def block(cin, cout, transposed=False, bn=True, relu=True, size=4, pad=1, dropout=0.0):
    layers = [nn.ReLU(inplace=True) if relu else nn.LeakyReLU(0.2, inplace=True)]
    if transposed:
        layers += [nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(cin, cout, size - 1, padding=pad, bias=True)]
    else:
        layers += [nn.Conv2d(cin, cout, size, stride=2, padding=pad, bias=True)]
    if bn:
        layers += [nn.InstanceNorm2d(cout, affine=True)]
    if dropout > 0:
        layers += [nn.Dropout2d(dropout)]
    return nn.Sequential(*layers)


class TurbNetG(nn.Module):
    def __init__(self, expo=6, dropout=0.0):
        super().__init__()
        c = 2 ** expo
        self.l1 = nn.Conv2d(3, c, 4, stride=2, padding=1)
        self.l2 = block(c, 2 * c, relu=False, dropout=dropout)
        self.l3 = block(2 * c, 2 * c, relu=False, dropout=dropout)
        self.l4 = block(2 * c, 4 * c, relu=False, dropout=dropout)
        self.l5 = block(4 * c, 8 * c, relu=False, size=4, dropout=dropout)
        self.l6 = block(8 * c, 8 * c, relu=False, size=2, pad=0, dropout=dropout)
        self.l7 = block(8 * c, 8 * c, relu=False, bn=False, size=2, pad=0, dropout=dropout)
        self.d7 = block(8 * c, 8 * c, transposed=True, size=2, pad=0, dropout=dropout)
        self.d6 = block(16 * c, 8 * c, transposed=True, size=2, pad=0, dropout=dropout)
        self.d5 = block(16 * c, 4 * c, transposed=True, dropout=dropout)
        self.d4 = block(8 * c, 2 * c, transposed=True, dropout=dropout)
        self.d3 = block(4 * c, 2 * c, transposed=True, dropout=dropout)
        self.d2 = block(4 * c, c, transposed=True, bn=False, dropout=dropout)
        self.d1 = nn.Sequential(nn.ReLU(inplace=True), nn.ConvTranspose2d(2 * c, 3, 4, stride=2, padding=1))

    def forward(self, x):
        o1 = self.l1(x)
        o2 = self.l2(o1)
        o3 = self.l3(o2)
        o4 = self.l4(o3)
        o5 = self.l5(o4)
        o6 = self.l6(o5)
        o7 = self.l7(o6)
        u7 = self.d7(o7)
        u6 = self.d6(torch.cat([u7, o6], 1))
        u5 = self.d5(torch.cat([u6, o5], 1))
        u4 = self.d4(torch.cat([u5, o4], 1))
        u3 = self.d3(torch.cat([u4, o3], 1))
        u2 = self.d2(torch.cat([u3, o2], 1))
        return self.d1(torch.cat([u2, o1], 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/nfs/cfd/airfoil_rans/")
    ap.add_argument("--norm", default="/nfs/cfd/airfoil_rans/norm_max.npz")
    ap.add_argument("--expo", type=int, default=7)
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--iterations", type=int, default=200000)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--out", default="/nfs/cfd/runs/turbnet")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    norm = np.load(args.norm)
    train_files = sorted(glob.glob(os.path.join(args.data, "train", "*.npz")))
    test_files = sorted(glob.glob(os.path.join(args.data, "test", "*.npz")))
    train_ds = AirfoilRANS(train_files, norm["max_in"], norm["max_out"])
    test_ds = AirfoilRANS(test_files[rank::world], norm["max_in"], norm["max_out"])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=20, num_workers=2)

    model = TurbNetG(args.expo, args.dropout).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.5, 0.999), weight_decay=0.0)
    epochs = max(1, args.iterations // len(loader))
    # linear decay over the second half of training, as in the original setup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 if e < epochs // 2 else
                                              max(0.1, 1.0 - (e - epochs // 2) / (epochs // 2)))
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = float("inf")
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum, n_seen = 0.0, 0
        for inp, tgt in loader:
            inp, tgt = inp.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            loss = F.l1_loss(model(inp), tgt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.item() * inp.shape[0]
            n_seen += inp.shape[0]
        sched.step()

        model.eval()
        err_sum, n_test = 0.0, 0
        with torch.no_grad():
            for inp, tgt in test_loader:
                inp, tgt = inp.to(device), tgt.to(device)
                pred = model.module(inp)
                # relative error per sample, accumulated over p, u, v
                rel = (pred - tgt).abs().flatten(1).sum(1) / tgt.abs().flatten(1).sum(1)
                err_sum += rel.sum().item()
                n_test += inp.shape[0]

        stats = torch.tensor([loss_sum, n_seen, err_sum, n_test], dtype=torch.float64)
        dist.all_reduce(stats)
        train_l1, test_rel = stats[0] / stats[1], stats[2] / stats[3]

        if rank == 0:
            writer.add_scalar("train/L1", train_l1.item(), epoch)
            writer.add_scalar("test/rel_err", test_rel.item(), epoch)
            print(f"epoch {epoch:4d}/{epochs} L1 {train_l1:.5f} test rel. err {100 * test_rel:.2f}% "
                  f"lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.1f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if test_rel < best:
                best = test_rel.item()
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "best.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
