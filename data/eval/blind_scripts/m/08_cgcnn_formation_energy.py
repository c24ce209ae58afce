# -*- coding: utf-8 -*-
"""
Crystal graph CNN (Xie & Grossman 2018 style) for formation energy per atom on a
Materials Project snapshot. Graphs are precomputed by make_graphs.py into one pickle:
    list of dict(atom_fea=(n, 92), nbr_fea_idx=(n, M), nbr_dist=(n, M), target=float, mp_id=str)

Run:
    python -m torch.distributed.launch --nproc_per_node=4 08_cgcnn_formation_energy.py \
        --graphs data/mp_2019_graphs.pkl --epochs 500
"""
import argparse
import csv
import os
import pickle
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser(description="CGCNN DDP")
parser.add_argument("--graphs", default="data/mp_2019_graphs.pkl")
parser.add_argument("--epochs", type=int, default=500)
parser.add_argument("--batch-size", type=int, default=256)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--atom-fea-len", type=int, default=64)
parser.add_argument("--n-conv", type=int, default=3)
parser.add_argument("--h-fea-len", type=int, default=128)
parser.add_argument("--radius-bins", type=int, default=41)
parser.add_argument("--train-ratio", type=float, default=0.8)
parser.add_argument("--val-ratio", type=float, default=0.1)
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--outdir", default="cgcnn_out")


class GaussianDistance:
    def __init__(self, dmin=0.0, dmax=8.0, n=41, var=0.2):
        self.filter = np.linspace(dmin, dmax, n)
        self.var = var

    def expand(self, d):
        return np.exp(-((d[..., None] - self.filter) ** 2) / self.var ** 2)


class CrystalGraphs(Dataset):
    def __init__(self, graphs, gdf):
        self.graphs = graphs
        self.gdf = gdf

    def __len__(self):
        return len(self.graphs)

    def __getitem__(self, i):
        g = self.graphs[i]
        nbr_fea = self.gdf.expand(g["nbr_dist"]).astype(np.float32)
        return (torch.from_numpy(g["atom_fea"].astype(np.float32)), torch.from_numpy(nbr_fea),
                torch.from_numpy(g["nbr_fea_idx"].astype(np.int64)), float(g["target"]), g["mp_id"])


def collate_pool(batch):
    atom_fea, nbr_fea, nbr_idx, crys_idx, targets, ids = [], [], [], [], [], []
    base = 0
    for af, nf, ni, t, mid in batch:
        n = af.shape[0]
        atom_fea.append(af)
        nbr_fea.append(nf)
        nbr_idx.append(ni + base)
        crys_idx.append(torch.arange(n) + base)
        targets.append(t)
        ids.append(mid)
        base += n
    return (torch.cat(atom_fea), torch.cat(nbr_fea), torch.cat(nbr_idx), crys_idx,
            torch.tensor(targets, dtype=torch.float32).unsqueeze(1), ids)


class ConvLayer(nn.Module):
    def __init__(self, atom_fea_len, nbr_fea_len):
        super().__init__()
        self.fc_full = nn.Linear(2 * atom_fea_len + nbr_fea_len, 2 * atom_fea_len)
        self.bn1 = nn.BatchNorm1d(2 * atom_fea_len)
        self.bn2 = nn.BatchNorm1d(atom_fea_len)
        self.softplus = nn.Softplus()

    def forward(self, atom_in, nbr_fea, nbr_idx):
        N, M = nbr_idx.shape
        atom_nbr = atom_in[nbr_idx, :]
        total = torch.cat([atom_in.unsqueeze(1).expand(N, M, -1), atom_nbr, nbr_fea], dim=2)
        gated = self.fc_full(total)
        gated = self.bn1(gated.view(-1, gated.shape[-1])).view(N, M, -1)
        filt, core = gated.chunk(2, dim=2)
        summed = torch.sum(torch.sigmoid(filt) * self.softplus(core), dim=1)
        return self.softplus(atom_in + self.bn2(summed))


class CGCNN(nn.Module):
    def __init__(self, orig_len=92, nbr_len=41, atom_len=64, n_conv=3, h_len=128):
        super().__init__()
        self.embedding = nn.Linear(orig_len, atom_len)
        self.convs = nn.ModuleList([ConvLayer(atom_len, nbr_len) for _ in range(n_conv)])
        self.conv_to_fc = nn.Linear(atom_len, h_len)
        self.act = nn.Softplus()
        self.fc_out = nn.Linear(h_len, 1)

    def forward(self, atom_fea, nbr_fea, nbr_idx, crys_idx):
        x = self.embedding(atom_fea)
        for conv in self.convs:
            x = conv(x, nbr_fea, nbr_idx)
        crys = torch.stack([x[idx].mean(dim=0) for idx in crys_idx])
        return self.fc_out(self.act(self.conv_to_fc(self.act(crys))))


class Normalizer:
    def __init__(self, t):
        self.mean, self.std = t.mean(), t.std()

    def norm(self, t):
        return (t - self.mean) / self.std

    def denorm(self, t):
        return t * self.std + self.mean

    def state_dict(self):
        return {"mean": float(self.mean), "std": float(self.std)}


def run(model, loader, normalizer, device, optimizer=None):
    training = optimizer is not None
    model.train(training)
    mae_sum = torch.zeros(2, device=device)
    for atom_fea, nbr_fea, nbr_idx, crys_idx, target, _ in loader:
        atom_fea, nbr_fea, nbr_idx = atom_fea.to(device), nbr_fea.to(device), nbr_idx.to(device)
        crys_idx = [c.to(device) for c in crys_idx]
        target = target.to(device)
        with torch.set_grad_enabled(training):
            out = model(atom_fea, nbr_fea, nbr_idx, crys_idx)
            loss = nn.functional.mse_loss(out, normalizer.norm(target))
        if training:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        mae_sum[0] += (normalizer.denorm(out.detach()) - target).abs().sum()
        mae_sum[1] += target.shape[0]
    dist.all_reduce(mae_sum)
    return (mae_sum[0] / mae_sum[1]).item()


def main():
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    with open(args.graphs, "rb") as f:
        graphs = pickle.load(f)
    random.Random(123).shuffle(graphs)
    n_tr = int(args.train_ratio * len(graphs))
    n_va = int(args.val_ratio * len(graphs))
    gdf = GaussianDistance(n=args.radius_bins)
    train_set = CrystalGraphs(graphs[:n_tr], gdf)
    val_set = CrystalGraphs(graphs[n_tr:n_tr + n_va], gdf)

    normalizer = Normalizer(torch.tensor([g["target"] for g in graphs[:n_tr]], dtype=torch.float32))
    normalizer.mean, normalizer.std = normalizer.mean.to(device), normalizer.std.to(device)

    train_sampler = DistributedSampler(train_set)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate_pool, num_workers=4, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            collate_fn=collate_pool, num_workers=4)

    model = CGCNN(nbr_len=args.radius_bins, atom_len=args.atom_fea_len, n_conv=args.n_conv,
                  h_len=args.h_fea_len).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=0)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[100], gamma=0.1)

    if rank == 0:
        os.makedirs(args.outdir, exist_ok=True)
        log_f = open(os.path.join(args.outdir, "train_log.csv"), "w", newline="")
        writer = csv.writer(log_f)
        writer.writerow(["epoch", "train_mae", "val_mae", "seconds"])

    best_mae = 1e10
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        train_mae = run(model, train_loader, normalizer, device, optimizer)
        val_mae = run(model, val_loader, normalizer, device)
        scheduler.step()
        if rank == 0:
            writer.writerow([epoch, f"{train_mae:.5f}", f"{val_mae:.5f}", f"{time.time() - t0:.1f}"])
            log_f.flush()
            print(f"Epoch {epoch}: train MAE {train_mae:.4f} eV/atom, val MAE {val_mae:.4f} eV/atom")
            if val_mae < best_mae:
                best_mae = val_mae
                torch.save({"state_dict": model.module.state_dict(), "normalizer": normalizer.state_dict(),
                            "epoch": epoch, "args": vars(args)}, os.path.join(args.outdir, "model_best.pth.tar"))

    if rank == 0:
        log_f.close()
        print(f"best val MAE {best_mae:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
