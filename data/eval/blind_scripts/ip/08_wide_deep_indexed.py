#!/usr/bin/env python3
"""Wide & Deep on StringIndexer-encoded features.

The Spark job (jobs/encode_features.py) writes the training window as equal-sized
parquet parts `part-00000.parquet ... part-00255.parquet`; categorical columns are
dense integer codes 0..V-1 ordered by frequency, numeric columns are already normalised.
Each rank reads its own subset of parts.
"""
import argparse
import glob
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

CAT_COLS = ["user_bucket", "item_id", "shop_id", "brand_id", "category_l1", "category_l2",
            "category_l3", "city", "device_model", "os_version", "hour", "weekday",
            "query_cluster", "ad_campaign", "ad_group", "creative_id"]
NUM_COLS = ["item_price", "item_ctr_7d", "item_cvr_7d", "shop_score", "user_ctr_30d",
            "user_active_days", "query_len", "position"]


def read_parts(paths):
    cats, nums, labels = [], [], []
    for p in paths:
        t = pq.read_table(p, columns=CAT_COLS + NUM_COLS + ["is_click"])
        cats.append(np.stack([t[c].to_numpy() for c in CAT_COLS], 1).astype(np.int64))
        nums.append(np.stack([t[c].to_numpy() for c in NUM_COLS], 1).astype(np.float32))
        labels.append(t["is_click"].to_numpy().astype(np.float32))
    return np.concatenate(cats), np.concatenate(nums), np.concatenate(labels)


class WideAndDeep(nn.Module):
    def __init__(self, vocab_sizes, emb_dim, hidden, n_num):
        super().__init__()
        self.embeddings = nn.ModuleList([nn.Embedding(v, emb_dim) for v in vocab_sizes])
        self.wide = nn.ModuleList([nn.Embedding(v, 1) for v in vocab_sizes])
        self.wide_bias = nn.Parameter(torch.zeros(1))
        layers, d = [], len(vocab_sizes) * emb_dim + n_num
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        layers.append(nn.Linear(d, 1))
        self.deep = nn.Sequential(*layers)

    def forward(self, cats, nums):
        emb = torch.cat([e(cats[:, i]) for i, e in enumerate(self.embeddings)], 1)
        deep = self.deep(torch.cat([emb, nums], 1)).squeeze(1)
        wide = sum(w(cats[:, i]).squeeze(1) for i, w in enumerate(self.wide)) + self.wide_bias
        return deep + wide


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_dir", default="/data/search_ads/encoded/train")
    ap.add_argument("--valid_dir", default="/data/search_ads/encoded/valid")
    ap.add_argument("--emb_dim", type=int, default=24)
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024, 512, 256])
    ap.add_argument("--batch_size", type=int, default=4096)
    ap.add_argument("--lr_deep", type=float, default=1e-3)
    ap.add_argument("--lr_wide", type=float, default=5e-2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", default="/data/search_ads/models/wide_deep")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    parts = sorted(glob.glob(os.path.join(args.train_dir, "part-*.parquet")))
    my_parts = parts[rank::world]
    cats, nums, labels = read_parts(my_parts)
    vocab_sizes = [int(cats[:, i].max()) + 1 for i in range(len(CAT_COLS))]
    if rank == 0:
        print(f"{len(parts)} parts, {world} ranks, vocab sizes {vocab_sizes}", flush=True)

    train_ds = TensorDataset(torch.from_numpy(cats), torch.from_numpy(nums), torch.from_numpy(labels))
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=RandomSampler(train_ds),
                        drop_last=True, num_workers=2, pin_memory=True)
    # part sizes are equal up to rounding; run the same number of steps everywhere
    n_steps = torch.tensor([len(loader)], device=device)
    dist.all_reduce(n_steps, op=dist.ReduceOp.MIN)
    steps_per_epoch = int(n_steps.item())

    v_cats, v_nums, v_labels = read_parts(sorted(glob.glob(os.path.join(args.valid_dir, "*.parquet"))))
    v_sel = slice(rank, None, world)
    v_cats = np.minimum(v_cats[v_sel], np.asarray(vocab_sizes) - 1)
    valid_ds = TensorDataset(torch.from_numpy(v_cats), torch.from_numpy(v_nums[v_sel]),
                             torch.from_numpy(v_labels[v_sel]))
    valid_loader = DataLoader(valid_ds, batch_size=16384)

    torch.manual_seed(0)
    model = WideAndDeep(vocab_sizes, args.emb_dim, args.hidden, len(NUM_COLS)).to(device)
    model = DDP(model, device_ids=[local_rank])
    wide_params = list(model.module.wide.parameters()) + [model.module.wide_bias]
    wide_ids = {id(p) for p in wide_params}
    deep_params = [p for p in model.parameters() if id(p) not in wide_ids]
    opt_deep = torch.optim.Adam(deep_params, lr=args.lr_deep)
    opt_wide = torch.optim.Adagrad(wide_params, lr=args.lr_wide)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        it = iter(loader)
        for step in range(steps_per_epoch):
            c, n, y = (t.to(device, non_blocking=True) for t in next(it))
            loss = F.binary_cross_entropy_with_logits(model(c, n), y)
            opt_deep.zero_grad(set_to_none=True)
            opt_wide.zero_grad(set_to_none=True)
            loss.backward()
            opt_deep.step()
            opt_wide.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{steps_per_epoch} loss {loss.item():.4f} "
                      f"{(step + 1) / (time.time() - t0):.1f} it/s", flush=True)

        model.eval()
        scores, ys = [], []
        with torch.no_grad():
            for c, n, y in valid_loader:
                scores.append(torch.sigmoid(model.module(c.to(device), n.to(device))))
                ys.append(y.to(device))
        s, y = torch.cat(scores), torch.cat(ys)
        sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(s)], device=device))
        max_n = int(max(x.item() for x in sizes))
        pad_s = torch.full((max_n,), -1.0, device=device)
        pad_s[:len(s)] = s
        pad_y = torch.zeros(max_n, device=device)
        pad_y[:len(y)] = y
        all_s = [torch.empty_like(pad_s) for _ in range(world)]
        all_y = [torch.empty_like(pad_y) for _ in range(world)]
        dist.all_gather(all_s, pad_s)
        dist.all_gather(all_y, pad_y)
        if rank == 0:
            from sklearn.metrics import log_loss, roc_auc_score
            s_all = torch.cat(all_s).cpu().numpy()
            y_all = torch.cat(all_y).cpu().numpy()
            keep = s_all >= 0
            auc = roc_auc_score(y_all[keep], s_all[keep])
            ll = log_loss(y_all[keep], s_all[keep].astype(np.float64))
            print(f"epoch {epoch} valid auc {auc:.5f} logloss {ll:.5f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "vocab_sizes": vocab_sizes,
                        "epoch": epoch, "auc": auc}, os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
