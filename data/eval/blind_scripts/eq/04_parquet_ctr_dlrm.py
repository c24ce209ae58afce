"""
CTR model (DLRM-style) trained on Criteo-1TB click logs stored as parquet shards.

Layout:  /data/criteo/parquet/day_{0..22}/part-*.parquet  (train)
         /data/criteo/parquet/day_23/part-*.parquet        (eval)
Columns: label, I1..I13 (dense, already log-transformed), C1..C26 (hashed int64 ids)

    torchrun --nproc_per_node=8 04_parquet_ctr_dlrm.py --max_steps 200000
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
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = [f"C{i}" for i in range(1, 27)]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_glob", default="/data/criteo/parquet/day_[0-9]*/part-*.parquet")
    p.add_argument("--eval_glob", default="/data/criteo/parquet/day_23/part-*.parquet")
    p.add_argument("--hash_size", type=int, default=1_000_000)
    p.add_argument("--emb_dim", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8192, help="per-GPU batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max_steps", type=int, default=200_000)
    p.add_argument("--eval_every", type=int, default=10_000)
    p.add_argument("--eval_batches", type=int, default=200)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save_dir", default="/shared/ckpt/dlrm")
    return p.parse_args()


class CriteoParquetStream(IterableDataset):
    """Yields ready-made batches read row group by row group."""

    def __init__(self, files, batch_size, hash_size, shuffle=True, seed=0, repeat=True):
        self.files = sorted(files)
        self.batch_size = batch_size
        self.hash_size = hash_size
        self.shuffle = shuffle
        self.seed = seed
        self.repeat = repeat

    def _batches_from_table(self, table, rng):
        label = table.column("label").to_numpy().astype(np.float32)
        dense = np.stack([table.column(c).to_numpy(zero_copy_only=False) for c in DENSE], 1)
        sparse = np.stack([table.column(c).to_numpy(zero_copy_only=False) for c in SPARSE], 1)
        dense = np.nan_to_num(dense.astype(np.float32))
        sparse = np.mod(sparse.astype(np.int64), self.hash_size)
        n = len(label)
        idx = rng.permutation(n) if self.shuffle else np.arange(n)
        for s in range(0, n - self.batch_size + 1, self.batch_size):
            b = idx[s:s + self.batch_size]
            yield (torch.from_numpy(dense[b]), torch.from_numpy(sparse[b]),
                   torch.from_numpy(label[b]))

    def __iter__(self):
        info = get_worker_info()
        wid = info.id if info is not None else 0
        files = self.files
        if info is not None:
            files = files[info.id::info.num_workers]
        epoch = 0
        while True:
            rng = np.random.default_rng((self.seed, wid, epoch))
            order = rng.permutation(len(files)) if self.shuffle else range(len(files))
            for fi in order:
                pf = pq.ParquetFile(files[fi])
                groups = rng.permutation(pf.num_row_groups) if self.shuffle else range(pf.num_row_groups)
                for g in groups:
                    table = pf.read_row_group(int(g), columns=["label"] + DENSE + SPARSE)
                    yield from self._batches_from_table(table, rng)
            epoch += 1
            if not self.repeat:
                return


class DLRM(nn.Module):
    def __init__(self, hash_size, emb_dim, n_dense=13, n_sparse=26):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(hash_size, emb_dim) for _ in range(n_sparse)])
        self.bottom = nn.Sequential(nn.Linear(n_dense, 512), nn.ReLU(),
                                    nn.Linear(512, 256), nn.ReLU(),
                                    nn.Linear(256, emb_dim), nn.ReLU())
        n_feat = n_sparse + 1
        n_inter = n_feat * (n_feat - 1) // 2
        self.top = nn.Sequential(nn.Linear(n_inter + emb_dim, 1024), nn.ReLU(),
                                 nn.Linear(1024, 512), nn.ReLU(),
                                 nn.Linear(512, 256), nn.ReLU(),
                                 nn.Linear(256, 1))
        self.register_buffer("tri", torch.triu_indices(n_feat, n_feat, offset=1), persistent=False)
        for e in self.embs:
            nn.init.uniform_(e.weight, -0.05, 0.05)

    def forward(self, dense, sparse):
        x = self.bottom(dense)
        feats = torch.stack([x] + [emb(sparse[:, i]) for i, emb in enumerate(self.embs)], dim=1)
        inter = torch.bmm(feats, feats.transpose(1, 2))
        inter = inter[:, self.tri[0], self.tri[1]]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


@torch.no_grad()
def evaluate(model, loader, max_batches, device):
    model.eval()
    preds, labels = [], []
    for i, (dense, sparse, label) in enumerate(loader):
        if i >= max_batches:
            break
        logits = model(dense.to(device), sparse.to(device))
        preds.append(torch.sigmoid(logits).float().cpu())
        labels.append(label)
    model.train()
    p, y = torch.cat(preds).numpy(), torch.cat(labels).numpy()
    logloss = -np.mean(y * np.log(p + 1e-7) + (1 - y) * np.log(1 - p + 1e-7))
    return roc_auc_score(y, p), logloss


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train_files = glob.glob(args.train_glob)
    train_ds = CriteoParquetStream(train_files, args.batch_size, args.hash_size, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=None, num_workers=args.workers,
                              pin_memory=True, prefetch_factor=2, persistent_workers=True)

    model = DLRM(args.hash_size, args.emb_dim).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    # global batch = batch_size * world_size; lr below was tuned for 8 x 8192
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.BCEWithLogitsLoss()

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        eval_ds = CriteoParquetStream(glob.glob(args.eval_glob), 16384, args.hash_size,
                                      shuffle=False, repeat=False)
        eval_loader = DataLoader(eval_ds, batch_size=None, num_workers=4)

    model.train()
    running, t0 = torch.zeros(2, device=device), time.time()
    data_iter = iter(train_loader)
    for step in range(1, args.max_steps + 1):
        dense, sparse, label = next(data_iter)
        dense = dense.to(device, non_blocking=True)
        sparse = sparse.to(device, non_blocking=True)
        label = label.to(device, non_blocking=True)

        logits = model(dense, sparse)
        loss = loss_fn(logits, label)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        running += torch.stack([loss.detach(), torch.ones((), device=device)])

        if step % 500 == 0:
            dist.all_reduce(running)
            if rank == 0:
                qps = 500 * args.batch_size * world_size / (time.time() - t0)
                print(f"step {step:>7d} | loss {(running[0] / running[1]).item():.5f} | {qps:,.0f} samples/s")
            running.zero_()
            t0 = time.time()

        if step % args.eval_every == 0:
            if rank == 0:
                auc, ll = evaluate(model.module, eval_loader, args.eval_batches, device)
                print(f"step {step} eval auc {auc:.5f} logloss {ll:.5f}")
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step}, os.path.join(args.save_dir, f"step_{step}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
