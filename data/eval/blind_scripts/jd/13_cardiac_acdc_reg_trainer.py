"""
ED <-> ES cardiac cine registration on ACDC (3D short-axis stacks resampled to 1.5x1.5x3 mm,
cropped 128x128x32 around the heart). Labels (LV, myocardium, RV) are only used for validation.

    torchrun --nproc_per_node=4 13_cardiac_acdc_reg_trainer.py --root /data/ACDC/preproc --val-frac 0.2
"""
import argparse
import glob
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

logger = logging.getLogger(__name__)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class ACDCPairs(Dataset):
    def __init__(self, patients, augment):
        self.patients = patients
        self.augment = augment

    def __len__(self):
        return 2 * len(self.patients)  # ED->ES and ES->ED

    def __getitem__(self, idx):
        d = np.load(self.patients[idx // 2])
        a, b = ("ed", "es") if idx % 2 == 0 else ("es", "ed")
        mov, fix = d[a].astype(np.float32), d[b].astype(np.float32)
        mseg, fseg = d[a + "_gt"].astype(np.int64), d[b + "_gt"].astype(np.int64)
        if self.augment:
            k = np.random.randint(4)
            mov, fix, mseg, fseg = (np.rot90(x, k, axes=(0, 1)).copy() for x in (mov, fix, mseg, fseg))
            g = np.random.uniform(0.7, 1.4)
            mov, fix = mov ** g, fix ** g
        t = lambda x: torch.from_numpy(x)[None]
        return t(mov), t(fix), t(mseg), t(fseg)


class Block(nn.Module):
    def __init__(self, i, o, stride=(1, 1, 1)):
        super().__init__()
        self.c = nn.Conv3d(i, o, 3, stride, 1)
        self.n = nn.GroupNorm(4, o)

    def forward(self, x):
        return F.leaky_relu(self.n(self.c(x)), 0.2)


class CardiacRegNet(nn.Module):
    """Anisotropic U-Net: no down-sampling along z (only 32 slices)."""

    def __init__(self, c=32):
        super().__init__()
        s = (1, 2, 2)
        self.e0, self.e1, self.e2, self.e3 = Block(2, c), Block(c, c, s), Block(c, 2 * c, s), Block(2 * c, 2 * c, s)
        self.d2, self.d1, self.d0 = Block(4 * c, 2 * c), Block(3 * c, c), Block(2 * c, c)
        self.flow = nn.Conv3d(c, 3, 3, padding=1)
        nn.init.normal_(self.flow.weight, std=1e-5)
        nn.init.zeros_(self.flow.bias)

    def forward(self, m, f):
        x0 = self.e0(torch.cat([m, f], 1))
        x1 = self.e1(x0)
        x2 = self.e2(x1)
        x3 = self.e3(x2)
        up = lambda a, b: F.interpolate(a, size=b.shape[2:], mode="trilinear", align_corners=False)
        y = self.d2(torch.cat([up(x3, x2), x2], 1))
        y = self.d1(torch.cat([up(y, x1), x1], 1))
        y = self.d0(torch.cat([up(y, x0), x0], 1))
        return self.flow(y)


def warp(img, flow, mode="bilinear"):
    shape = flow.shape[2:]
    grid = torch.stack(torch.meshgrid([torch.arange(s, device=flow.device) for s in shape], indexing="ij")).float()
    loc = grid[None] + flow
    loc = torch.stack([2 * loc[:, i] / (shape[i] - 1) - 1 for i in range(3)], -1).flip(-1)
    return F.grid_sample(img, loc, mode=mode, align_corners=True, padding_mode="border")


class Trainer:
    def __init__(self, args, train_ds, val_ds, rank, world, local_rank):
        self.args, self.rank, self.world = args, rank, world
        self.dev = torch.device("cuda", local_rank)
        self.train_sampler = DistributedSampler(train_ds, shuffle=True)
        self.train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=self.train_sampler,
                                       num_workers=4, pin_memory=True, drop_last=True)
        self.val_loader = DataLoader(val_ds, batch_size=1, num_workers=2,
                                     sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))
        self.model = DDP(CardiacRegNet().to(self.dev), device_ids=[local_rank])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.sched = torch.optim.lr_scheduler.PolynomialLR(self.opt, total_iters=args.epochs, power=0.9)
        self.tb = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    def train_epoch(self, epoch):
        self.train_sampler.set_epoch(epoch)
        self.model.train()
        tot = torch.zeros(2, device=self.dev)
        for mov, fix, _, _ in self.train_loader:
            mov, fix = mov.to(self.dev), fix.to(self.dev)
            flow = self.model(mov, fix)
            sim = F.mse_loss(warp(mov, flow), fix)
            smooth = sum(flow.diff(dim=d).pow(2).mean() for d in (2, 3, 4))
            loss = sim + self.args.lam * smooth
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=self.dev)])
        self.sched.step()
        dist.all_reduce(tot)
        return (tot[0] / tot[1]).item()

    @torch.no_grad()
    def validate(self):
        net = self.model.module
        net.eval()
        acc = torch.zeros(4, device=self.dev)  # LV, Myo, RV dice sums, count
        for mov, fix, mseg, fseg in self.val_loader:
            mov, fix, mseg, fseg = (x.to(self.dev) for x in (mov, fix, mseg, fseg))
            w = warp(mseg.float(), net(mov, fix), mode="nearest").long()
            for c in (1, 2, 3):
                a, b = w == c, fseg == c
                acc[c - 1] += 2 * (a & b).sum() / (a.sum() + b.sum()).clamp(min=1)
            acc[3] += 1
        dist.all_reduce(acc)
        return (acc[:3] / acc[3]).tolist()

    def save(self, epoch, name):
        if self.rank == 0:
            torch.save({"epoch": epoch, "model": self.model.module.state_dict(),
                        "opt": self.opt.state_dict()}, os.path.join(self.args.out, name))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/acdc_reg")
    ap.add_argument("--val-frac", type=float, default=0.2)
    ap.add_argument("--epochs", type=int, default=500)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lam", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")
    # per-rank seed so that the augmentations differ between GPUs
    seed_everything(args.seed + rank)

    patients = sorted(glob.glob(os.path.join(args.root, "patient*.npz")))
    random.shuffle(patients)
    n_val = int(len(patients) * args.val_frac)
    val_pat, train_pat = patients[:n_val], patients[n_val:]
    logger.info("%d train / %d val patients", len(train_pat), len(val_pat))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    trainer = Trainer(args, ACDCPairs(train_pat, augment=True), ACDCPairs(val_pat, augment=False),
                      rank, world, local_rank)
    best = 0.0
    for epoch in range(args.epochs):
        loss = trainer.train_epoch(epoch)
        if epoch % 10 == 0 or epoch == args.epochs - 1:
            lv, myo, rv = trainer.validate()
            mean = (lv + myo + rv) / 3
            logger.info("epoch %d loss %.5f | Dice LV %.3f Myo %.3f RV %.3f (mean %.3f)", epoch, loss, lv, myo, rv, mean)
            if trainer.tb is not None:
                trainer.tb.add_scalar("val/dice_mean", mean, epoch)
            if mean > best:
                best = mean
                trainer.save(epoch, "best.pt")
        if trainer.tb is not None:
            trainer.tb.add_scalar("train/loss", loss, epoch)
        trainer.save(epoch, "last.pt")
        dist.barrier()

    if trainer.tb is not None:
        trainer.tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
