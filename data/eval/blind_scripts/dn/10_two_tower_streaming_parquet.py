"""Streaming two-tower training over a large click-log table.

The click log is too large to hold in host memory (several billion rows), so
each rank streams its own subset of parquet files, split further across the
DataLoader workers, and reads them row group by row group.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        10_two_tower_streaming_parquet.py --log_dir /mnt/datalake/clicklog/2024q2 --epochs 1
"""
import argparse
import glob
import logging
import math
import os
import random
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

logger = logging.getLogger(__name__)
COLUMNS = ["user_id", "user_city", "user_age", "item_id", "item_seller", "item_price"]


class ClickLogStream(IterableDataset):
    def __init__(self, files, rank, world, batch_size, seed=0):
        self.files = files
        self.rank, self.world = rank, world
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _my_files(self):
        files = list(self.files)
        random.Random(self.seed + self.epoch).shuffle(files)  # same order on every rank
        files = files[self.rank::self.world]
        wi = get_worker_info()
        if wi is not None:
            files = files[wi.id::wi.num_workers]
        return files

    def __iter__(self):
        buf = None
        for path in self._my_files():
            pf = pq.ParquetFile(path)
            for rg in range(pf.num_row_groups):
                t = pf.read_row_group(rg, columns=COLUMNS)
                arr = np.stack([t.column(c).to_numpy().astype(np.float64) for c in COLUMNS], 1)
                buf = arr if buf is None else np.concatenate([buf, arr])
                while len(buf) >= self.batch_size:
                    chunk, buf = buf[: self.batch_size], buf[self.batch_size:]
                    yield {
                        "user_id": torch.from_numpy(chunk[:, 0].astype(np.int64)),
                        "user_city": torch.from_numpy(chunk[:, 1].astype(np.int64)),
                        "user_age": torch.from_numpy(chunk[:, 2].astype(np.float32)),
                        "item_id": torch.from_numpy(chunk[:, 3].astype(np.int64)),
                        "item_seller": torch.from_numpy(chunk[:, 4].astype(np.int64)),
                        "item_price": torch.from_numpy(np.log1p(chunk[:, 5]).astype(np.float32)),
                    }


class QueryTower(nn.Module):
    def __init__(self, n_users, n_cities, dim):
        super().__init__()
        self.user = nn.Embedding(n_users, dim)
        self.city = nn.Embedding(n_cities, 16)
        self.mlp = nn.Sequential(nn.Linear(dim + 16 + 1, 256), nn.ReLU(), nn.Linear(256, dim))

    def forward(self, b):
        x = torch.cat([self.user(b["user_id"]), self.city(b["user_city"]), b["user_age"].unsqueeze(1) / 100], 1)
        return F.normalize(self.mlp(x), dim=1)


class ItemTower(nn.Module):
    def __init__(self, n_items, n_sellers, dim):
        super().__init__()
        self.item = nn.Embedding(n_items, dim)
        self.seller = nn.Embedding(n_sellers, 32)
        self.mlp = nn.Sequential(nn.Linear(dim + 32 + 1, 256), nn.ReLU(), nn.Linear(256, dim))

    def forward(self, b):
        x = torch.cat([self.item(b["item_id"]), self.seller(b["item_seller"]), b["item_price"].unsqueeze(1)], 1)
        return F.normalize(self.mlp(x), dim=1)


class TwoTower(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.q = QueryTower(args.n_users, args.n_cities, args.dim)
        self.i = ItemTower(args.n_items, args.n_sellers, args.dim)

    def forward(self, b):
        return self.q(b), self.i(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--log_dir", required=True)
    ap.add_argument("--ckpt_dir", default="/shared/ckpt/tt_stream")
    ap.add_argument("--n_users", type=int, default=20_000_000)
    ap.add_argument("--n_cities", type=int, default=4000)
    ap.add_argument("--n_items", type=int, default=5_000_000)
    ap.add_argument("--n_sellers", type=int, default=300_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--tau", type=float, default=0.05)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--ckpt_every", type=int, default=20_000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    files = sorted(glob.glob(os.path.join(args.log_dir, "**", "*.parquet"), recursive=True))
    if rank == 0:
        logger.info("%d parquet files, %d ranks", len(files), world)
        os.makedirs(args.ckpt_dir, exist_ok=True)
    ds = ClickLogStream(files, rank, world, args.batch_size)
    loader = DataLoader(ds, batch_size=None, num_workers=args.workers, pin_memory=True, prefetch_factor=4)

    torch.manual_seed(0)
    model = DDP(TwoTower(args).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    step = 0
    for epoch in range(args.epochs):
        ds.set_epoch(epoch)
        t0 = time.time()
        run_loss = torch.zeros((), device=device)
        for b in loader:
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            q, c = model(b)
            logits = q @ c.t() / args.tau
            same_item = b["item_id"].unsqueeze(0) == b["item_id"].unsqueeze(1)
            logits = logits.masked_fill(same_item & ~torch.eye(len(q), dtype=torch.bool, device=device), -1e4)
            loss = F.cross_entropy(logits, torch.arange(len(q), device=device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            run_loss += loss.detach()

            if step % 500 == 0:
                dist.all_reduce(run_loss, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d loss %.4f %.0f qps", epoch, step, run_loss.item() / 500,
                            500 * args.batch_size * world / (time.time() - t0))
                run_loss.zero_()
                t0 = time.time()
            if step % args.ckpt_every == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                           os.path.join(args.ckpt_dir, f"step{step}.pt"))

        logger.info("epoch %d done after %d steps", epoch, step)
        dist.barrier()
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                       os.path.join(args.ckpt_dir, f"epoch{epoch}.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
