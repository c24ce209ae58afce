import argparse
import json
import logging
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

# Avazu fields after the usual preprocessing (hour split into hour-of-day / weekday)
FIELDS = ["C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id", "app_domain",
          "app_category", "device_id", "device_ip", "device_model", "device_type", "device_conn_type",
          "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21", "hour_of_day", "weekday"]


def get_parser():
    parser = argparse.ArgumentParser("DeepFM / Avazu")
    parser.add_argument("--data", default="/shared/avazu/encoded")  # train.parquet, valid.parquet, vocab.json
    parser.add_argument("--embed-dim", type=int, default=16)
    parser.add_argument("--hidden", type=int, nargs="+", default=[400, 400, 400])
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--l2", type=float, default=1e-6)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--patience", type=int, default=1)
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--output", default="/shared/avazu/runs/deepfm")
    return parser


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class AvazuDataset(Dataset):
    def __init__(self, path):
        df = pd.read_parquet(path, columns=FIELDS + ["click"])
        self.x = df[FIELDS].to_numpy(dtype=np.int64)
        self.y = df["click"].to_numpy(dtype=np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class DeepFM(nn.Module):
    def __init__(self, field_dims, embed_dim, hidden, dropout):
        super().__init__()
        self.register_buffer(
            "offsets", torch.tensor(np.concatenate([[0], np.cumsum(field_dims)[:-1]]), dtype=torch.long))
        total = int(sum(field_dims))
        self.linear = nn.Embedding(total, 1)
        self.bias = nn.Parameter(torch.zeros(1))
        self.embedding = nn.Embedding(total, embed_dim)
        nn.init.xavier_uniform_(self.embedding.weight)
        nn.init.zeros_(self.linear.weight)
        layers, d = [], len(field_dims) * embed_dim
        for h in hidden:
            layers += [nn.Linear(d, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(dropout)]
            d = h
        layers.append(nn.Linear(d, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x):
        x = x + self.offsets.unsqueeze(0)
        first = self.linear(x).sum(dim=1).squeeze(1) + self.bias
        e = self.embedding(x)
        fm = 0.5 * (e.sum(dim=1).pow(2) - e.pow(2).sum(dim=1)).sum(dim=1)
        deep = self.mlp(e.flatten(1)).squeeze(1)
        return first + fm + deep


def gather_eval(model, loader, device, n):
    model.eval()
    ps, ys = [], []
    with torch.no_grad():
        for x, y in loader:
            ps.append(torch.sigmoid(model(x.to(device, non_blocking=True))))
            ys.append(y.to(device, non_blocking=True))
    p, y = torch.cat(ps), torch.cat(ys)
    world = dist.get_world_size()
    pl, yl = [torch.empty_like(p) for _ in range(world)], [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(pl, p)
    dist.all_gather(yl, y)
    p = torch.stack(pl, 1).flatten()[:n]
    y = torch.stack(yl, 1).flatten()[:n]
    ll = nn.functional.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y).item()
    auc = roc_auc_score(y.cpu().numpy(), p.cpu().numpy())
    model.train()
    return auc, ll


def main():
    args = get_parser().parse_args()
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = dist.get_rank()
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed)

    logging.basicConfig(format="%(asctime)s - %(message)s",
                        level=logging.INFO if rank == 0 else logging.ERROR)
    log = logging.getLogger()

    with open(os.path.join(args.data, "vocab.json")) as f:
        vocab_sizes = json.load(f)
    field_dims = [vocab_sizes[c] + 1 for c in FIELDS]  # +1 for OOV bucket 0

    train_set = AvazuDataset(os.path.join(args.data, "train.parquet"))
    valid_set = AvazuDataset(os.path.join(args.data, "valid.parquet"))
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_set, batch_size=8192, num_workers=4, pin_memory=True,
                              sampler=DistributedSampler(valid_set, shuffle=False))

    model = DeepFM(field_dims, args.embed_dim, args.hidden, args.dropout)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.Adam([
        {"params": [p for n, p in model.named_parameters() if "embedding" in n or "linear" in n],
         "weight_decay": args.l2},
        {"params": [p for n, p in model.named_parameters() if "embedding" not in n and "linear" not in n],
         "weight_decay": 0.0},
    ], lr=args.lr)
    criterion = nn.BCEWithLogitsLoss()

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        log.info("train=%d valid=%d field_dims=%s", len(train_set), len(valid_set), field_dims)

    best_auc, bad_epochs = 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        running, t0 = 0.0, time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            running += loss.item()
            if (i + 1) % 1000 == 0:
                log.info("epoch %d iter %d loss %.5f %.1fs", epoch, i + 1, running / 1000, time.time() - t0)
                running = 0.0

        auc, ll = gather_eval(model, valid_loader, device, len(valid_set))
        log.info("epoch %d valid AUC %.5f logloss %.5f", epoch, auc, ll)
        if auc > best_auc:
            best_auc, bad_epochs = auc, 0
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(args.output, "best.pt"))
        else:
            bad_epochs += 1
        dist.barrier()
        if bad_epochs > args.patience:
            log.info("early stopping at epoch %d (best auc %.5f)", epoch, best_auc)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
