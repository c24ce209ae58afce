"""Cross-sell propensity (credit card -> personal loan) on the full customer-month history.

The history is ~300M rows in parquet part files; it does not fit in host memory on one
process, so each rank loads only its own part files. Launch:

    torchrun --nproc_per_node=8 13_propensity_parquet_shards.py --parts "/lake/propensity/train/part-*.parquet" \
        --valid /lake/propensity/valid.parquet
"""
import argparse
import glob
import itertools
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

CAT_COLS = ["branch_id", "segment", "occupation", "education", "marital_status", "region", "card_product", "channel_pref"]
NUM_COLS = ["age", "income_est", "balance_avg_3m", "card_spend_3m", "card_util", "tenure_m",
            "n_products", "digital_logins_30d", "salary_inflow_flag", "overdraft_days_6m"]
TARGET = "loan_opened_90d"


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--parts", default="/lake/propensity/train/part-*.parquet")
    p.add_argument("--valid", default="/lake/propensity/valid.parquet")
    p.add_argument("--emb-dim", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--out", default="/lake/models/propensity_tabtf")
    return p


class TabModel(nn.Module):
    def __init__(self, cardinalities, n_num, emb_dim):
        super().__init__()
        self.emb = nn.ModuleList([nn.Embedding(n + 1, emb_dim) for n in cardinalities])
        self.attn = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(emb_dim, 4, 4 * emb_dim, 0.1, batch_first=True), num_layers=2)
        d = emb_dim * len(cardinalities) + n_num
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 256), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, xc, xn):
        t = self.attn(torch.stack([e(xc[:, i]) for i, e in enumerate(self.emb)], 1))
        return self.mlp(torch.cat([t.flatten(1), xn], 1)).squeeze(1)


def to_dataset(df, vocab, stats):
    xc = np.stack([df[c].astype(str).map(vocab[c]).fillna(0).astype(np.int64).values for c in CAT_COLS], 1)
    xn = ((df[NUM_COLS].astype(np.float32) - stats["mean"]) / stats["std"]).fillna(0).values.astype(np.float32)
    return TensorDataset(torch.from_numpy(xc), torch.from_numpy(xn), torch.tensor(df[TARGET].values, dtype=torch.float32))


def main():
    args = args_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    parts = sorted(glob.glob(args.parts))
    my_parts = parts[rank::world]
    local = pd.concat([pd.read_parquet(p, columns=CAT_COLS + NUM_COLS + [TARGET]) for p in my_parts],
                      ignore_index=True)
    vocab = {c: {v: i + 1 for i, v in enumerate(sorted(local[c].astype(str).unique()))} for c in CAT_COLS}

    # numeric scaling from global moments
    moments = torch.tensor(np.concatenate([local[NUM_COLS].sum().values, (local[NUM_COLS] ** 2).sum().values,
                                           [len(local)]]), dtype=torch.float64, device=device)
    dist.all_reduce(moments)
    k = len(NUM_COLS)
    n = moments[-1]
    mean = (moments[:k] / n).cpu().numpy()
    std = np.sqrt(np.maximum((moments[k:2 * k] / n).cpu().numpy() - mean ** 2, 1e-12))
    stats = {"mean": mean, "std": std}

    train_ds = to_dataset(local, vocab, stats)
    del local
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4,
                        pin_memory=True, drop_last=True)
    # part files differ in size: every rank runs the same number of steps per epoch
    steps = torch.tensor(len(loader), device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    steps_per_epoch = int(steps.item())

    valid_df = pd.read_parquet(args.valid, columns=CAT_COLS + NUM_COLS + [TARGET])
    valid_ds = to_dataset(valid_df, vocab, stats)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False)
    valid_loader = DataLoader(valid_ds, batch_size=8192, sampler=valid_sampler)
    valid_idx = np.array(list(iter(valid_sampler)))

    model = TabModel([len(vocab[c]) for c in CAT_COLS], len(NUM_COLS), args.emb_dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(parts)} part files, {steps_per_epoch} steps/epoch/rank, valid {len(valid_ds):,}", flush=True)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        loss_sum = torch.zeros(1, device=device)
        for xc, xn, y in itertools.islice(loader, steps_per_epoch):
            xc, xn, y = xc.to(device, non_blocking=True), xn.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(xc, xn), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)

        model.eval()
        with torch.no_grad():
            local_pred = torch.cat([torch.sigmoid(model(xc.to(device), xn.to(device))) for xc, xn, _ in valid_loader])
        preds = [torch.empty_like(local_pred) for _ in range(world)]
        dist.all_gather(preds, local_pred)
        idxs = [None] * world
        dist.all_gather_object(idxs, valid_idx)
        if rank == 0:
            p = np.zeros(len(valid_ds), dtype=np.float32)
            p[np.concatenate(idxs)] = torch.cat(preds).cpu().numpy()
            auc = roc_auc_score(valid_ds.tensors[2].numpy(), p)
            print(f"epoch {epoch} train_loss {(loss_sum / (world * steps_per_epoch)).item():.4f} valid_auc {auc:.4f}",
                  flush=True)
            if auc > best:
                best = auc
                torch.save({"model": model.module.state_dict(), "vocab": vocab, "stats": stats},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
