"""Neural PDE surrogate for the 2D shallow-water equations on the sphere
(PDEArena-style modern U-Net, 2 history steps -> next step, dt = 48 h).

Validation unrolls the surrogate from each trajectory's first state and reports
the normalised RMSE per lead time; the correlation time (first lead where the
correlation with the reference drops below 0.8) is used for model selection.

    torchrun --standalone --nproc_per_node=4 15_pdearena_swe_unet.py --data /gpfs/pde/shallowwater
"""
import argparse
import glob
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class SWETrajectories(Dataset):
    """Each item is a trajectory (T, C, H, W) of vorticity + pressure, or a random
    (history -> target) window of one when `window` is set."""

    def __init__(self, files, history=2, window=True):
        self.files = files
        self.history, self.window = history, window
        with h5py.File(files[0], "r") as f:
            self.T = f["vor"].shape[0]

    def __len__(self):
        n = len(self.files)
        return n * (self.T - self.history) if self.window else n

    def _load(self, path, sl):
        with h5py.File(path, "r") as f:
            return np.concatenate([f["vor"][sl], f["pres"][sl]], axis=1).astype(np.float32)

    def __getitem__(self, i):
        if not self.window:
            return torch.from_numpy(self._load(self.files[i], slice(None)))
        fi, t = divmod(i, self.T - self.history)
        x = self._load(self.files[fi], slice(t, t + self.history + 1))
        return torch.from_numpy(x[: self.history]), torch.from_numpy(x[self.history])


class ResBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.n1, self.n2 = nn.GroupNorm(8, cin), nn.GroupNorm(8, cout)
        self.c1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.c1(F.gelu(self.n1(x)))
        h = self.c2(F.gelu(self.n2(h)))
        return self.skip(x) + h


class ModernUNet(nn.Module):
    def __init__(self, n_fields=2, history=2, hidden=64, mults=(1, 2, 2, 4)):
        super().__init__()
        self.history, self.n_fields = history, n_fields
        self.inp = nn.Conv2d(n_fields * history, hidden, 3, padding=1)
        chs = [hidden * m for m in mults]
        self.down, self.pool = nn.ModuleList(), nn.ModuleList()
        cin = hidden
        for i, c in enumerate(chs):
            self.down.append(nn.Sequential(ResBlock(cin, c), ResBlock(c, c)))
            self.pool.append(nn.Conv2d(c, c, 3, stride=2, padding=1) if i < len(chs) - 1 else nn.Identity())
            cin = c
        self.mid = ResBlock(cin, cin)
        self.up = nn.ModuleList()
        for i, c in reversed(list(enumerate(chs))):
            self.up.append(nn.ModuleDict({
                "blocks": nn.Sequential(ResBlock(cin + c, c), ResBlock(c, c)),
                "upsample": nn.ConvTranspose2d(c, c, 4, stride=2, padding=1) if i > 0 else nn.Identity(),
            }))
            cin = c
        self.out = nn.Sequential(nn.GroupNorm(8, hidden), nn.GELU(), nn.Conv2d(hidden, n_fields, 3, padding=1))

    def forward(self, hist):
        # hist: (B, history, C, H, W) -> next state (B, C, H, W)
        B = hist.shape[0]
        h = self.inp(hist.reshape(B, -1, *hist.shape[-2:]))
        skips = []
        for blk, pool in zip(self.down, self.pool):
            h = blk(h)
            skips.append(h)
            h = pool(h)
        h = self.mid(h)
        for up in self.up:
            s = skips.pop()
            h = up["blocks"](torch.cat([h, s], 1))
            h = up["upsample"](h)
        return hist[:, -1] + self.out(h)

    @torch.no_grad()
    def rollout(self, traj_init, n_steps):
        hist = traj_init
        preds = []
        for _ in range(n_steps):
            nxt = self(hist)
            preds.append(nxt)
            hist = torch.cat([hist[:, 1:], nxt[:, None]], 1)
        return torch.stack(preds, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/gpfs/pde/shallowwater")
    ap.add_argument("--out", default="/gpfs/pde/runs/swe_unet")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--corr-threshold", type=float, default=0.8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    train_files = sorted(glob.glob(os.path.join(args.data, "train", "*.h5")))
    valid_files = sorted(glob.glob(os.path.join(args.data, "valid", "*.h5")))
    train_ds = SWETrajectories(train_files, window=True)
    valid_ds = SWETrajectories(valid_files[rank::world], window=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=4, num_workers=2)

    model = ModernUNet(hidden=args.hidden).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))
    hist = model.module.history
    T = train_ds.T
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_corr_time = -1

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} it {i} mse {loss.item():.5f}", flush=True)

        model.eval()
        n_lead = T - hist
        sq = torch.zeros(n_lead, device=device)
        ref_sq = torch.zeros(n_lead, device=device)
        corr = torch.zeros(n_lead, device=device)
        n_traj = torch.zeros((), device=device)
        for traj in valid_loader:
            traj = traj.to(device)
            pred = model.rollout(traj[:, :hist], n_lead)
            ref = traj[:, hist:]
            sq += ((pred - ref) ** 2).flatten(2).mean(-1).sum(0)
            ref_sq += (ref ** 2).flatten(2).mean(-1).sum(0)
            p, r = pred.flatten(2), ref.flatten(2)
            p, r = p - p.mean(-1, keepdim=True), r - r.mean(-1, keepdim=True)
            corr += ((p * r).sum(-1) / (p.norm(dim=-1) * r.norm(dim=-1) + 1e-8)).sum(0)
            n_traj += traj.shape[0]
        for t in (sq, ref_sq, corr, n_traj):
            dist.all_reduce(t)
        nrmse = torch.sqrt(sq / ref_sq)
        corr = corr / n_traj
        below = (corr < args.corr_threshold).nonzero()
        corr_time = int(below[0]) if len(below) else n_lead

        if rank == 0:
            print(f"epoch {epoch} nRMSE@1 {nrmse[0]:.4f} @5 {nrmse[min(4, n_lead - 1)]:.4f} "
                  f"@end {nrmse[-1]:.4f} corr-time {corr_time} steps ({time.time() - t0:.0f}s)", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                     "nrmse": nrmse.cpu(), "corr_time": corr_time}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if corr_time > best_corr_time:
                best_corr_time = corr_time
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
