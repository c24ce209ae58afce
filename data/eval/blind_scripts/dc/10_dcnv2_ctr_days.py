"""DCN-V2 on the sampled ad-click table (Criteo-style, ~3M rows per day: 13 dense + 26 categorical),
AUC on the full val day.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=${HEAD_NODE}:29400 \
    10_dcnv2_ctr_days.py --data /shared/ctr/days --out /shared/runs/dcnv2
"""
import argparse
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import log_loss, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = [f"C{i}" for i in range(1, 27)]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="folder with day_XX.parquet and vocab.npz")
    p.add_argument("--train-days", type=int, nargs="+", default=list(range(0, 6)))
    p.add_argument("--val-day", type=int, default=6)
    p.add_argument("--emb-dim", type=int, default=16)
    p.add_argument("--cross-layers", type=int, default=3)
    p.add_argument("--deep", type=int, nargs="+", default=[1024, 1024, 512])
    p.add_argument("--global-batch", type=int, default=65536)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class CrossLayerV2(nn.Module):
    def __init__(self, d, rank=64):
        super().__init__()
        self.U = nn.Linear(d, rank, bias=False)
        self.V = nn.Linear(rank, d)

    def forward(self, x0, x):
        return x0 * self.V(self.U(x)) + x


class DCNv2(nn.Module):
    def __init__(self, vocab_sizes, n_dense, emb_dim, n_cross, deep):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(v, emb_dim) for v in vocab_sizes)
        d = n_dense + emb_dim * len(vocab_sizes)
        self.cross = nn.ModuleList(CrossLayerV2(d) for _ in range(n_cross))
        layers, h = [], d
        for w in deep:
            layers += [nn.Linear(h, w), nn.ReLU()]
            h = w
        self.deep = nn.Sequential(*layers)
        self.out = nn.Linear(h + d, 1)

    def forward(self, dense, sparse):
        x0 = torch.cat([dense] + [e(sparse[:, i]) for i, e in enumerate(self.embs)], 1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.out(torch.cat([x, self.deep(x0)], 1)).squeeze(-1)


def read_days(folder, days, vocab):
    dense, sparse, y = [], [], []
    for d in days:
        t = pq.read_table(os.path.join(folder, f"day_{d:02d}.parquet")).to_pandas()
        dense.append(np.log1p(t[DENSE].fillna(0).clip(lower=0).values).astype(np.float32))
        cols = []
        for c in SPARSE:
            keys = vocab[c]
            pos = np.searchsorted(keys, t[c].fillna("").values)
            pos = np.clip(pos, 0, len(keys) - 1)
            hit = keys[pos] == t[c].fillna("").values
            cols.append(np.where(hit, pos + 1, 0))
        sparse.append(np.stack(cols, 1).astype(np.int64))
        y.append(t["label"].values.astype(np.float32))
    return TensorDataset(torch.from_numpy(np.concatenate(dense)), torch.from_numpy(np.concatenate(sparse)),
                         torch.from_numpy(np.concatenate(y)))


@torch.no_grad()
def evaluate(model, val_ds, rank, world, device):
    model.eval()
    dense, sparse, y = val_ds.tensors
    shard = np.array_split(np.arange(len(y)), world)[rank]
    preds = []
    for i in range(0, len(shard), 131072):
        j = torch.from_numpy(shard[i:i + 131072])
        preds.append(torch.sigmoid(model(dense[j].to(device), sparse[j].to(device))))
    preds = torch.cat(preds)
    gathered = [torch.zeros_like(preds) for _ in range(world)]
    dist.all_gather(gathered, preds)
    p = torch.cat(gathered).double().cpu().numpy()
    model.train()
    return roc_auc_score(y.numpy(), p), log_loss(y.numpy(), p)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    # vocab.npz was built offline from the training days (sorted unique values with count >= 10)
    vz = np.load(os.path.join(args.data, "vocab.npz"), allow_pickle=True)
    vocab = {c: vz[c] for c in SPARSE}
    train_ds = read_days(args.data, args.train_days, vocab)
    val_ds = read_days(args.data, [args.val_day], vocab)

    model = DCNv2([len(vocab[c]) + 1 for c in SPARSE], len(DENSE), args.emb_dim, args.cross_layers, args.deep).to(device)
    model = DDP(model, device_ids=[local_rank])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.global_batch // world, sampler=sampler,
                        num_workers=6, pin_memory=True, drop_last=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} train={len(train_ds)} val={len(val_ds)} steps/epoch={len(loader)}", flush=True)

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for dense, sparse, y in loader:
            dense, sparse, y = dense.to(device, non_blocking=True), sparse.to(device, non_blocking=True), y.to(device)
            loss = F.binary_cross_entropy_with_logits(model(dense, sparse), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % args.eval_every == 0 or step == len(loader) * args.epochs:
                auc, ll = evaluate(model.module, val_ds, rank, world, device)
                if rank == 0:
                    print(f"step {step} loss {loss.item():.4f} val_auc {auc:.5f} val_logloss {ll:.5f} "
                          f"{(time.time() - t0) / 60:.1f}min", flush=True)
                    if auc > best:
                        best = auc
                        torch.save({"model": model.module.state_dict(), "step": step, "auc": auc},
                                   os.path.join(args.out, "best.pt"))
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
