#!/usr/bin/env python
"""
Multi-task DLRM (CTR + post-click CVR) on the ad-impression logs.

Two data streams are interleaved: the impression stream (click labels) and the
attributed-click stream (conversion labels, much smaller).  Every `cvr_period`-th
step is drawn from the click stream and trains the CVR tower.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD_NODE:29400 --rdzv_id=dlrm-mt \
        06_dlrm_ctr_cvr_multitask.py --conf conf/dlrm_mt.yaml
"""
import argparse
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("dlrm")


@dataclass
class Conf:
    impressions: str = "/data/ads/impr_{split}.npz"
    clicks: str = "/data/ads/click_{split}.npz"
    table_sizes: list = field(default_factory=lambda: [2_000_000] * 8 + [200_000] * 10 + [1_000] * 8)
    emb_dim: int = 64
    dense_dim: int = 13
    bottom: list = field(default_factory=lambda: [512, 256, 64])
    top: list = field(default_factory=lambda: [512, 256, 1])
    batch_size: int = 4096
    lr: float = 0.02
    steps: int = 200_000
    cvr_period: int = 4
    eval_every: int = 10_000
    out: str = "ckpt/dlrm_mt"


class LogDataset(Dataset):
    def __init__(self, path, label_key):
        z = np.load(path)
        self.dense = torch.from_numpy(np.log1p(np.maximum(z["dense"], 0)).astype(np.float32))
        self.sparse = torch.from_numpy(z["sparse"].astype(np.int64))
        self.label = torch.from_numpy(z[label_key].astype(np.float32))

    def __len__(self):
        return self.label.shape[0]

    def __getitem__(self, i):
        return self.dense[i], self.sparse[i], self.label[i]


def mlp(sizes, last_act=True):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_act:
            layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class MultiTaskDLRM(nn.Module):
    def __init__(self, c: Conf):
        super().__init__()
        self.tables = nn.ModuleList([nn.EmbeddingBag(n, c.emb_dim, mode="sum") for n in c.table_sizes])
        self.table_sizes = c.table_sizes
        self.bottom = mlp([c.dense_dim] + c.bottom)
        n_f = len(c.table_sizes) + 1
        inter_dim = n_f * (n_f - 1) // 2 + c.emb_dim
        self.towers = nn.ModuleDict({"ctr": mlp([inter_dim] + c.top, last_act=False),
                                     "cvr": mlp([inter_dim] + c.top, last_act=False)})
        for t in self.tables:
            nn.init.uniform_(t.weight, -0.01, 0.01)

    def interact(self, dense_emb, sparse_embs):
        feats = torch.stack([dense_emb] + sparse_embs, dim=1)          # B, F, D
        z = torch.bmm(feats, feats.transpose(1, 2))
        li, lj = torch.tril_indices(feats.shape[1], feats.shape[1], offset=-1, device=z.device)
        return torch.cat([dense_emb, z[:, li, lj]], dim=1)

    def forward(self, dense, sparse, task):
        d = self.bottom(dense)
        embs = [tab(sparse[:, k:k + 1] % n) for k, (tab, n) in enumerate(zip(self.tables, self.table_sizes))]
        return self.towers[task](self.interact(d, embs)).squeeze(-1)


class Stream:
    """Endless iterator over a sharded loader; bumps the sampler epoch on wrap-around."""

    def __init__(self, ds, batch_size):
        self.sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
        self.loader = DataLoader(ds, batch_size=batch_size, sampler=self.sampler, num_workers=4,
                                 pin_memory=True, drop_last=True, persistent_workers=True)
        self.epoch = 0
        self.sampler.set_epoch(0)
        self.it = iter(self.loader)

    def __next__(self):
        try:
            return next(self.it)
        except StopIteration:
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
            self.it = iter(self.loader)
            return next(self.it)


@torch.no_grad()
def evaluate(model, ds, task, batch_size, device):
    model.eval()
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=4)
    preds, labels = [], []
    for dense, sparse, y in loader:
        p = torch.sigmoid(model.module(dense.to(device), sparse.to(device), task))
        preds.append(p); labels.append(y.to(device))
    local = torch.stack([torch.cat(preds), torch.cat(labels)])          # same length on every rank
    world = dist.get_world_size()
    gathered = torch.empty(world, *local.shape, device=device)
    dist.all_gather_into_tensor(gathered, local)
    model.train()
    if dist.get_rank() == 0:
        g = gathered.permute(1, 0, 2).reshape(2, -1).cpu().numpy()
        return roc_auc_score(g[1], g[0])
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conf", default=None)
    args = ap.parse_args()
    conf = Conf(**(yaml.safe_load(open(args.conf)) if args.conf else {}))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    torch.manual_seed(0)
    model = MultiTaskDLRM(conf).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    opt = torch.optim.Adagrad(model.parameters(), lr=conf.lr)
    bce = nn.BCEWithLogitsLoss()

    impr = Stream(LogDataset(conf.impressions.format(split="train"), "click"), conf.batch_size)
    clk = Stream(LogDataset(conf.clicks.format(split="train"), "conversion"), conf.batch_size)
    impr_val = LogDataset(conf.impressions.format(split="val"), "click")
    clk_val = LogDataset(conf.clicks.format(split="val"), "conversion")
    logger.info("world %d, global batch %d", world, conf.batch_size * world)

    running = torch.zeros(2, 2, device=device)   # [task][loss_sum, n]
    t0 = time.time()
    for step in range(1, conf.steps + 1):
        task = "cvr" if step % conf.cvr_period == 0 else "ctr"
        dense, sparse, y = next(clk if task == "cvr" else impr)
        dense, sparse, y = dense.to(device, non_blocking=True), sparse.to(device, non_blocking=True), y.to(device)
        logit = model(dense, sparse, task)
        loss = bce(logit, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running[int(task == "cvr")] += torch.stack([loss.detach(), torch.ones((), device=device)])

        if step % 500 == 0:
            dist.all_reduce(running)
            avg = (running[:, 0] / running[:, 1].clamp(min=1)).tolist()
            logger.info("step %d ctr_loss %.4f cvr_loss %.4f %.0f samples/s", step, avg[0], avg[1],
                        500 * conf.batch_size * world / (time.time() - t0))
            running.zero_()
            t0 = time.time()

        if step % conf.eval_every == 0:
            auc_ctr = evaluate(model, impr_val, "ctr", conf.batch_size, device)
            auc_cvr = evaluate(model, clk_val, "cvr", conf.batch_size, device)
            if rank == 0:
                logger.info("step %d  AUC ctr %.5f  cvr %.5f", step, auc_ctr, auc_cvr)
                os.makedirs(conf.out, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                           os.path.join(conf.out, f"step{step:07d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
