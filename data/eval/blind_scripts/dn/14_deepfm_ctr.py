"""DeepFM CTR model on the feed impression log.

The training month is ~2.5B rows, so each rank only loads its own share of the
parquet part files into memory. Ids in the log are dense-encoded by the
feature pipeline (0..n-1 per field).

    torchrun --nproc_per_node=8 14_deepfm_ctr.py --train_glob "/data/feed/impr/month=2024-04/part-*.parquet" \
        --val_file /data/feed/impr/val_2024-05-01.parquet --out /data/feed/models/deepfm
"""
import argparse
import glob
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import log_loss, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

FIELDS = ["user_id", "item_id", "author_id", "item_type", "user_gender", "user_age_bucket",
          "network", "os", "province", "hour", "refresh_index"]
LABEL = "click"
logger = logging.getLogger("deepfm")


class FeaturesLinear(nn.Module):
    def __init__(self, field_dims):
        super().__init__()
        self.fc = nn.Embedding(sum(field_dims), 1)
        self.bias = nn.Parameter(torch.zeros(1))
        self.register_buffer("offsets", torch.tensor(np.concatenate([[0], np.cumsum(field_dims)[:-1]]),
                                                     dtype=torch.long), persistent=False)

    def forward(self, x):
        return self.fc(x + self.offsets).sum(1) + self.bias


class FactorizationMachine(nn.Module):
    def forward(self, e):  # B x F x D
        square_of_sum = e.sum(1).pow(2)
        sum_of_square = e.pow(2).sum(1)
        return 0.5 * (square_of_sum - sum_of_square).sum(1, keepdim=True)


class DeepFM(nn.Module):
    def __init__(self, field_dims, dim=16, mlp=(400, 400, 400), dropout=0.2):
        super().__init__()
        self.linear = FeaturesLinear(field_dims)
        self.embedding = nn.Embedding(sum(field_dims), dim)
        nn.init.xavier_uniform_(self.embedding.weight)
        self.register_buffer("offsets", torch.tensor(np.concatenate([[0], np.cumsum(field_dims)[:-1]]),
                                                     dtype=torch.long), persistent=False)
        self.fm = FactorizationMachine()
        layers, d = [], len(field_dims) * dim
        for h in mlp:
            layers += [nn.Linear(d, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(dropout)]
            d = h
        layers.append(nn.Linear(d, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x):
        e = self.embedding(x + self.offsets)
        out = self.linear(x) + self.fm(e) + self.mlp(e.flatten(1))
        return out.squeeze(1)


def load_frame(paths):
    return pd.concat([pd.read_parquet(p, columns=FIELDS + [LABEL]) for p in paths], ignore_index=True)


@torch.no_grad()
def evaluate(net, x, y, device, rank, world, bs=32768):
    net.eval()
    x, y = x[rank::world], y[rank::world]
    preds = torch.cat([torch.sigmoid(net(x[i:i + bs].to(device))).cpu() for i in range(0, len(x), bs)])
    net.train()
    out = [None] * world
    dist.all_gather_object(out, (preds.numpy(), y.numpy()))
    p = np.concatenate([o[0] for o in out])
    t = np.concatenate([o[1] for o in out])
    return roc_auc_score(t, p), log_loss(t, p, labels=[0, 1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_glob", required=True)
    ap.add_argument("--val_file", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch_size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--l2", type=float, default=1e-6)
    ap.add_argument("--epochs", type=int, default=1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s rank{rank} %(message)s")

    parts = sorted(glob.glob(args.train_glob))
    my_parts = parts[rank::world]
    train_df = load_frame(my_parts)
    field_dims = [int(train_df[c].max()) + 1 for c in FIELDS]
    logger.info("%d part files (%d on this rank), %d rows, field dims %s",
                len(parts), len(my_parts), len(train_df), field_dims)

    x_train = torch.from_numpy(train_df[FIELDS].to_numpy(np.int64))
    y_train = torch.from_numpy(train_df[LABEL].to_numpy(np.float32))
    del train_df
    val_df = load_frame([args.val_file])
    x_val = torch.from_numpy(val_df[FIELDS].to_numpy(np.int64))
    y_val = torch.from_numpy(val_df[LABEL].to_numpy(np.float32))

    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size, shuffle=True,
                        num_workers=4, pin_memory=True, drop_last=True)
    # shards hold different numbers of rows: every rank runs the same number of steps
    n = torch.tensor(len(loader), device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    steps_per_epoch = int(n)

    torch.manual_seed(0)
    model = DeepFM(field_dims, dim=args.dim).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.l2)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        t0 = time.time()
        it = iter(loader)
        for step in range(steps_per_epoch):
            xb, yb = next(it)
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if (step + 1) % 500 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d/%d loss %.5f %.1f it/s", epoch, step + 1, steps_per_epoch,
                            l.item(), 500 / (time.time() - t0))
                t0 = time.time()
        del it

        auc, ll = evaluate(model.module, x_val, y_val, device, rank, world)
        logger.info("epoch %d val auc %.5f logloss %.5f", epoch, auc, ll)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "field_dims": field_dims, "epoch": epoch},
                       os.path.join(args.out, f"deepfm_e{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
