"""
SchNet-style continuous-filter convolution network trained on energies of rMD17 (aspirin).
Written without torch_geometric (the cluster image does not have it).

rmd17_aspirin.npz:  nuclear_charges (21,), coords (N, 21, 3) Angstrom, energies (N,) kcal/mol

    torchrun --nproc_per_node=4 13_schnet_md17_energy.py --data data/rmd17_aspirin.npz
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class MD17(Dataset):
    def __init__(self, path):
        d = np.load(path)
        self.z = torch.from_numpy(d["nuclear_charges"].astype(np.int64))
        self.pos = torch.from_numpy(d["coords"].astype(np.float32))
        self.energy = torch.from_numpy(d["energies"].astype(np.float32))

    def __len__(self):
        return len(self.energy)

    def __getitem__(self, i):
        return self.pos[i], self.energy[i]


def shifted_softplus(x):
    return nn.functional.softplus(x) - math.log(2.0)


class CosineCutoff(nn.Module):
    def __init__(self, rc):
        super().__init__()
        self.rc = rc

    def forward(self, d):
        return 0.5 * (torch.cos(d * math.pi / self.rc) + 1.0) * (d < self.rc).float()


class Interaction(nn.Module):
    def __init__(self, h, n_rbf, rc):
        super().__init__()
        self.filter = nn.Sequential(nn.Linear(n_rbf, h), nn.Softplus(), nn.Linear(h, h))
        self.in2f = nn.Linear(h, h, bias=False)
        self.f2out = nn.Linear(h, h)
        self.dense = nn.Linear(h, h)
        self.cut = CosineCutoff(rc)

    def forward(self, x, rbf, d, mask):
        # x: (B, n, h), rbf: (B, n, n, K), d: (B, n, n), mask: (B, n, n)
        W = self.filter(rbf) * (self.cut(d) * mask).unsqueeze(-1)
        y = self.in2f(x)
        y = torch.einsum("bijh,bjh->bih", W, y)
        y = shifted_softplus(self.f2out(y))
        return self.dense(y)


class SchNet(nn.Module):
    def __init__(self, z, hidden=128, n_inter=6, n_rbf=50, rc=5.0, mean=0.0, std=1.0):
        super().__init__()
        self.register_buffer("z", z)
        self.emb = nn.Embedding(100, hidden)
        self.register_buffer("mu", torch.linspace(0, rc, n_rbf))
        self.gamma = 10.0
        self.inter = nn.ModuleList([Interaction(hidden, n_rbf, rc) for _ in range(n_inter)])
        self.out = nn.Sequential(nn.Linear(hidden, hidden // 2), nn.Softplus(), nn.Linear(hidden // 2, 1))
        self.register_buffer("e_mean", torch.tensor(float(mean)))
        self.register_buffer("e_std", torch.tensor(float(std)))

    def forward(self, pos):
        B, n, _ = pos.shape
        d = torch.cdist(pos, pos)
        mask = 1.0 - torch.eye(n, device=pos.device).unsqueeze(0)
        rbf = torch.exp(-self.gamma * (d.unsqueeze(-1) - self.mu) ** 2)
        x = self.emb(self.z).unsqueeze(0).expand(B, -1, -1)
        for blk in self.inter:
            x = x + blk(x, rbf, d, mask)
        e_atom = self.out(x).squeeze(-1) * self.e_std + self.e_mean
        return e_atom.sum(1)


def setup_ddp():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank


def reduce_mean(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/rmd17_aspirin.npz")
    ap.add_argument("--n_train", type=int, default=950)
    ap.add_argument("--n_val", type=int, default=50)
    ap.add_argument("--split_seed", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=3000)
    ap.add_argument("--bs", type=int, default=8, help="molecules per GPU")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--ckpt", default="ckpt/schnet_aspirin.pt")
    args = ap.parse_args()

    local_rank = setup_ddp()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    ds = MD17(args.data)
    perm = np.random.RandomState(args.split_seed).permutation(len(ds))
    tr_idx = perm[: args.n_train]
    va_idx = perm[args.n_train: args.n_train + args.n_val]
    te_idx = perm[args.n_train + args.n_val:]
    e_tr = ds.energy[tr_idx]
    mean, std = e_tr.mean().item() / len(ds.z), e_tr.std().item()

    train_set = Subset(ds, tr_idx)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.split_seed, drop_last=True)
    train_dl = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=2, pin_memory=True)
    # every rank evaluates a disjoint strided piece; results are summed with all_reduce
    val_dl = DataLoader(Subset(ds, va_idx[rank::world]), batch_size=64)
    test_dl = DataLoader(Subset(ds, te_idx[rank::world]), batch_size=256)

    # the atom-wise mean is added per atom -> the sum gives the molecular mean
    model = SchNet(ds.z, mean=mean, std=std / math.sqrt(len(ds.z))).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.8, patience=50, min_lr=1e-6)

    def evaluate(loader):
        model.eval()
        err = torch.zeros(3, device=device)
        with torch.no_grad():
            for pos, e in loader:
                pred = model(pos.to(device))
                diff = pred - e.to(device)
                err += torch.stack([diff.abs().sum(), (diff ** 2).sum(), torch.tensor(float(len(e)), device=device)])
        err = reduce_mean(err)
        model.train()
        return (err[0] / err[2]).item(), math.sqrt((err[1] / err[2]).item())

    best = float("inf")
    t_start = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for pos, e in train_dl:
            pos, e = pos.to(device, non_blocking=True), e.to(device, non_blocking=True)
            loss = ((ddp(pos) - e) ** 2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if epoch % 10 == 0:
            val_mae, val_rmse = evaluate(val_dl)
            sched.step(val_mae)
            if rank == 0:
                print(f"epoch {epoch:5d} val MAE {val_mae:.3f} kcal/mol RMSE {val_rmse:.3f} "
                      f"lr {opt.param_groups[0]['lr']:.2e} elapsed {(time.time() - t_start) / 60:.1f} min",
                      flush=True)
                if val_mae < best:
                    best = val_mae
                    os.makedirs(os.path.dirname(args.ckpt), exist_ok=True)
                    torch.save({"model": model.state_dict(), "epoch": epoch, "val_mae": val_mae}, args.ckpt)
            if opt.param_groups[0]["lr"] <= 1.01e-6:
                break

    dist.barrier()
    state = torch.load(args.ckpt, map_location=device)
    model.load_state_dict(state["model"])
    test_mae, test_rmse = evaluate(test_dl)
    if rank == 0:
        print(f"test MAE {test_mae:.3f} kcal/mol, RMSE {test_rmse:.3f} (best epoch {state['epoch']})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
