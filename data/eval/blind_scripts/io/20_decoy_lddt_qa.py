"""Model quality assessment: predict per-residue lDDT of structure decoys (CASP-style EMA).

Each decoy npz holds the target sequence, the decoy's C-alpha coordinates and the
per-residue lDDT against the native. A distance-biased transformer over residues
predicts per-residue lDDT; the global score is its mean. Decoys of the same target
never cross the train/validation boundary (split by target in targets_{train,val}.txt).

    torchrun --nproc_per_node=8 20_decoy_lddt_qa.py --decoy_dir data/casp_decoys --out runs/qa
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

AA = "ACDEFGHIKLMNPQRSTVWY"
AA_IDX = {a: i for i, a in enumerate(AA)}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--decoy_dir", required=True)
    p.add_argument("--max_len", type=int, default=400)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--out", default="runs/qa")
    return p.parse_args()


def decoy_files(decoy_dir, target_list):
    targets = [t.strip() for t in open(target_list) if t.strip()]
    files = []
    for t in targets:
        files += sorted(glob.glob(os.path.join(decoy_dir, t, "*.npz")))
    return files


class DecoySet(Dataset):
    def __init__(self, files, max_len, train):
        self.files, self.max_len, self.train = files, max_len, train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        seq = torch.tensor([AA_IDX.get(a, 20) for a in str(d["seq"])])
        ca = torch.from_numpy(d["ca"]).float()
        lddt = torch.from_numpy(d["lddt"]).float()
        L = seq.shape[0]
        if L > self.max_len:
            s = random.randint(0, L - self.max_len) if self.train else 0
            seq, ca, lddt = seq[s:s + self.max_len], ca[s:s + self.max_len], lddt[s:s + self.max_len]
        return seq, ca, lddt


def collate(batch):
    L = max(x[0].shape[0] for x in batch)
    B = len(batch)
    seq = torch.full((B, L), 21, dtype=torch.long)
    ca = torch.zeros(B, L, 3)
    y = torch.full((B, L), -1.0)
    for b, (s, c, l) in enumerate(batch):
        n = s.shape[0]
        seq[b, :n], ca[b, :n], y[b, :n] = s, c, l
    return seq, ca, y


class DistanceBiasedLayer(nn.Module):
    def __init__(self, dim, heads=8, n_rbf=16):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.bias = nn.Linear(n_rbf, heads)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, rbf, pad):
        B, L, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.bias(rbf).permute(0, 3, 1, 2).masked_fill(pad[:, None, None, :], float("-inf"))
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = x + self.proj(h.transpose(1, 2).reshape(B, L, D))
        return x + self.ff(self.norm2(x))


class LDDTPredictor(nn.Module):
    def __init__(self, dim, layers, n_rbf=16):
        super().__init__()
        self.embed = nn.Embedding(22, dim)
        self.n_rbf = n_rbf
        self.layers = nn.ModuleList([DistanceBiasedLayer(dim, n_rbf=n_rbf) for _ in range(layers)])
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 1))

    def forward(self, seq, ca):
        pad = seq == 21
        d = torch.cdist(ca, ca)
        mu = torch.linspace(0.0, 20.0, self.n_rbf, device=ca.device)
        rbf = torch.exp(-((d[..., None] - mu) / 1.25) ** 2)
        x = self.embed(seq)
        for layer in self.layers:
            x = layer(x, rbf, pad)
        return torch.sigmoid(self.head(x).squeeze(-1))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    abs_err, n_res = 0.0, 0
    glob_pred, glob_true = [], []
    for seq, ca, y in loader:
        seq, ca, y = seq.to(device), ca.to(device), y.to(device)
        pred = model(seq, ca)
        m = y >= 0
        abs_err += (pred - y).abs()[m].sum().item()
        n_res += int(m.sum())
        for b in range(seq.shape[0]):
            glob_pred.append(pred[b][m[b]].mean().item())
            glob_true.append(y[b][m[b]].mean().item())
    model.train()
    pearson = float(np.corrcoef(glob_pred, glob_true)[0, 1]) if len(glob_pred) > 1 else 0.0
    return abs_err / max(n_res, 1), pearson


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_files = decoy_files(args.decoy_dir, os.path.join(args.decoy_dir, "targets_train.txt"))
    val_files = decoy_files(args.decoy_dir, os.path.join(args.decoy_dir, "targets_val.txt"))
    train_set = DecoySet(train_files, args.max_len, train=True)
    val_set = DecoySet(val_files, args.max_len, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=16, sampler=val_sampler, collate_fn=collate, num_workers=2)

    model = LDDTPredictor(args.dim, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_set)} train decoys, {len(val_set)} val decoys, {world} GPUs", flush=True)
    best_r = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for seq, ca, y in train_loader:
            seq, ca, y = seq.to(device), ca.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(seq, ca)
            m = y >= 0
            loss = F.smooth_l1_loss(pred.float()[m], y[m], beta=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)

        val_mae, val_r = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) train loss {(running[0] / running[1]).item():.4f} "
                  f"val per-residue MAE {val_mae:.4f} global Pearson {val_r:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            if val_r > best_r:
                best_r = val_r
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "pearson": val_r},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
