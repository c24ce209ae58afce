"""
Tile-based Noise2Noise training on large MRC stacks (e.g. serial-section
montages or averaged tilt series, several 10s of GB each).

Each input is a pair of independent noisy acquisitions of the same area:
    <dataset>/<name>_A.mrc and <dataset>/<name>_B.mrc, shape (Z, Y, X)

Tiles are cut from memory-mapped MRCs, each tile is normalised to zero mean /
unit std of its own content (the montages have strong intensity drifts between
sections).

Launch:
    torchrun --nproc_per_node=4 04_mrc_tile_denoiser.py --root /mnt/em/n2n_pairs \
        --out /mnt/em/models/n2n_tiles --epochs 40
"""
import argparse
import glob
import os
import time
from dataclasses import dataclass

import mrcfile
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset


@dataclass
class TileRef:
    pair: int
    z: int
    y: int
    x: int


class MRCPairTiles(Dataset):
    def __init__(self, root, tile=256, stride=256, min_std=1e-3):
        self.a_files = sorted(glob.glob(os.path.join(root, "*_A.mrc")))
        self.b_files = [f[:-len("_A.mrc")] + "_B.mrc" for f in self.a_files]
        self.tile = tile
        self.refs = []
        for p, f in enumerate(self.a_files):
            with mrcfile.mmap(f, mode="r", permissive=True) as m:
                Z, Y, X = m.data.shape
            for z in range(Z):
                for y in range(0, Y - tile + 1, stride):
                    for x in range(0, X - tile + 1, stride):
                        self.refs.append(TileRef(p, z, y, x))
        self.min_std = min_std
        self._mm = None

    def __len__(self):
        return len(self.refs)

    def _maps(self):
        if self._mm is None:
            self._mm = [(mrcfile.mmap(a, mode="r", permissive=True).data,
                         mrcfile.mmap(b, mode="r", permissive=True).data)
                        for a, b in zip(self.a_files, self.b_files)]
        return self._mm

    @staticmethod
    def _norm(t, eps):
        return (t - t.mean()) / max(float(t.std()), eps)

    def __getitem__(self, i):
        r = self.refs[i]
        a, b = self._maps()[r.pair]
        s = np.s_[r.z, r.y:r.y + self.tile, r.x:r.x + self.tile]
        ta = self._norm(np.asarray(a[s], dtype=np.float32), self.min_std)
        tb = self._norm(np.asarray(b[s], dtype=np.float32), self.min_std)
        if np.random.rand() < 0.5:
            ta, tb = tb, ta
        if np.random.rand() < 0.5:
            ta, tb = ta[::-1].copy(), tb[::-1].copy()
        return torch.from_numpy(ta)[None], torch.from_numpy(tb)[None]


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.ReLU(True),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.ReLU(True))


class N2NUNet(nn.Module):
    def __init__(self, base=32, depth=4):
        super().__init__()
        ch = [base * 2 ** i for i in range(depth)]
        self.inc = block(1, ch[0])
        self.downs = nn.ModuleList([block(ch[i], ch[i + 1]) for i in range(depth - 1)])
        self.ups = nn.ModuleList([nn.ConvTranspose2d(ch[i + 1], ch[i], 2, 2) for i in reversed(range(depth - 1))])
        self.decs = nn.ModuleList([block(2 * ch[i], ch[i]) for i in reversed(range(depth - 1))])
        self.outc = nn.Conv2d(ch[0], 1, 1)

    def forward(self, x):
        hs = [self.inc(x)]
        for d in self.downs:
            hs.append(d(F.max_pool2d(hs[-1], 2)))
        h = hs.pop()
        for up, dec in zip(self.ups, self.decs):
            h = dec(torch.cat([up(h), hs.pop()], 1))
        return x + self.outc(h)  # residual: predict the correction


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group(backend="nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)

        full = MRCPairTiles(args.root, tile=args.tile, stride=args.tile)
        perm = np.random.RandomState(42).permutation(len(full))
        n_val = int(args.val_frac * len(full))
        self.train_set = Subset(full, perm[n_val:].tolist())
        # each rank validates a disjoint strided part of the val tiles
        self.val_set = Subset(full, perm[:n_val][self.rank::self.world].tolist())

        self.train_loader = DataLoader(self.train_set, batch_size=args.batch_size, shuffle=True,
                                       num_workers=args.workers, pin_memory=True, drop_last=True)
        self.val_loader = DataLoader(self.val_set, batch_size=args.batch_size, shuffle=False,
                                     num_workers=args.workers)

        net = N2NUNet(base=args.base).to(self.device)
        self.model = DistributedDataParallel(net, device_ids=[self.local_rank])
        lr = args.lr * args.batch_size * self.world / 32
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr, betas=(0.9, 0.99))
        self.sched = torch.optim.lr_scheduler.MultiStepLR(
            self.opt, milestones=[int(0.6 * args.epochs), int(0.85 * args.epochs)], gamma=0.2)
        self.start_epoch = 0
        if args.resume and os.path.isfile(args.resume):
            ck = torch.load(args.resume, map_location=self.device)
            self.model.module.load_state_dict(ck["model"])
            self.opt.load_state_dict(ck["opt"])
            self.sched.load_state_dict(ck["sched"])
            self.start_epoch = ck["epoch"] + 1

    def log(self, msg):
        if self.rank == 0:
            print(time.strftime("%H:%M:%S"), msg, flush=True)

    def train_epoch(self, epoch):
        self.model.train()
        tot = torch.zeros(2, device=self.device)
        for src, tgt in self.train_loader:
            src = src.to(self.device, non_blocking=True)
            tgt = tgt.to(self.device, non_blocking=True)
            loss = F.mse_loss(self.model(src), tgt)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            tot += torch.stack([loss.detach() * src.shape[0], torch.tensor(float(src.shape[0]), device=self.device)])
        dist.all_reduce(tot)
        return (tot[0] / tot[1]).item()

    @torch.no_grad()
    def validate(self):
        net = self.model.module
        net.eval()
        tot = torch.zeros(2, device=self.device)
        for src, tgt in self.val_loader:
            src, tgt = src.to(self.device), tgt.to(self.device)
            tot[0] += F.mse_loss(net(src), tgt, reduction="sum") / src[0].numel()
            tot[1] += src.shape[0]
        dist.all_reduce(tot)
        return (tot[0] / tot[1].clamp(min=1)).item()

    def save(self, epoch, val):
        if self.rank != 0:
            return
        os.makedirs(self.args.out, exist_ok=True)
        torch.save({"epoch": epoch, "model": self.model.module.state_dict(), "opt": self.opt.state_dict(),
                    "sched": self.sched.state_dict(), "val": val}, os.path.join(self.args.out, "checkpoint.pt"))

    def fit(self):
        self.log(f"{len(self.train_set)} train tiles, {self.world} GPUs")
        for epoch in range(self.start_epoch, self.args.epochs):
            t0 = time.time()
            tr = self.train_epoch(epoch)
            va = self.validate()
            self.sched.step()
            self.log(f"epoch {epoch:3d}  train {tr:.5f}  val {va:.5f}  {time.time() - t0:.0f}s")
            self.save(epoch, va)
        dist.barrier()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tile", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--base", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--val-frac", type=float, default=0.05)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--resume", default="")
    Trainer(ap.parse_args()).fit()


if __name__ == "__main__":
    main()
