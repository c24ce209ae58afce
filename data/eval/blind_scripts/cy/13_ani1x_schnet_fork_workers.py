"""SchNet-type potential on ANI-1x (wB97x/6-31G*), energies + forces.

The full ANI-1x HDF5 is loaded once into host memory by the launcher process
and shared with the GPU workers copy-on-write (fork), so the ~5M conformers
are not duplicated per GPU.

    python 13_ani1x_schnet_fork_workers.py --h5 /data/ani1x/ani1x-release.h5 --gpus 8
"""
import argparse
import math
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch_cluster import radius_graph
from torch_scatter import scatter

HARTREE2EV = 27.211386
SPECIES = {1: 0, 6: 1, 7: 2, 8: 3}


def load_ani1x(path, level="wb97x_dz"):
    zs, Rs, Es, Fs = [], [], [], []
    with h5py.File(path, "r") as f:
        for formula in f:
            g = f[formula]
            E = g[f"{level}.energy"][()]
            keep = ~np.isnan(E)
            if not keep.any():
                continue
            z = g["atomic_numbers"][()]
            for R, e, F in zip(g["coordinates"][()][keep], E[keep], g[f"{level}.forces"][()][keep]):
                zs.append(z)
                Rs.append(R.astype(np.float32))
                Es.append(e * HARTREE2EV)
                Fs.append((F * HARTREE2EV).astype(np.float32))
    return zs, Rs, np.asarray(Es), Fs


def fit_self_energies(zs, E):
    counts = np.zeros((len(zs), len(SPECIES)), dtype=np.float64)
    for k, z in enumerate(zs):
        for a in z:
            counts[k, SPECIES[int(a)]] += 1
    A = torch.from_numpy(counts).cuda()
    b = torch.from_numpy(E).cuda().unsqueeze(-1)
    sae = torch.linalg.lstsq(A, b).solution.squeeze(-1)
    return sae.cpu()


class Conformers(Dataset):
    def __init__(self, zs, Rs, Es, Fs, sae, idx):
        self.zs, self.Rs, self.Es, self.Fs, self.idx = zs, Rs, Es, Fs, idx
        self.sae = sae.numpy()

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, k):
        i = self.idx[k]
        sp = np.array([SPECIES[int(a)] for a in self.zs[i]])
        e = self.Es[i] - self.sae[sp].sum()
        return torch.from_numpy(sp), torch.from_numpy(self.Rs[i]), torch.tensor(e, dtype=torch.float32), \
            torch.from_numpy(self.Fs[i])


def collate(samples):
    sp, pos, e, f = zip(*samples)
    batch = torch.cat([torch.full((len(s),), k) for k, s in enumerate(sp)])
    return torch.cat(sp), torch.cat(pos), torch.stack(e), torch.cat(f), batch


class CFConv(nn.Module):
    def __init__(self, dim, n_rbf, cutoff):
        super().__init__()
        self.cutoff = cutoff
        self.filter = nn.Sequential(nn.Linear(n_rbf, dim), nn.Tanh(), nn.Linear(dim, dim))
        self.inp = nn.Linear(dim, dim, bias=False)
        self.out = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))

    def forward(self, h, ei, d, rbf):
        src, dst = ei
        w = self.filter(rbf) * (0.5 * (torch.cos(math.pi * d / self.cutoff) + 1)).unsqueeze(-1)
        return h + self.out(scatter(self.inp(h)[src] * w, dst, dim=0, dim_size=h.size(0)))


class Net(nn.Module):
    def __init__(self, dim=128, n_rbf=32, layers=4, cutoff=5.2):
        super().__init__()
        self.cutoff = cutoff
        self.emb = nn.Embedding(len(SPECIES), dim)
        self.register_buffer("mu", torch.linspace(0.5, cutoff, n_rbf))
        self.convs = nn.ModuleList([CFConv(dim, n_rbf, cutoff) for _ in range(layers)])
        self.head = nn.Sequential(nn.Linear(dim, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, sp, pos, batch, n_mol):
        pos.requires_grad_(True)
        ei = radius_graph(pos, r=self.cutoff, batch=batch, max_num_neighbors=64)
        d = (pos[ei[0]] - pos[ei[1]]).norm(dim=-1)
        rbf = torch.exp(-4.0 * (d.unsqueeze(-1) - self.mu) ** 2)
        h = self.emb(sp)
        for conv in self.convs:
            h = conv(h, ei, d, rbf)
        energy = scatter(self.head(h).squeeze(-1), batch, dim=0, dim_size=n_mol)
        forces = -torch.autograd.grad(energy.sum(), pos, create_graph=self.training)[0]
        return energy, forces


def worker(rank, world, args, data, sae, splits):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    train_ds = Conformers(*data, sae, splits["train"])
    val_ds = Conformers(*data, sae, splits["val"][rank::world])
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=512, collate_fn=collate, num_workers=2)

    model = DDP(Net().to(device), device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for sp, pos, e, f, batch in train_dl:
            sp, pos, e, f, batch = (x.to(device, non_blocking=True) for x in (sp, pos, e, f, batch))
            n_atoms = torch.bincount(batch, minlength=e.numel()).float()
            pe, pf = model(sp, pos, batch, e.numel())
            loss = (((pe - e) / n_atoms.sqrt()) ** 2).mean() + args.force_weight * ((pf - f) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        net = model.module.eval()
        sums = torch.zeros(4, dtype=torch.float64, device=device)
        for sp, pos, e, f, batch in val_dl:
            sp, pos, e, f, batch = (x.to(device) for x in (sp, pos, e, f, batch))
            pe, pf = net(sp, pos, batch, e.numel())
            sums += torch.stack([(pe.detach() - e).abs().sum().double(), (pf.detach() - f).abs().sum().double(),
                                 torch.tensor(e.numel(), device=device, dtype=torch.float64),
                                 torch.tensor(f.numel(), device=device, dtype=torch.float64)])
        dist.all_reduce(sums)
        if rank == 0:
            print(f"epoch {epoch}: val E MAE {1000 * sums[0] / sums[2]:.1f} meV, "
                  f"F MAE {1000 * sums[1] / sums[3]:.1f} meV/A ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "sae": sae, "epoch": epoch},
                       os.path.join(args.out, "ani1x_schnet.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--h5", required=True)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--force-weight", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/ani1x")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    zs, Rs, Es, Fs = load_ani1x(args.h5)
    sae = fit_self_energies(zs, Es)
    print(f"{len(Es)} conformers; self-atomic energies (eV): {sae.tolist()}")
    perm = np.random.default_rng(args.seed).permutation(len(Es))
    n_val = len(Es) // 20
    splits = {"val": perm[:n_val], "train": perm[n_val:]}

    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29541")
    mp.start_processes(worker, args=(args.gpus, args, (zs, Rs, Es, Fs), sae, splits), nprocs=args.gpus,
                       join=True, start_method="fork")


if __name__ == "__main__":
    main()
