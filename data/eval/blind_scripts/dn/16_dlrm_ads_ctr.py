"""DLRM for sponsored-search CTR (query x ad), tracked in Weights & Biases.

    torchrun --nproc_per_node=8 16_dlrm_ads_ctr.py --data /mnt/ads/sps_ctr/v7 \
        --run_name dlrm-v7-emb128 --emb_dim 128
"""
import argparse
import glob
import os
import time

import numpy as np
import pyarrow.dataset as pads
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

SPARSE_FEATURES = {
    "query_hash": 5_000_000, "ad_id": 2_000_000, "advertiser_id": 300_000, "keyword_id": 3_000_000,
    "match_type": 8, "device": 8, "position": 16, "user_region": 5000,
}
DENSE_FEATURES = ["bid", "quality_score", "hist_ctr_ad", "hist_ctr_query", "query_len"]


class SponsoredSearchLog(Dataset):
    def __init__(self, path):
        tbl = pads.dataset(path, format="parquet").to_table(
            columns=list(SPARSE_FEATURES) + DENSE_FEATURES + ["click"])
        self.sparse = np.stack([tbl[c].to_numpy() % n for c, n in SPARSE_FEATURES.items()], 1).astype(np.int64)
        d = np.stack([tbl[c].to_numpy() for c in DENSE_FEATURES], 1).astype(np.float32)
        self.dense = np.sign(d) * np.log1p(np.abs(d))
        self.y = tbl["click"].to_numpy().astype(np.float32)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.dense[i], self.sparse[i], self.y[i]


class DLRM(nn.Module):
    def __init__(self, dim, bottom=(256, 128), top=(1024, 512, 256)):
        super().__init__()
        self.emb = nn.ModuleDict({k: nn.Embedding(n, dim) for k, n in SPARSE_FEATURES.items()})
        layers, d = [], len(DENSE_FEATURES)
        for h in list(bottom) + [dim]:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        self.bottom = nn.Sequential(*layers)
        f = len(SPARSE_FEATURES) + 1
        layers, d = [], dim + f * (f - 1) // 2
        for h in top:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        layers.append(nn.Linear(d, 1))
        self.top = nn.Sequential(*layers)
        iu = torch.triu_indices(f, f, 1)
        self.register_buffer("iu0", iu[0], persistent=False)
        self.register_buffer("iu1", iu[1], persistent=False)

    def forward(self, dense, sparse):
        x = self.bottom(dense)
        e = [self.emb[k](sparse[:, j]) for j, k in enumerate(SPARSE_FEATURES)]
        t = torch.stack([x] + e, 1)
        z = torch.bmm(t, t.transpose(1, 2))[:, self.iu0, self.iu1]
        return self.top(torch.cat([x, z], 1)).squeeze(1)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    p, y = [], []
    for dense, sparse, label in loader:
        p.append(torch.sigmoid(net(dense.to(device), sparse.to(device))).cpu().numpy())
        y.append(label.numpy())
    net.train()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (np.concatenate(p), np.concatenate(y)))
    preds = np.concatenate([a for a, _ in parts])
    labels = np.concatenate([b for _, b in parts])
    eps = 1e-7
    ll = -np.mean(labels * np.log(preds + eps) + (1 - labels) * np.log(1 - preds + eps))
    return {"auc": roc_auc_score(labels, preds), "logloss": float(ll),
            "pred_ctr": float(preds.mean()), "true_ctr": float(labels.mean())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--run_name", default=None)
    ap.add_argument("--wandb_project", default="ads-ctr")
    ap.add_argument("--ckpt_root", default="/mnt/ads/checkpoints")
    ap.add_argument("--emb_dim", type=int, default=64)
    ap.add_argument("--batch_size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--log_every", type=int, default=100)
    ap.add_argument("--eval_every", type=int, default=5000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    run = wandb.init(project=args.wandb_project, name=args.run_name, config={**vars(args), "world_size": world})

    train_ds = SponsoredSearchLog(os.path.join(args.data, "train"))
    val_ds = SponsoredSearchLog(os.path.join(args.data, "val"))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=16384, num_workers=4)

    torch.manual_seed(0)
    model = DDP(DLRM(args.emb_dim).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    ckpt_dir = os.path.join(args.ckpt_root, run.name or "default")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    step = 0
    best_auc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for dense, sparse, y in train_loader:
            dense, sparse, y = dense.to(device, non_blocking=True), sparse.to(device, non_blocking=True), \
                y.to(device, non_blocking=True)
            loss = F.binary_cross_entropy_with_logits(model(dense, sparse), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1

            if step % args.log_every == 0:
                lt = loss.detach().clone()
                dist.all_reduce(lt, op=dist.ReduceOp.AVG)
                wandb.log({"train/loss": lt.item(), "epoch": epoch,
                           "perf/samples_per_s": args.log_every * args.batch_size * world / (time.time() - t0)},
                          step=step)
                t0 = time.time()

            if step % args.eval_every == 0:
                m = evaluate(model.module, val_loader, device)
                wandb.log({f"val/{k}": v for k, v in m.items()}, step=step)
                if rank == 0 and m["auc"] > best_auc:
                    best_auc = m["auc"]
                    torch.save({"model": model.module.state_dict(), "step": step, "auc": best_auc},
                               os.path.join(ckpt_dir, "best.pt"))
                dist.barrier()
                t0 = time.time()

    m = evaluate(model.module, val_loader, device)
    wandb.log({f"val/{k}": v for k, v in m.items()}, step=step)
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "step": step, "auc": m["auc"]},
                   os.path.join(ckpt_dir, "final.pt"))
        print(f"done: final auc {m['auc']:.5f}, best {max(best_auc, m['auc']):.5f}", flush=True)
    wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
