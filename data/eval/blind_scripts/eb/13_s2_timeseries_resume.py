"""Construction-site / land-take detection from a year of monthly Sentinel-2 composites.

Each sample is a (T=12, C=10, 128, 128) cube plus a binary "new impervious
surface" mask.  Model: light U-TAE (shared 2D encoder per month, temporal
attention at the lowest resolution, GroupNorm everywhere).

We run on preemptible GPU nodes, so the job writes `latest.pt` every epoch and
picks it up automatically when the scheduler restarts it:

    torchrun --nproc_per_node=8 13_s2_timeseries_resume.py --data /datasets/landtake --out /checkpoints/landtake_utae
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

T, C = 12, 10


class LandTakeCubes(Dataset):
    def __init__(self, root, regions, train):
        self.files = sorted(f for r in regions for f in glob.glob(os.path.join(root, r, "*.npz")))
        stats = np.load(os.path.join(root, "stats.npz"))
        self.mean = stats["mean"].reshape(1, C, 1, 1).astype(np.float32)
        self.std = stats["std"].reshape(1, C, 1, 1).astype(np.float32)
        self.train = train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        z = np.load(self.files[i])
        x = (z["cube"].astype(np.float32) - self.mean) / self.std
        x = np.nan_to_num(x)  # months without a clear observation are NaN
        y = z["mask"].astype(np.float32)
        if self.train:
            if np.random.rand() < 0.5:
                x, y = x[..., ::-1], y[..., ::-1]
            if np.random.rand() < 0.5:
                x, y = x[..., ::-1, :], y[::-1]
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())[None]


def block(cin, cout, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.GroupNorm(8, cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.GroupNorm(8, cout), nn.ReLU(inplace=True))


class LiteUTAE(nn.Module):
    def __init__(self, widths=(64, 64, 128, 128), n_heads=8, d_k=4):
        super().__init__()
        self.enc = nn.ModuleList([block(C if i == 0 else widths[i - 1], w, 1 if i == 0 else 2)
                                  for i, w in enumerate(widths)])
        self.n_heads, self.d_k = n_heads, d_k
        self.key = nn.Linear(widths[-1], n_heads * d_k)
        self.query = nn.Parameter(torch.randn(n_heads, d_k) * 0.1)
        self.pos = nn.Parameter(torch.zeros(1, T, widths[-1]))
        self.dec = nn.ModuleList([block(widths[i] + widths[i - 1], widths[i - 1]) for i in range(len(widths) - 1, 0, -1)])
        self.head = nn.Conv2d(widths[0], 1, 1)

    def attention(self, f):
        # f: (B, T, D, h, w) -> per-pixel, per-head weights over T
        b, t, d, h, w = f.shape
        seq = f.permute(0, 3, 4, 1, 2).reshape(b * h * w, t, d) + self.pos
        k = self.key(seq).view(-1, t, self.n_heads, self.d_k)
        att = torch.einsum("nthd,hd->nht", k, self.query) / self.d_k ** 0.5
        att = att.softmax(-1)                                   # (N, H, T)
        return att.view(b, h, w, self.n_heads, t).permute(0, 3, 4, 1, 2)  # (B, H, T, h, w)

    @staticmethod
    def pool(f, att):
        b, t, d, h, w = f.shape
        att = F.interpolate(att.flatten(1, 2), size=(h, w), mode="bilinear", align_corners=False).view(b, -1, t, h, w)
        groups = att.shape[1]
        f = f.view(b, t, groups, d // groups, h, w)
        return (f * att.permute(0, 2, 1, 3, 4).unsqueeze(3)).sum(1).reshape(b, d, h, w)

    def forward(self, x):
        b = x.shape[0]
        feats, y = [], x.flatten(0, 1)
        for e in self.enc:
            y = e(y)
            feats.append(y.view(b, T, *y.shape[1:]))
        att = self.attention(feats[-1])
        pooled = [self.pool(f, att) for f in feats]
        out = pooled[-1]
        for d, skip in zip(self.dec, reversed(pooled[:-1])):
            out = d(torch.cat([F.interpolate(out, size=skip.shape[-2:], mode="bilinear", align_corners=False), skip], 1))
        return self.head(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--bs", type=int, default=8, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3, help="for a global batch of 64")
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    with open(os.path.join(args.data, "regions_train.txt")) as f:
        train_regions = f.read().split()
    with open(os.path.join(args.data, "regions_val.txt")) as f:
        val_regions = f.read().split()
    train_ds = LandTakeCubes(args.data, train_regions, train=True)
    val_ds = LandTakeCubes(args.data, val_regions, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=3)
    train_dl = DataLoader(train_ds, args.bs, sampler=sampler, num_workers=args.workers, pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_ds), world))
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), args.bs, num_workers=args.workers, pin_memory=True)

    model = LiteUTAE().to(device)
    lr = args.lr * args.bs * world / 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=20, eta_min=lr * 0.01)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best = 0, 0.0
    latest = os.path.join(args.out, "latest.pt")
    if os.path.exists(latest):
        ckpt = torch.load(latest)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        if rank == 0:
            print(f"resumed from {latest} at epoch {start_epoch}", flush=True)
        del ckpt
    model = DDP(model, device_ids=[local_rank])

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"), purge_step=start_epoch)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, run_loss = time.time(), torch.zeros(2, device=device)
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.binary_cross_entropy_with_logits(model(x).float(), y, pos_weight=torch.tensor(5.0, device=device))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(opt)
            scaler.update()
            sched.step(epoch + i / len(train_dl))
            run_loss += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run_loss)

        model.eval()
        s = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_dl:
                p = model.module(x.to(device)) > 0
                t = y.to(device) > 0.5
                s += torch.stack([(p & t).sum(), (p & ~t).sum(), (~p & t).sum()]).double()
        dist.all_reduce(s)
        tp, fp, fn = s.tolist()
        f1 = 2 * tp / max(1.0, 2 * tp + fp + fn)

        if rank == 0:
            writer.add_scalar("train/loss", (run_loss[0] / run_loss[1]).item(), epoch)
            writer.add_scalar("val/f1", f1, epoch)
            writer.add_scalar("lr", opt.param_groups[0]["lr"], epoch)
            print(f"epoch {epoch} loss {(run_loss[0] / run_loss[1]).item():.4f} val F1 {f1:.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            best = max(best, f1)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch, "best": best}
            torch.save(state, latest + ".tmp")
            os.replace(latest + ".tmp", latest)
            if f1 >= best:
                torch.save(state["model"], os.path.join(args.out, "best_model.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
