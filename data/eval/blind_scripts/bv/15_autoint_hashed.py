"""AutoInt+ (multi-head self-attention over field embeddings) on decoded TFRecord logs.

Categorical values are hashed per field with a seeded 64-bit hash; empty
values go to the padding row 0.

    torchrun --nproc_per_node=8 15_autoint_hashed.py --index-dir /data/ctr_tfr/decoded
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import xxhash
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

CAT_FIELDS = ["user_id", "item_id", "item_cat", "item_brand", "seller_id", "query_cat",
              "os", "app_ver", "province", "channel", "slot_id", "pos"]
NUM_FIELDS = ["price", "user_ctr_7d", "item_ctr_7d", "hour"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--index-dir", default="/data/ctr_tfr/decoded")
    ap.add_argument("--train-split", default="train")
    ap.add_argument("--valid-split", default="valid")
    ap.add_argument("--buckets", type=int, default=1_000_000, help="hash buckets per field")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--att-layers", type=int, default=3)
    ap.add_argument("--bs", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", default="/data/ctr_tfr/models/autoint")
    return ap.parse_args()


def hash_field(values, field, buckets):
    seed = xxhash.xxh32_intdigest(field)
    out = np.zeros(len(values), dtype=np.int64)
    for i, v in enumerate(values):
        if v is None or v == b"" or v == "":
            continue
        out[i] = xxhash.xxh64_intdigest(v, seed=seed) % buckets + 1
    return out


class HashedSplit(Dataset):
    """Decoded split on disk: <split>_raw.npz with one string column per field."""

    def __init__(self, root, split, buckets):
        raw = np.load(os.path.join(root, f"{split}_raw.npz"), allow_pickle=True)
        self.cat = np.stack([hash_field(raw[f], f, buckets) for f in CAT_FIELDS], axis=1)
        num = np.stack([raw[f].astype(np.float32) for f in NUM_FIELDS], axis=1)
        self.num = np.log1p(np.clip(np.nan_to_num(num), 0, None))
        self.y = raw["label"].astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.cat[i], self.num[i], self.y[i]


class AutoInt(nn.Module):
    def __init__(self, buckets, dim, heads, layers):
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(buckets, dim, padding_idx=0) for _ in CAT_FIELDS)
        self.num_emb = nn.Parameter(torch.randn(len(NUM_FIELDS), dim) * 0.01)
        self.att = nn.ModuleList(nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers))
        self.res = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))
        n_f = len(CAT_FIELDS) + len(NUM_FIELDS)
        self.att_out = nn.Linear(n_f * dim, 1)
        self.dnn = nn.Sequential(nn.Linear(n_f * dim, 400), nn.ReLU(), nn.Linear(400, 400), nn.ReLU(),
                                 nn.Linear(400, 1))

    def forward(self, cat, num):
        e_cat = torch.stack([emb(cat[:, j]) for j, emb in enumerate(self.emb)], dim=1)
        e_num = num.unsqueeze(-1) * self.num_emb.unsqueeze(0)
        x = torch.cat([e_cat, e_num], dim=1)
        flat = x.flatten(1)
        h = x
        for att, res in zip(self.att, self.res):
            a, _ = att(h, h, h, need_weights=False)
            h = F.relu(a + res(h))
        return (self.att_out(h.flatten(1)) + self.dnn(flat)).squeeze(-1)


@torch.no_grad()
def evaluate(model, loader, device, n):
    model.eval()
    p_all, y_all = [], []
    for cat, num, y in loader:
        p_all.append(torch.sigmoid(model(cat.to(device), num.to(device))))
        y_all.append(y.to(device))
    p, y = torch.cat(p_all), torch.cat(y_all)
    ws = dist.get_world_size()
    gp, gy = [torch.empty_like(p) for _ in range(ws)], [torch.empty_like(y) for _ in range(ws)]
    dist.all_gather(gp, p)
    dist.all_gather(gy, y)
    model.train()
    p = torch.stack(gp, 1).flatten()[:n].cpu().numpy()
    y = torch.stack(gy, 1).flatten()[:n].cpu().numpy()
    return roc_auc_score(y, p)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    train = HashedSplit(args.index_dir, args.train_split, args.buckets)
    valid = HashedSplit(args.index_dir, args.valid_split, args.buckets)
    sampler = DistributedSampler(train, shuffle=True, seed=5)
    train_dl = DataLoader(train, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True,
                          drop_last=True)
    valid_dl = DataLoader(valid, batch_size=8192, sampler=DistributedSampler(valid, shuffle=False),
                          num_workers=4, pin_memory=True)

    model = AutoInt(args.buckets, args.dim, args.heads, args.att_layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (cat, num, y) in enumerate(train_dl):
            cat, num, y = cat.to(device, non_blocking=True), num.to(device, non_blocking=True), y.to(device)
            loss = F.binary_cross_entropy_with_logits(model(cat, num), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.5f} {time.time() - t0:.0f}s", flush=True)
        auc = evaluate(model, valid_dl, device, len(valid))
        if rank == 0:
            print(f"epoch {epoch} valid auc {auc:.5f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "auc": auc,
                        "buckets": args.buckets, "fields": CAT_FIELDS},
                       os.path.join(args.out, f"autoint_e{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
