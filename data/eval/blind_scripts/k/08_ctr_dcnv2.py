"""CTR prediction with DCN-v2 on our ad-impression logs (Criteo-like TSV shards).

Feature ablations are run by listing the sparse fields to use in `active_sparse` in the yaml.

    torchrun --nproc_per_node=8 08_ctr_dcnv2.py --config configs/dcnv2_ablation_no_user_hist.yaml
"""
import argparse
import glob
import logging
import os
import time
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("ctr")

SPARSE_SCHEMA = {  # field -> hashed vocabulary size
    "ad_id": 2_000_000, "advertiser_id": 200_000, "campaign_id": 500_000, "creative_type": 32,
    "site_id": 300_000, "app_id": 300_000, "device_model": 50_000, "os": 64, "geo_region": 5_000,
    "hour_of_week": 168, "user_seg": 4_096, "user_hist_cat": 10_000, "user_hist_adv": 200_000,
    "query_cat": 2_000, "slot_pos": 32,
}
NUM_DENSE = 13


@dataclass
class CTRConfig:
    train_glob: str = "/data/ctr/train/part-*.npz"
    valid_glob: str = "/data/ctr/valid/part-*.npz"
    active_sparse: Optional[List[str]] = None
    emb_dim: int = 16
    cross_layers: int = 3
    deep_dims: List[int] = field(default_factory=lambda: [768, 512, 256])
    batch_size: int = 8192
    lr: float = 2e-3
    epochs: int = 3
    log_every: int = 200
    ckpt_path: str = "/ckpt/ctr/dcnv2.pt"


class ShardedImpressions(Dataset):
    def __init__(self, pattern: str):
        parts = [np.load(p) for p in sorted(glob.glob(pattern))]
        self.sparse = np.concatenate([p["sparse"] for p in parts]).astype(np.int64)  # [N, len(SPARSE_SCHEMA)]
        self.dense = np.concatenate([p["dense"] for p in parts]).astype(np.float32)
        self.label = np.concatenate([p["click"] for p in parts]).astype(np.float32)

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return self.sparse[i], np.log1p(np.maximum(self.dense[i], 0)), self.label[i]


class CrossLayerV2(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x0, x):
        return x0 * self.lin(x) + x


class DCNv2(nn.Module):
    def __init__(self, cfg: CTRConfig):
        super().__init__()
        self.fields = list(SPARSE_SCHEMA)
        self.active = cfg.active_sparse or self.fields
        self.active_idx = [self.fields.index(f) for f in self.active]
        self.embeddings = nn.ModuleDict({f: nn.Embedding(v, cfg.emb_dim) for f, v in SPARSE_SCHEMA.items()})
        in_dim = len(self.active) * cfg.emb_dim + NUM_DENSE
        self.dense_bn = nn.BatchNorm1d(NUM_DENSE)
        self.cross = nn.ModuleList([CrossLayerV2(in_dim) for _ in range(cfg.cross_layers)])
        deep, d = [], in_dim
        for h in cfg.deep_dims:
            deep += [nn.Linear(d, h), nn.ReLU(), nn.Dropout(0.1)]
            d = h
        self.deep = nn.Sequential(*deep)
        self.out = nn.Linear(in_dim + d, 1)

    def forward(self, sparse, dense):
        embs = [self.embeddings[f](sparse[:, i]) for f, i in zip(self.active, self.active_idx)]
        x0 = torch.cat(embs + [self.dense_bn(dense)], dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.out(torch.cat([x, self.deep(x0)], dim=1)).squeeze(-1)


def gather_predictions(preds: torch.Tensor, labels: torch.Tensor, world_size: int):
    both = torch.stack([preds, labels], dim=1)
    out = [torch.empty_like(both) for _ in range(world_size)]
    dist.all_gather(out, both)
    cat = torch.cat(out).cpu().numpy()
    return cat[:, 0], cat[:, 1]


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    preds, labels, loss_sum = [], [], torch.zeros(2, device=device)
    bce = nn.BCEWithLogitsLoss(reduction="sum")
    for sparse, dense, y in loader:
        sparse, dense, y = sparse.to(device), dense.to(device), y.to(device)
        logits = model(sparse, dense)
        loss_sum += torch.stack([bce(logits, y), torch.tensor(float(y.numel()), device=device)])
        preds.append(torch.sigmoid(logits))
        labels.append(y)
    dist.all_reduce(loss_sum)
    p, l = gather_predictions(torch.cat(preds), torch.cat(labels), world_size)
    model.train()
    return roc_auc_score(l, p), (loss_sum[0] / loss_sum[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = CTRConfig(**yaml.safe_load(open(parser.parse_args().config)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    train_ds, valid_ds = ShardedImpressions(cfg.train_glob), ShardedImpressions(cfg.valid_glob)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=cfg.batch_size, num_workers=4,
                              sampler=DistributedSampler(valid_ds, shuffle=False))

    model = DDP(DCNv2(cfg).to(device), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    criterion = nn.BCEWithLogitsLoss()

    step = 0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for sparse, dense, y in train_loader:
            sparse, dense, y = sparse.to(device, non_blocking=True), dense.to(device, non_blocking=True), \
                y.to(device, non_blocking=True)
            loss = criterion(model(sparse, dense), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % cfg.log_every == 0 and rank == 0:
                logger.info("epoch %d step %d loss %.5f %.0f ex/s", epoch, step, loss.item(),
                            cfg.log_every * cfg.batch_size * world_size / (time.time() - t0))
                t0 = time.time()
        auc, logloss = evaluate(model, valid_loader, device, world_size)
        if rank == 0:
            logger.info("epoch %d valid auc %.5f logloss %.5f", epoch, auc, logloss)
            os.makedirs(os.path.dirname(cfg.ckpt_path), exist_ok=True)
            torch.save({"model": model.module.state_dict(), "cfg": cfg.__dict__, "epoch": epoch}, cfg.ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
