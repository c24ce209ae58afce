"""Learned time stepper for 2D heat conduction with heterogeneous conductivity.

Training: data parallel on random 128x128 crops of 513x513 solver snapshots
(vertex-centred grid, Dirichlet boundaries).
Evaluation: the stepper is local (receptive field = number of 3x3 convs), so full
513x513 rollouts are split into row slabs across the ranks; each step every rank
advances its slab (with halo rows) and the slabs are all-gathered into the new state.

    torchrun --standalone --nproc_per_node=4 10_heat_eq_slab_parallel.py --data /data/heat/kappa_lognormal.h5
"""
import argparse
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


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="HDF5: kappa [N,H,W], u [N,T,H,W]")
    p.add_argument("--out", default="runs/heat_stepper")
    p.add_argument("--n-val", type=int, default=8)
    p.add_argument("--crop", type=int, default=128)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--width", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rollout", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=5)
    return p.parse_args()


class HeatCrops(Dataset):
    def __init__(self, path, sample_ids, crop):
        self.path, self.crop = path, crop
        with h5py.File(path, "r") as f:
            self.T, self.H, self.W = f["u"].shape[1:]
        self.items = [(n, t) for n in sample_ids for t in range(self.T - 1)]
        self.f = None

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        n, t = self.items[i]
        r0 = np.random.randint(0, self.H - self.crop + 1)
        c0 = np.random.randint(0, self.W - self.crop + 1)
        rs, cs = slice(r0, r0 + self.crop), slice(c0, c0 + self.crop)
        kappa = self.f["kappa"][n, rs, cs].astype(np.float32)
        u0 = self.f["u"][n, t, rs, cs].astype(np.float32)
        u1 = self.f["u"][n, t + 1, rs, cs].astype(np.float32)
        x = torch.from_numpy(np.stack([u0, np.log(kappa)]))
        return x, torch.from_numpy(u1[None])


class LocalStepper(nn.Module):
    """Residual stack of 3x3 'valid' convolutions: output is `depth` pixels smaller on each side."""

    def __init__(self, width, depth):
        super().__init__()
        self.depth = depth
        layers = [nn.Conv2d(2, width, 3)]
        for _ in range(depth - 2):
            layers += [nn.GELU(), nn.Conv2d(width, width, 3)]
        layers += [nn.GELU(), nn.Conv2d(width, 1, 3)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        d = self.depth
        return x[:, :1, d:-d, d:-d] + self.net(x)


def seed_worker(worker_id):
    np.random.seed(torch.initial_seed() % 2**32)


def init_dist():
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), local_rank


@torch.no_grad()
def slab_rollout(stepper, u0, logk, steps, rank, world):
    """Roll out on the full grid, each rank advancing its own block of rows."""
    d = stepper.depth
    H, W = u0.shape
    bounds = [(int(c[0]), int(c[-1]) + 1) for c in torch.tensor_split(torch.arange(H), world)]
    r0, r1 = bounds[rank]
    u = u0.clone()
    traj = [u]
    for _ in range(steps):
        up = F.pad(u[None, None], (d, d, d, d))  # Dirichlet: zero halo outside the domain
        kp = F.pad(logk[None, None], (d, d, d, d), mode="replicate")
        x = torch.cat([up, kp], dim=1)[..., r0:r1 + 2 * d, :]
        local = stepper(x)[0, 0]
        pieces = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(pieces, local)
        u = torch.cat(pieces, dim=0)
        u[0, :] = u[-1, :] = 0.0
        u[:, 0] = u[:, -1] = 0.0
        traj.append(u)
    return torch.stack(traj)


def main():
    args = get_args()
    rank, world, local_rank = init_dist()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    with h5py.File(args.data, "r") as f:
        n_samples = f["u"].shape[0]
    train_ids = list(range(n_samples - args.n_val))
    val_ids = list(range(n_samples - args.n_val, n_samples))
    train_ds = HeatCrops(args.data, train_ids, args.crop)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, worker_init_fn=seed_worker)

    stepper = LocalStepper(args.width, args.depth).to(device)
    model = DDP(stepper, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=5)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    d = args.depth
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = model(x)
            loss = F.mse_loss(pred, y[..., d:-d, d:-d])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        train_loss = (acc[0] / acc[1]).item()
        sched.step(train_loss)
        msg = f"epoch {epoch:3d} {time.time() - t0:6.1f}s train {train_loss:.3e}"

        if (epoch + 1) % args.eval_every == 0:
            model.eval()
            errs = []
            with h5py.File(args.data, "r") as f:
                for n in val_ids:
                    steps = min(args.rollout, f["u"].shape[1] - 1)
                    gt = torch.from_numpy(f["u"][n, : steps + 1].astype(np.float32)).to(device)
                    logk = torch.from_numpy(np.log(f["kappa"][n].astype(np.float32))).to(device)
                    traj = slab_rollout(stepper, gt[0], logk, steps, rank, world)
                    errs.append(((traj[-1] - gt[-1]).norm() / gt[-1].norm()).item())
            msg += f" | rollout-{args.rollout} rel-L2 {np.mean(errs):.4f}"
            if rank == 0:
                torch.save({"model": stepper.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                            "val_rel_l2": float(np.mean(errs))}, os.path.join(args.out, f"stepper_{epoch + 1:03d}.pt"))
        if rank == 0:
            print(msg, flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
