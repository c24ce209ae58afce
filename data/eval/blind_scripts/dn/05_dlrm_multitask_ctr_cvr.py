"""Shared-bottom DLRM with CTR and CVR heads for the ads ranking model.

The CVR head is trained on the same impressions (ESMM-style pCTCVR = pCTR * pCVR)
once conversion labels for the window are backfilled; until then we train CTR only
with ``--tasks ctr``.

Example:
    torchrun --nproc_per_node=8 05_dlrm_multitask_ctr_cvr.py \
        --train /mnt/shared/ads/esmm/train --val /mnt/shared/ads/esmm/val --tasks ctr
"""
import argparse
import glob
import logging
import os
import time

import numpy as np
import pyarrow.dataset as pads
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

SPARSE = ["user_id", "ad_id", "advertiser_id", "campaign_id", "slot_id", "os", "city_id", "hour"]
DENSE = ["user_ctr_30d", "ad_ctr_7d", "price", "user_active_days"]

log = logging.getLogger("esmm")


class ImpressionLog(Dataset):
    def __init__(self, root, hash_size):
        ds = pads.dataset(root, format="parquet")
        tbl = ds.to_table(columns=SPARSE + DENSE + ["click", "conversion"])
        self.sparse = np.stack([tbl[c].to_numpy().astype(np.int64) % hash_size for c in SPARSE], 1)
        self.dense = np.stack([tbl[c].to_numpy().astype(np.float32) for c in DENSE], 1)
        self.dense = np.log1p(np.maximum(self.dense, 0))
        self.click = tbl["click"].to_numpy().astype(np.float32)
        self.conv = tbl["conversion"].to_numpy().astype(np.float32)

    def __len__(self):
        return len(self.click)

    def __getitem__(self, i):
        return self.sparse[i], self.dense[i], self.click[i], self.conv[i]


class Interaction(nn.Module):
    def __init__(self, n_feat):
        super().__init__()
        iu = torch.triu_indices(n_feat, n_feat, 1)
        self.register_buffer("iu", iu, persistent=False)

    def forward(self, feats):
        z = torch.einsum("bid,bjd->bij", feats, feats)
        return z[:, self.iu[0], self.iu[1]]


def head(d_in):
    return nn.Sequential(nn.Linear(d_in, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 1))


class MultiTaskDLRM(nn.Module):
    def __init__(self, n_sparse, n_dense, hash_size, dim):
        super().__init__()
        self.emb = nn.ModuleList([nn.Embedding(hash_size, dim) for _ in range(n_sparse)])
        self.bottom = nn.Sequential(nn.Linear(n_dense, 128), nn.ReLU(), nn.Linear(128, dim), nn.ReLU())
        n = n_sparse + 1
        self.inter = Interaction(n)
        d_in = dim + n * (n - 1) // 2
        self.shared = nn.Sequential(nn.Linear(d_in, 512), nn.ReLU())
        # both heads always exist so checkpoints have the same layout regardless of --tasks
        self.ctr_head = head(512)
        self.cvr_head = head(512)

    def forward(self, sparse, dense):
        x = self.bottom(dense)
        feats = torch.stack([x] + [e(sparse[:, i]) for i, e in enumerate(self.emb)], 1)
        h = self.shared(torch.cat([x, self.inter(feats)], 1))
        return self.ctr_head(h).squeeze(1), self.cvr_head(h).squeeze(1)


def compute_loss(ctr_logit, cvr_logit, click, conv, tasks):
    loss = F.binary_cross_entropy_with_logits(ctr_logit, click)
    if "cvr" in tasks:
        # ESMM: supervise pCTCVR over all impressions
        p_ctcvr = torch.sigmoid(ctr_logit) * torch.sigmoid(cvr_logit)
        loss = loss + F.binary_cross_entropy(p_ctcvr.clamp(1e-7, 1 - 1e-7), click * conv)
    return loss


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    out = {"ctr": [], "ctcvr": [], "click": [], "conv": []}
    for sparse, dense, click, conv in loader:
        ctr, cvr = model(sparse.to(device), dense.to(device))
        pctr = torch.sigmoid(ctr)
        out["ctr"].append(pctr)
        out["ctcvr"].append(pctr * torch.sigmoid(cvr))
        out["click"].append(click.to(device))
        out["conv"].append(conv.to(device))
    model.train()
    local = torch.stack([torch.cat(out[k]) for k in ("ctr", "ctcvr", "click", "conv")]).cpu().numpy()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    allv = np.concatenate(gathered, axis=1)
    res = {"auc_ctr": roc_auc_score(allv[2], allv[0])}
    if allv[2].sum() > 0 and (allv[2] * allv[3]).sum() > 0:
        res["auc_ctcvr"] = roc_auc_score(allv[2] * allv[3], allv[1])
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", default="/mnt/shared/ads/esmm/runs/latest")
    ap.add_argument("--tasks", default="ctr,cvr")
    ap.add_argument("--hash_size", type=int, default=2_000_003)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--bs", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=6)
    args = ap.parse_args()
    tasks = set(args.tasks.split(","))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(7)

    train_ds = ImpressionLog(args.train, args.hash_size)
    val_ds = ImpressionLog(args.val, args.hash_size)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    tr_loader = DataLoader(train_ds, args.bs, sampler=tr_sampler, num_workers=args.workers,
                           pin_memory=True, drop_last=True)
    # strided shard of the validation set, no padding so every row is scored exactly once
    va_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), args.bs,
                           num_workers=args.workers)
    log.info("tasks=%s train=%d val=%d world=%d", sorted(tasks), len(train_ds), len(val_ds), world)

    model = MultiTaskDLRM(len(SPARSE), len(DENSE), args.hash_size, args.dim).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    global_step = 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        tic = time.time()
        for sparse, dense, click, conv in tr_loader:
            sparse, dense = sparse.to(device, non_blocking=True), dense.to(device, non_blocking=True)
            click, conv = click.to(device, non_blocking=True), conv.to(device, non_blocking=True)
            ctr_logit, cvr_logit = model(sparse, dense)
            loss = compute_loss(ctr_logit, cvr_logit, click, conv, tasks)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            global_step += 1
            if global_step % 100 == 0:
                lt = loss.detach().clone()
                dist.all_reduce(lt, op=dist.ReduceOp.AVG)
                log.info("ep %d step %d loss %.5f  %.1f it/s", epoch, global_step, lt.item(),
                         100 / (time.time() - tic))
                tic = time.time()

        metrics = evaluate(model.module, va_loader, device)
        log.info("epoch %d %s", epoch, " ".join(f"{k}={v:.5f}" for k, v in metrics.items()))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch, "tasks": sorted(tasks)},
                       os.path.join(args.out, f"epoch_{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
