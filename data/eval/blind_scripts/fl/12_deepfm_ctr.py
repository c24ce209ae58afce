"""DeepFM on a click log (tsv: label, 13 numeric, 26 categorical) with DeepSpeed ZeRO-2 + CPU Adam.

The categorical vocabulary is counted once by rank 0 and shared through a json file.

    deepspeed --num_gpus 8 12_deepfm_ctr.py --train data/train.tsv --valid data/valid.tsv --work-dir runs/deepfm
"""
import argparse
import collections
import json
import os
import time

import deepspeed
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

NUM_COLS = [f"I{i}" for i in range(1, 14)]
CAT_COLS = [f"C{i}" for i in range(1, 27)]
AUC_BINS = 10000


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--work-dir", default="runs/deepfm")
    ap.add_argument("--min-count", type=int, default=10)
    ap.add_argument("--emb-dim", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--patience", type=int, default=1)
    ap.add_argument("--init-emb", default="", help="optional .pt with pretrained embedding table")
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


def read_tsv(path):
    return pd.read_csv(path, sep="\t", header=None, names=["label"] + NUM_COLS + CAT_COLS)


def build_vocab(df, min_count):
    vocab, offset = {}, 1  # 0 = OOV for all fields
    for c in CAT_COLS:
        counts = collections.Counter(df[c].dropna().astype(str))
        keep = sorted(k for k, v in counts.items() if v >= min_count)
        vocab[c] = {k: offset + i for i, k in enumerate(keep)}
        offset += len(keep)
    return vocab, offset


class ClickLog(Dataset):
    def __init__(self, df, vocab):
        self.y = df["label"].to_numpy(np.float32)
        num = df[NUM_COLS].fillna(0).clip(lower=0).to_numpy(np.float32)
        self.num = np.log1p(num)
        cats = np.zeros((len(df), len(CAT_COLS)), dtype=np.int64)
        for j, c in enumerate(CAT_COLS):
            cats[:, j] = df[c].astype(str).map(vocab[c]).fillna(0).to_numpy(np.int64)
        self.cat = cats

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.num[i], self.cat[i], self.y[i]


class DeepFM(nn.Module):
    def __init__(self, vocab_size, n_num, n_cat, dim, hidden=(400, 400, 400)):
        super().__init__()
        self.first_order = nn.Embedding(vocab_size, 1)
        self.emb = nn.Embedding(vocab_size, dim)
        self.num_proj = nn.Linear(n_num, dim)
        self.num_first = nn.Linear(n_num, 1)
        layers, d = [], (n_cat + 1) * dim
        for h in hidden:
            layers += [nn.Linear(d, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(0.1)]
            d = h
        layers.append(nn.Linear(d, 1))
        self.dnn = nn.Sequential(*layers)
        nn.init.normal_(self.emb.weight, std=1e-4)

    def forward(self, num, cat):
        e = torch.cat([self.emb(cat), self.num_proj(num).unsqueeze(1)], dim=1)  # B x F x D
        fm = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1)
        first = self.first_order(cat).sum((1, 2)) + self.num_first(num).squeeze(1)
        return first + fm + self.dnn(e.flatten(1)).squeeze(1)


@torch.no_grad()
def evaluate(engine, loader):
    """Global logloss and a histogram AUC; only fixed-size tensors are reduced."""
    engine.eval()
    pos = torch.zeros(AUC_BINS, device=engine.device, dtype=torch.float64)
    neg = torch.zeros_like(pos)
    ll = torch.zeros(2, device=engine.device, dtype=torch.float64)
    for num, cat, y in loader:
        num, cat, y = num.to(engine.device).half(), cat.to(engine.device), y.to(engine.device)
        p = torch.sigmoid(engine(num, cat).float()).clamp(1e-7, 1 - 1e-7)
        ll[0] -= (y * p.log() + (1 - y) * (1 - p).log()).sum().double()
        ll[1] += y.numel()
        b = (p * (AUC_BINS - 1)).long()
        pos += torch.bincount(b[y > 0.5], minlength=AUC_BINS).double()
        neg += torch.bincount(b[y <= 0.5], minlength=AUC_BINS).double()
    for t in (pos, neg, ll):
        dist.all_reduce(t)
    # P(score_pos > score_neg), ties counted half
    neg_below = torch.cumsum(neg, 0) - neg
    auc = ((pos * (neg_below + 0.5 * neg)).sum() / (pos.sum() * neg.sum())).item()
    engine.train()
    return auc, (ll[0] / ll[1]).item()


def main():
    args = get_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.work_dir, exist_ok=True)

    train_df = read_tsv(args.train)
    vocab_path = os.path.join(args.work_dir, "vocab.json")
    if rank == 0 and not os.path.exists(vocab_path):
        vocab, size = build_vocab(train_df, args.min_count)
        tmp = vocab_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"vocab": vocab, "size": size}, f)
        os.replace(tmp, vocab_path)
    dist.barrier()
    with open(vocab_path) as f:
        blob = json.load(f)
    vocab, vocab_size = blob["vocab"], blob["size"]

    train_set = ClickLog(train_df, vocab)
    valid_set = ClickLog(read_tsv(args.valid), vocab)
    del train_df
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=2024)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    # unpadded eval shards (ZeRO-2 forward has no collectives, uneven shard sizes are fine)
    valid_loader = DataLoader(Subset(valid_set, range(rank, len(valid_set), world)), batch_size=16384,
                              shuffle=False, num_workers=4)

    model = DeepFM(vocab_size, len(NUM_COLS), len(CAT_COLS), args.emb_dim)
    if args.init_emb:
        table = torch.load(args.init_emb, map_location="cpu")
        model.emb.weight.data[: table.size(0)].copy_(table)

    ds_config = {
        "train_batch_size": args.batch_size * world,
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": args.lr, "betas": [0.9, 0.999], "weight_decay": 0.0}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 14, "min_loss_scale": 1},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "contiguous_gradients": True,
            "overlap_comm": True,
        },
        "steps_per_print": 1000,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    loss_fn = nn.BCEWithLogitsLoss()

    start_epoch, best_auc, bad_epochs = 0, 0.0, 0
    load_path, client = engine.load_checkpoint(os.path.join(args.work_dir, "ckpt"))
    if load_path is not None:
        start_epoch, best_auc = client["epoch"] + 1, client["best_auc"]

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (num, cat, y) in enumerate(train_loader):
            num = num.to(engine.device, non_blocking=True).half()
            cat = cat.to(engine.device, non_blocking=True)
            y = y.to(engine.device, non_blocking=True)
            loss = loss_fn(engine(num, cat).float(), y)
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 500 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.5f} "
                      f"{(step + 1) * args.batch_size * world / (time.time() - t0):.0f} ex/s", flush=True)

        auc, logloss = evaluate(engine, valid_loader)
        if rank == 0:
            print(f"epoch {epoch}: valid AUC {auc:.5f} logloss {logloss:.5f}", flush=True)
        improved = auc > best_auc
        best_auc = max(best_auc, auc)
        bad_epochs = 0 if improved else bad_epochs + 1
        engine.save_checkpoint(os.path.join(args.work_dir, "ckpt"), tag=f"epoch{epoch}",
                               client_state={"epoch": epoch, "best_auc": best_auc})
        if improved and rank == 0:
            torch.save({"state_dict": {k: v.float().cpu() for k, v in engine.module.state_dict().items()},
                        "vocab_size": vocab_size, "emb_dim": args.emb_dim},
                       os.path.join(args.work_dir, "deepfm_best.pt"))
        if bad_epochs > args.patience:  # same auc on every rank, so all ranks stop together
            break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
