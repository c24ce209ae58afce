"""Incremental (hourly) DLRM training for the online CTR model.

Each run warm-starts from the previous hour's checkpoint, trains one pass over
the new hour of click logs, evaluates on the next hour (progressive validation)
and writes a new checkpoint that the export job picks up.

Scheduled by airflow as:
    torchrun --nproc_per_node=8 19_dlrm_hourly_logs.py --hour 2024061513 \
        --log_root /mnt/shared/clicklogs --model_root /mnt/shared/models/ctr_online
"""
import argparse
import datetime as dt
import logging
import os
import time

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

SPARSE = ["user_bucket", "ad_id", "campaign_id", "site_id", "app_id", "slot", "geo", "os", "hour_of_week"]
DENSE = ["bid_floor", "user_clicks_24h", "user_imps_24h", "ad_ctr_1h", "ad_ctr_24h"]
HASH = 1 << 21
log = logging.getLogger("hourly")


def hour_dir(root, hour):
    return os.path.join(root, f"dt={hour[:8]}", f"hr={hour[8:]}")


def next_hour(hour, delta=1):
    t = dt.datetime.strptime(hour, "%Y%m%d%H") + dt.timedelta(hours=delta)
    return t.strftime("%Y%m%d%H")


class HourLog(Dataset):
    def __init__(self, path):
        t = pq.read_table(path, columns=SPARSE + DENSE + ["click"])
        self.sparse = np.stack([t.column(c).to_numpy().astype(np.int64) % HASH for c in SPARSE], 1)
        self.dense = np.log1p(np.stack([t.column(c).to_numpy() for c in DENSE], 1).clip(min=0)).astype(np.float32)
        self.y = t.column("click").to_numpy().astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.dense[i], self.sparse[i], self.y[i]


class DLRM(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.tables = nn.ModuleList([nn.Embedding(HASH, dim) for _ in SPARSE])
        self.bottom = nn.Sequential(nn.Linear(len(DENSE), 128), nn.ReLU(), nn.Linear(128, dim), nn.ReLU())
        n = len(SPARSE) + 1
        self.register_buffer("pairs", torch.triu_indices(n, n, 1), persistent=False)
        self.top = nn.Sequential(nn.Linear(dim + n * (n - 1) // 2, 512), nn.ReLU(), nn.Linear(512, 128), nn.ReLU(),
                                 nn.Linear(128, 1))

    def forward(self, dense, sparse):
        b = self.bottom(dense)
        f = torch.stack([b] + [t(sparse[:, i]) for i, t in enumerate(self.tables)], 1)
        z = torch.bmm(f, f.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([b, z], 1)).squeeze(1)


@torch.no_grad()
def progressive_eval(net, loader, device):
    net.eval()
    out_p, out_y = [], []
    for dense, sparse, y in loader:
        out_p.append(torch.sigmoid(net(dense.to(device), sparse.to(device))).cpu().numpy())
        out_y.append(y.numpy())
    net.train()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (np.concatenate(out_p), np.concatenate(out_y)))
    p = np.concatenate([g[0] for g in gathered])
    y = np.concatenate([g[1] for g in gathered])
    return {"auc": float(roc_auc_score(y, p)), "copc": float(y.sum() / max(p.sum(), 1e-9)), "n": int(len(y))}


def save_checkpoint(model, opts, hour, metrics, model_root):
    path = os.path.join(model_root, f"ckpt_{hour}.pt")
    torch.save({"model": model.module.state_dict(), "opt_sparse": opts[0].state_dict(),
                "opt_dense": opts[1].state_dict(), "hour": hour, "metrics": metrics}, path)
    with open(os.path.join(model_root, "LATEST"), "w") as f:
        f.write(hour + "\n")
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hour", required=True, help="YYYYMMDDHH of the training hour")
    ap.add_argument("--log_root", required=True)
    ap.add_argument("--model_root", required=True)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch_size", type=int, default=4096)
    ap.add_argument("--sparse_lr", type=float, default=0.01)
    ap.add_argument("--dense_lr", type=float, default=5e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s {args.hour} r{rank} %(message)s")

    train_ds = HourLog(hour_dir(args.log_root, args.hour))
    eval_ds = HourLog(hour_dir(args.log_root, next_hour(args.hour)))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=int(args.hour), drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                          pin_memory=True, drop_last=True)
    eval_dl = DataLoader(Subset(eval_ds, range(rank, len(eval_ds), world)), batch_size=16384, num_workers=4)

    torch.manual_seed(0)
    model = DLRM(args.dim).to(device)
    prev = os.path.join(args.model_root, f"ckpt_{next_hour(args.hour, -1)}.pt")
    state = None
    if os.path.exists(prev):
        state = torch.load(prev, map_location=device)
        model.load_state_dict(state["model"])
        log.info("warm start from %s (prev auc %.4f)", prev, state["metrics"]["auc"])
    else:
        log.warning("no checkpoint for previous hour, cold start")
    model = DDP(model, device_ids=[local_rank])

    opt_sparse = torch.optim.Adagrad(model.module.tables.parameters(), lr=args.sparse_lr)
    opt_dense = torch.optim.Adam(list(model.module.bottom.parameters()) + list(model.module.top.parameters()),
                                 lr=args.dense_lr)
    if state is not None:
        opt_sparse.load_state_dict(state["opt_sparse"])
        opt_dense.load_state_dict(state["opt_dense"])
        del state

    sampler.set_epoch(0)
    t0 = time.time()
    loss_sum = torch.zeros(2, device=device)
    for step, (dense, sparse, y) in enumerate(train_dl, 1):
        dense, sparse, y = dense.to(device, non_blocking=True), sparse.to(device, non_blocking=True), \
            y.to(device, non_blocking=True)
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), y)
        opt_sparse.zero_grad(set_to_none=True)
        opt_dense.zero_grad(set_to_none=True)
        loss.backward()
        opt_sparse.step()
        opt_dense.step()
        loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        if step % 200 == 0:
            log.info("step %d/%d  %.0f samples/s", step, len(train_dl),
                     step * args.batch_size * world / (time.time() - t0))
    dist.all_reduce(loss_sum)
    log.info("hour %s trained: %d steps, mean loss %.5f, %.1fs", args.hour, len(train_dl),
             (loss_sum[0] / loss_sum[1]).item(), time.time() - t0)

    metrics = progressive_eval(model.module, eval_dl, device)
    log.info("progressive eval on %s: auc %.5f copc %.4f n=%d", next_hour(args.hour), metrics["auc"],
             metrics["copc"], metrics["n"])

    os.makedirs(args.model_root, exist_ok=True)
    path = save_checkpoint(model, (opt_sparse, opt_dense), args.hour, metrics, args.model_root)
    log.info("saved %s", path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
