#!/usr/bin/env python
# -*- coding: utf-8 -*-
"""
CGCNN 预测形成能 (Materials Project, ~130k 结构), 多卡 DDP 训练。

用法 (单机 8 卡):
    torchrun --nproc_per_node=8 15_cgcnn_formation_energy.py --graphs data/mp_graphs_r8.pt --epochs 300

图数据由 tools/build_graphs.py 预先生成: 每个结构一个 dict
{atom_fea: [N, 92], nbr_fea: [N, M, 41], nbr_idx: [N, M], target: float, mp_id: str}
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class CrystalGraphs(Dataset):
    def __init__(self, graphs):
        self.graphs = graphs

    def __len__(self):
        return len(self.graphs)

    def __getitem__(self, i):
        return self.graphs[i]


def collate_crystals(batch):
    atom, nbr, idx, crys, tgt = [], [], [], [], []
    base = 0
    for i, g in enumerate(batch):
        n = g["atom_fea"].shape[0]
        atom.append(g["atom_fea"]); nbr.append(g["nbr_fea"]); idx.append(g["nbr_idx"] + base)
        crys.append(torch.full((n,), i, dtype=torch.long))
        tgt.append(g["target"])
        base += n
    return (torch.cat(atom), torch.cat(nbr), torch.cat(idx), torch.cat(crys),
            torch.tensor(tgt, dtype=torch.float32), len(batch))


class ConvLayer(nn.Module):
    def __init__(self, atom_dim, nbr_dim):
        super().__init__()
        self.fc = nn.Linear(2 * atom_dim + nbr_dim, 2 * atom_dim)
        self.bn1 = nn.BatchNorm1d(2 * atom_dim)
        self.bn2 = nn.BatchNorm1d(atom_dim)

    def forward(self, atom, nbr, nbr_idx):
        N, M = nbr_idx.shape
        z = torch.cat([atom.unsqueeze(1).expand(N, M, -1), atom[nbr_idx], nbr], dim=2)
        z = self.bn1(self.fc(z).view(N * M, -1)).view(N, M, -1)
        gate, core = z.chunk(2, dim=2)
        msg = (torch.sigmoid(gate) * F.softplus(core)).sum(dim=1)
        return F.softplus(atom + self.bn2(msg))


class CGCNN(nn.Module):
    def __init__(self, orig_dim=92, nbr_dim=41, atom_dim=64, n_conv=3, h_dim=128):
        super().__init__()
        self.embed = nn.Linear(orig_dim, atom_dim)
        self.convs = nn.ModuleList([ConvLayer(atom_dim, nbr_dim) for _ in range(n_conv)])
        self.fc = nn.Sequential(nn.Linear(atom_dim, h_dim), nn.Softplus(), nn.Linear(h_dim, 1))

    def forward(self, atom, nbr, nbr_idx, crystal_idx, n_crystals):
        h = self.embed(atom)
        for conv in self.convs:
            h = conv(h, nbr, nbr_idx)
        # 按晶体做平均池化
        pooled = torch.zeros(n_crystals, h.shape[1], device=h.device).index_add_(0, crystal_idx, h)
        counts = torch.bincount(crystal_idx, minlength=n_crystals).clamp(min=1).unsqueeze(1)
        return self.fc(pooled / counts).squeeze(-1)


def move(batch, device):
    atom, nbr, idx, crys, tgt, n = batch
    return (atom.to(device, non_blocking=True), nbr.to(device, non_blocking=True), idx.to(device, non_blocking=True),
            crys.to(device, non_blocking=True), tgt.to(device, non_blocking=True), n)


@torch.no_grad()
def evaluate(model, loader, mean, std, device):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)   # 绝对误差之和, 样本数
    for batch in loader:
        atom, nbr, idx, crys, tgt, n = move(batch, device)
        pred = model(atom, nbr, idx, crys, n) * std + mean
        s[0] += (pred - tgt).abs().sum().double()
        s[1] += n
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--graphs", required=True)
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=128, help="每张卡的 batch")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--out", default="checkpoints/cgcnn_ef")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    # ---- 分布式初始化 ----
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    graphs = torch.load(args.graphs, map_location="cpu")
    # 固定随机种子划分 8:1:1, 每个 rank 得到相同的划分
    perm = torch.randperm(len(graphs), generator=torch.Generator().manual_seed(42)).tolist()
    n_tr, n_va = int(0.8 * len(graphs)), int(0.1 * len(graphs))
    train_set = CrystalGraphs([graphs[i] for i in perm[:n_tr]])
    val_set = CrystalGraphs([graphs[i] for i in perm[n_tr:n_tr + n_va]])
    targets = torch.tensor([g["target"] for g in train_set.graphs])
    mean, std = targets.mean().item(), targets.std().item()

    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True)
    val_sampler = DistributedSampler(val_set, num_replicas=world, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate_crystals, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256, sampler=val_sampler, collate_fn=collate_crystals, num_workers=4)

    model = CGCNN().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    # 全局 batch = batch_size * world, 学习率按 sqrt 放大
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world ** 0.5, momentum=0.9, weight_decay=0)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[150, 250], gamma=0.1)

    start_epoch, best_mae = 0, float("inf")
    ckpt_file = os.path.join(args.out, "checkpoint.pth.tar")
    if args.resume and os.path.isfile(ckpt_file):
        ckpt = torch.load(ckpt_file, map_location=device)
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_mae = ckpt["epoch"] + 1, ckpt["best_mae"]

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"[rank0] train={len(train_set)} val={len(val_set)} world={world} mean={mean:.3f} std={std:.3f}")

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for batch in train_loader:
            atom, nbr, idx, crys, tgt, n = move(batch, device)
            pred = model(atom, nbr, idx, crys, n)
            loss = F.mse_loss(pred, (tgt - mean) / std)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach() * n, torch.tensor(float(n), device=device)])
        scheduler.step()
        dist.all_reduce(loss_sum)

        val_mae = evaluate(model, val_loader, mean, std, device)
        if rank == 0:
            print(f"Epoch {epoch:3d} | train mse {(loss_sum[0] / loss_sum[1]).item():.4f} | "
                  f"val MAE {val_mae:.4f} eV/atom | {time.time() - t0:.0f}s", flush=True)
            is_best = val_mae < best_mae
            best_mae = min(val_mae, best_mae)
            state = {"state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best_mae": best_mae,
                     "normalizer": {"mean": mean, "std": std}}
            torch.save(state, ckpt_file)
            if is_best:
                torch.save(state, os.path.join(args.out, "model_best.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
