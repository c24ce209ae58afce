"""SchNet energy+force model on ANI-1x (wB97x/6-31G*), data-parallel over GPUs.

    torchrun --standalone --nproc_per_node=4 15_ani1x_schnet_forces.py --h5 /data/ani1x-release.h5
"""
import argparse
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, Subset
from torch_geometric.data import Data
from torch_geometric.loader import DataLoader
from torch_geometric.nn.models import SchNet

HA2EV = 27.211386246
# wB97x/6-31G* isolated-atom energies (Hartree), subtracted so the model learns atomisation energies
SELF_ENERGY = {1: -0.600952980000, 6: -38.08316124000, 7: -54.70775770000, 8: -75.19446356000}
E_KEY, F_KEY = "wb97x_dz.energy", "wb97x_dz.forces"


class ANI1x(Dataset):
    def __init__(self, path):
        zs, pos, energies, forces = [], [], [], []
        with h5py.File(path, "r") as f:
            for formula in f:
                g = f[formula]
                e = g[E_KEY][()]
                ok = ~np.isnan(e) & ~np.isnan(g[F_KEY][()]).any(axis=(1, 2))
                z = g["atomic_numbers"][()]
                ref = sum(SELF_ENERGY[int(a)] for a in z)
                for c in np.nonzero(ok)[0]:
                    zs.append(z)
                    pos.append(g["coordinates"][c])
                    energies.append((e[c] - ref) * HA2EV)
                    forces.append(g[F_KEY][c] * HA2EV)  # Ha/A -> eV/A
        self.z, self.pos, self.energy, self.forces = zs, pos, energies, forces

    def __len__(self):
        return len(self.z)

    def __getitem__(self, i):
        return Data(z=torch.from_numpy(self.z[i]).long(), pos=torch.from_numpy(self.pos[i]).float(),
                    energy=torch.tensor([self.energy[i]], dtype=torch.float32),
                    forces=torch.from_numpy(self.forces[i]).float())


def predict(model, batch, create_graph):
    batch.pos.requires_grad_(True)
    energy = model(batch.z, batch.pos, batch.batch).view(-1)
    forces = -torch.autograd.grad(energy.sum(), batch.pos, create_graph=create_graph)[0]
    return energy, forces


def run_validation(model, loader, device):
    model.eval()
    totals = torch.zeros(4, device=device, dtype=torch.float64)
    for batch in loader:
        batch = batch.to(device)
        e, f = predict(model, batch, create_graph=False)
        totals[0] += (e.detach() - batch.energy).abs().sum()
        totals[1] += batch.num_graphs
        totals[2] += (f.detach() - batch.forces).abs().sum()
        totals[3] += f.numel()
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item(), (totals[2] / totals[3]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--h5", required=True)
    ap.add_argument("--ckpt", default="checkpoints/ani1x_schnet.pt")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--rho", type=float, default=0.01, help="energy weight; forces get 1 - rho")
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    t_load = time.time()
    data = ANI1x(args.h5)
    perm = np.random.default_rng(0).permutation(len(data))
    n_val = len(data) // 20
    train_set = Subset(data, perm[n_val:].tolist())
    val_set = Subset(data, perm[:n_val][rank::world].tolist())
    if rank == 0:
        print(f"loaded {len(data)} conformers in {time.time() - t_load:.0f}s "
              f"({len(train_set)} train / {n_val} val)", flush=True)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=256, num_workers=2)

    torch.manual_seed(0)
    net = SchNet(hidden_channels=256, num_filters=256, num_interactions=5, num_gaussians=64,
                 cutoff=5.2, max_num_neighbors=48, readout="add").to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=3, threshold=1e-3)

    start_epoch, best = 0, float("inf")
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, map_location=device)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch, best = state["epoch"] + 1, state["best"]
    if rank == 0:
        os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        run = torch.zeros(3, device=device)
        for i, batch in enumerate(train_loader):
            batch = batch.to(device, non_blocking=True)
            e, f = predict(model, batch, create_graph=True)
            e_loss = torch.nn.functional.mse_loss(e, batch.energy)
            f_loss = torch.nn.functional.mse_loss(f, batch.forces)
            loss = args.rho * e_loss + (1 - args.rho) * f_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            run += torch.stack([e_loss.detach(), f_loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        e_mae, f_mae = run_validation(net, val_loader, device)
        sched.step(f_mae)
        if rank == 0:
            print(f"epoch {epoch}: train E-MSE {run[0] / run[2]:.4f} F-MSE {run[1] / run[2]:.4f} | "
                  f"val E-MAE {e_mae * 1000:.1f} meV F-MAE {f_mae * 1000:.1f} meV/A | "
                  f"lr {opt.param_groups[0]['lr']:.1e} | {time.time() - t0:.0f}s", flush=True)
            best = min(best, f_mae)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best}, args.ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
