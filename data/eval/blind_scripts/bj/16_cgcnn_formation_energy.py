"""CGCNN on Materials Project formation energies (eV/atom).

Crystal graphs (12 nearest neighbours within 8 A, Gaussian-expanded distances) were
built offline with build_graphs.py and stored as one torch file per split.

    torchrun --standalone --nproc_per_node=4 16_cgcnn_formation_energy.py
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class CrystalGraphs(Dataset):
    def __init__(self, path):
        blob = torch.load(path, map_location="cpu")
        self.atom_fea = blob["atom_fea"]  # list of (n_i, 92)
        self.nbr_fea = blob["nbr_fea"]  # list of (n_i, M, 41)
        self.nbr_idx = blob["nbr_idx"]  # list of (n_i, M)
        self.target = blob["target"]  # (N,)
        self.ids = blob["material_id"]

    def __len__(self):
        return len(self.target)

    def __getitem__(self, i):
        return self.atom_fea[i], self.nbr_fea[i], self.nbr_idx[i], self.target[i]


def collate_pool(batch):
    atom, nbr, idx, crys, y = [], [], [], [], []
    base = 0
    for i, (a, n, j, t) in enumerate(batch):
        atom.append(a)
        nbr.append(n)
        idx.append(j + base)
        crys.append(torch.full((a.shape[0],), i, dtype=torch.long))
        y.append(t)
        base += a.shape[0]
    return torch.cat(atom), torch.cat(nbr), torch.cat(idx), torch.cat(crys), torch.stack(y).float()


class ConvLayer(nn.Module):
    def __init__(self, atom_len, nbr_len):
        super().__init__()
        self.fc = nn.Linear(2 * atom_len + nbr_len, 2 * atom_len)
        self.norm1 = nn.LayerNorm(2 * atom_len)
        self.norm2 = nn.LayerNorm(atom_len)

    def forward(self, atom, nbr, idx):
        N, M = idx.shape
        nbr_atom = atom[idx]
        total = torch.cat([atom.unsqueeze(1).expand(N, M, -1), nbr_atom, nbr], dim=2)
        gated = self.norm1(self.fc(total))
        filt, core = gated.chunk(2, dim=2)
        summed = (torch.sigmoid(filt) * F.softplus(core)).sum(dim=1)
        return F.softplus(atom + self.norm2(summed))


class CGCNN(nn.Module):
    def __init__(self, orig_len=92, nbr_len=41, atom_len=64, n_conv=3, h_len=128, n_h=1):
        super().__init__()
        self.embedding = nn.Linear(orig_len, atom_len)
        self.convs = nn.ModuleList([ConvLayer(atom_len, nbr_len) for _ in range(n_conv)])
        self.fc = nn.Linear(atom_len, h_len)
        self.hidden = nn.ModuleList([nn.Linear(h_len, h_len) for _ in range(n_h - 1)])
        self.out = nn.Linear(h_len, 1)

    def forward(self, atom, nbr, idx, crys):
        x = self.embedding(atom)
        for conv in self.convs:
            x = conv(x, nbr, idx)
        n_crys = int(crys.max()) + 1
        pooled = torch.zeros(n_crys, x.shape[1], device=x.device).index_add_(0, crys, x)
        counts = torch.bincount(crys, minlength=n_crys).clamp(min=1).unsqueeze(1)
        h = F.softplus(self.fc(F.softplus(pooled / counts)))
        for lin in self.hidden:
            h = F.softplus(lin(h))
        return self.out(h).squeeze(-1)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--graphs", default="/project/matsci/mp_2023/graphs")
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=500)
    p.add_argument("--milestones", type=int, nargs="+", default=[300, 400])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out", default="/project/matsci/runs/cgcnn_eform")
    p.add_argument("--seed", type=int, default=123)
    return p.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_ds = CrystalGraphs(os.path.join(args.graphs, "train.pt"))
    val_ds = CrystalGraphs(os.path.join(args.graphs, "val.pt"))
    test_ds = CrystalGraphs(os.path.join(args.graphs, "test.pt"))
    y_mean, y_std = train_ds.target.mean().item(), train_ds.target.std().item()

    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate_pool, num_workers=args.workers, pin_memory=True)

    def shard(ds):
        return DataLoader(Subset(ds, list(range(rank, len(ds), world))), batch_size=256,
                          collate_fn=collate_pool, num_workers=2)

    val_loader, test_loader = shard(val_ds), shard(test_ds)

    model = CGCNN().to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.milestones, gamma=0.1)

    @torch.no_grad()
    def mae(loader):
        net = model.module
        net.eval()
        s = torch.zeros(2, device=device)
        for atom, nbr, idx, crys, y in loader:
            atom, nbr, idx, crys, y = (t.to(device, non_blocking=True) for t in (atom, nbr, idx, crys, y))
            pred = net(atom, nbr, idx, crys) * y_std + y_mean
            s[0] += (pred - y).abs().sum()
            s[1] += y.numel()
        dist.all_reduce(s)
        return (s[0] / s[1]).item()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = float("inf")
    history = []
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for atom, nbr, idx, crys, y in train_loader:
            atom, nbr, idx, crys, y = (t.to(device, non_blocking=True) for t in (atom, nbr, idx, crys, y))
            pred = model(atom, nbr, idx, crys)
            loss = F.mse_loss(pred, (y - y_mean) / y_std)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            run += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
        scheduler.step()
        dist.all_reduce(run)

        val_mae = mae(val_loader)
        history.append({"epoch": epoch, "train_mse": (run[0] / run[1]).item(), "val_mae": val_mae})
        if rank == 0:
            print(f"epoch {epoch:3d} train mse {history[-1]['train_mse']:.4f} val MAE {val_mae:.4f} eV/atom "
                  f"({time.time() - t0:.1f}s)", flush=True)
            if val_mae < best:
                best = val_mae
                torch.save({"model": model.module.state_dict(), "y_mean": y_mean, "y_std": y_std,
                            "epoch": epoch}, os.path.join(args.out, "model_best.pth"))

    # final evaluation with the best weights
    dist.barrier()
    ckpt = torch.load(os.path.join(args.out, "model_best.pth"), map_location=device)
    model.module.load_state_dict(ckpt["model"])
    test_mae = mae(test_loader)
    if rank == 0:
        print(f"test MAE {test_mae:.4f} eV/atom (best val {best:.4f})", flush=True)
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump({"history": history, "test_mae": test_mae}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
