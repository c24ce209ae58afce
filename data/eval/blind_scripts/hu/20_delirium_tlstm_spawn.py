"""ICU delirium (positive CAM-ICU in the next 24h) with a Time-aware LSTM.

Nursing assessments, sedation scores (RASS), meds and labs arrive at irregular times;
T-LSTM discounts the short-term memory by the elapsed time between observations.

Usage (single node, all GPUs):
    python 20_delirium_tlstm_spawn.py --data /data/delirium/sequences.pt --gpus 4
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def get_config():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--port", type=int, default=29512)
    p.add_argument("--out", default="runs/delirium_tlstm")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--max_steps_seq", type=int, default=200)
    return p.parse_args()


class Sequences(Dataset):
    """Each item: features [T, F], elapsed hours since previous obs [T], label."""

    def __init__(self, items, max_len):
        self.items, self.max_len = items, max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        return it["x"][-self.max_len:], it["dt"][-self.max_len:], float(it["y"]), i


def collate(batch):
    T = max(b[0].shape[0] for b in batch)
    Fdim = batch[0][0].shape[1]
    x = torch.zeros(len(batch), T, Fdim)
    dt = torch.zeros(len(batch), T)
    lengths = torch.zeros(len(batch), dtype=torch.long)
    for j, (xi, di, _, _) in enumerate(batch):
        x[j, : len(xi)] = xi
        dt[j, : len(di)] = di
        lengths[j] = len(xi)
    return x, dt, lengths, torch.tensor([b[2] for b in batch]), torch.tensor([b[3] for b in batch])


class TLSTMCell(nn.Module):
    def __init__(self, d_in, hidden):
        super().__init__()
        self.gates = nn.Linear(d_in + hidden, 4 * hidden)
        self.decomp = nn.Linear(hidden, hidden)

    def forward(self, x, dt, h, c):
        # subspace decomposition: short-term memory is discounted by g(dt) = 1 / log(e + dt)
        c_short = torch.tanh(self.decomp(c))
        c_adj = (c - c_short) + c_short * (1.0 / torch.log(math.e + dt)).unsqueeze(-1)
        i, f, o, g = self.gates(torch.cat([x, h], dim=-1)).chunk(4, dim=-1)
        c_new = torch.sigmoid(f) * c_adj + torch.sigmoid(i) * torch.tanh(g)
        h_new = torch.sigmoid(o) * torch.tanh(c_new)
        return h_new, c_new


class TLSTM(nn.Module):
    def __init__(self, d_in, hidden):
        super().__init__()
        self.cell = TLSTMCell(d_in, hidden)
        self.out = nn.Sequential(nn.Dropout(0.2), nn.Linear(hidden, 1))
        self.hidden = hidden

    def forward(self, x, dt, lengths):
        B, T, _ = x.shape
        h = x.new_zeros(B, self.hidden)
        c = x.new_zeros(B, self.hidden)
        last = x.new_zeros(B, self.hidden)
        for t in range(T):
            h, c = self.cell(x[:, t], dt[:, t], h, c)
            last = torch.where((lengths - 1 == t).unsqueeze(-1), h, last)
        return self.out(last).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, n, device):
    model.eval()
    p = torch.zeros(n, device=device)
    y = torch.zeros(n, device=device)
    for x, dt, lengths, yb, idx in loader:
        idx = idx.to(device)
        p[idx] = torch.sigmoid(model(x.to(device), dt.to(device), lengths.to(device)))
        y[idx] = yb.to(device)
    # padded duplicates hold identical values, so MAX merges the shards exactly
    dist.all_reduce(p, op=dist.ReduceOp.MAX)
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    return roc_auc_score(y.cpu().numpy(), p.cpu().numpy())


def run(local_rank, cfg, world_size):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", str(cfg.port))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=local_rank, world_size=world_size)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    blob = torch.load(cfg.data, map_location="cpu")
    train_ds = Sequences(blob["train"], cfg.max_steps_seq)
    val_ds = Sequences(blob["val"], cfg.max_steps_seq)
    d_in = blob["train"][0]["x"].shape[1]

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=local_rank, shuffle=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=local_rank, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=3, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=256, sampler=val_sampler, collate_fn=collate, num_workers=2)

    model = DDP(TLSTM(d_in, cfg.hidden).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    prev = sum(it["y"] for it in blob["train"]) / len(blob["train"])
    pos_weight = torch.tensor((1 - prev) / prev, device=device)

    best = 0.0
    if local_rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for x, dt, lengths, y, _ in train_dl:
            x, dt, lengths, y = x.to(device), dt.to(device), lengths.to(device), y.to(device)
            loss = F.binary_cross_entropy_with_logits(model(x, dt, lengths), y, pos_weight=pos_weight)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        auc = evaluate(model.module, val_dl, len(val_ds), device)
        if local_rank == 0:
            print(f"epoch {epoch:02d} loss {(tot[0] / tot[1]).item():.4f} val AUROC {auc:.4f}", flush=True)
            if auc > best:
                best = auc
                torch.save(model.module.state_dict(), os.path.join(cfg.out, "tlstm_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    cfg = get_config()
    world_size = cfg.gpus
    mp.spawn(run, args=(world_size, cfg), nprocs=world_size, join=True)
