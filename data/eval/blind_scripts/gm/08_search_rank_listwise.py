# -*- coding: utf-8 -*-
"""
搜索精排 listwise 模型（DNN + ListNet/softmax loss）

样本按 query 聚合成 list：每个 list 最多 max_list_size 个 doc，特征为 dense 特征 + 若干离散特征 id
checkpoint 统一写到 HDFS fuse 挂载目录，供下游导出服务读取。

启动：
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29400 \
        08_search_rank_listwise.py --conf conf/rank_listwise.yaml
"""
import os
import math
import time
import glob
import argparse
import logging

import yaml
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from search_common.metrics_reporter import Reporter

logger = logging.getLogger("rank")


class ListDataset(Dataset):
    """每个 npz 分片包含 dense[Q, L, D], sparse[Q, L, S], label[Q, L], valid[Q, L]"""

    def __init__(self, pattern):
        dense, sparse, label, valid = [], [], [], []
        for f in sorted(glob.glob(pattern)):
            d = np.load(f)
            dense.append(d["dense"])
            sparse.append(d["sparse"])
            label.append(d["label"])
            valid.append(d["valid"])
        self.dense = np.concatenate(dense).astype(np.float32)
        self.sparse = np.concatenate(sparse).astype(np.int64)
        self.label = np.concatenate(label).astype(np.float32)
        self.valid = np.concatenate(valid).astype(np.bool_)

    def __len__(self):
        return self.dense.shape[0]

    def __getitem__(self, i):
        return self.dense[i], self.sparse[i], self.label[i], self.valid[i]


class RankNet(nn.Module):
    def __init__(self, dense_dim, sparse_vocab, emb_dim=16, hidden=(512, 256, 128)):
        super().__init__()
        self.embs = nn.ModuleList([nn.Embedding(v, emb_dim, padding_idx=0) for v in sparse_vocab])
        in_dim = dense_dim + emb_dim * len(sparse_vocab)
        layers = []
        for h in hidden:
            layers += [nn.Linear(in_dim, h), nn.LayerNorm(h), nn.GELU()]
            in_dim = h
        layers.append(nn.Linear(in_dim, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, dense, sparse):
        emb = torch.cat([e(sparse[..., i]) for i, e in enumerate(self.embs)], dim=-1)
        x = torch.cat([dense, emb], dim=-1)
        return self.mlp(x).squeeze(-1)  # [B, L]


def listwise_loss(scores, labels, valid):
    scores = scores.masked_fill(~valid, -1e4)
    target = torch.where(valid, labels, torch.full_like(labels, -1e4))
    target = F.softmax(target, dim=-1)
    return -(target * F.log_softmax(scores, dim=-1)).sum(-1).mean()


def ndcg_at_k(scores, labels, valid, k=10):
    scores = scores.masked_fill(~valid, -1e9)
    _, order = scores.sort(dim=-1, descending=True)
    gains = (2 ** labels.gather(-1, order) - 1) * valid.gather(-1, order)
    disc = 1.0 / torch.log2(torch.arange(labels.size(-1), device=labels.device, dtype=torch.float32) + 2)
    dcg = (gains[:, :k] * disc[:k]).sum(-1)
    ideal, _ = ((2 ** labels - 1) * valid).sort(dim=-1, descending=True)
    idcg = (ideal[:, :k] * disc[:k]).sum(-1)
    has_rel = idcg > 0
    return (dcg[has_rel] / idcg[has_rel]).sum(), has_rel.sum()


@torch.no_grad()
def evaluate(model, dataset, device, bs):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    loader = DataLoader(Subset(dataset, range(rank, len(dataset), world)), batch_size=bs, num_workers=2)
    acc = torch.zeros(2, device=device)
    for dense, sparse, label, valid in loader:
        dense, sparse, label, valid = dense.to(device), sparse.to(device), label.to(device), valid.to(device)
        s, n = ndcg_at_k(model.module(dense, sparse), label, valid)
        acc[0] += s
        acc[1] += n
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1].clamp(min=1)).item()


def save_checkpoint(path, model, optimizer, scheduler, epoch, best):
    torch.save({
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
        "best_ndcg": best,
    }, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--conf", required=True)
    cfg = yaml.safe_load(open(parser.parse_args().conf))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [rank{}] %(message)s".format(rank))
    if rank != 0:
        logger.setLevel(logging.WARNING)

    reporter = Reporter(task=cfg["task_name"]) if rank == 0 else None
    ckpt_dir = cfg["ckpt_dir"]  # /mnt/hdfs/search/rank/ckpt/<exp>
    os.makedirs(ckpt_dir, exist_ok=True)

    train_set = ListDataset(cfg["train_pattern"])
    val_set = ListDataset(cfg["val_pattern"])
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.get("seed", 0))
    loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler,
                        num_workers=cfg.get("num_workers", 4), pin_memory=True, drop_last=True)

    model = RankNet(train_set.dense.shape[-1], cfg["sparse_vocab"], cfg["emb_dim"], tuple(cfg["hidden"])).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    total = cfg["epochs"] * len(loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg["lr"], total_steps=total, pct_start=0.05)

    start_epoch, best = 0, 0.0
    last = os.path.join(ckpt_dir, "last.pt")
    if os.path.exists(last):
        state = torch.load(last, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, best = state["epoch"] + 1, state["best_ndcg"]
        logger.info("从 %s 续训, start_epoch=%d", last, start_epoch)
    dist.barrier()

    step = start_epoch * len(loader)
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for dense, sparse, label, valid in loader:
            dense = dense.to(device, non_blocking=True)
            sparse = sparse.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            valid = valid.to(device, non_blocking=True)
            loss = listwise_loss(model(dense, sparse), label, valid)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % cfg["log_every"] == 0:
                speed = cfg["log_every"] / (time.time() - t0)
                logger.info("epoch %d step %d loss %.5f lr %.2e %.2f it/s", epoch, step, loss.item(),
                            scheduler.get_last_lr()[0], speed)
                if reporter is not None:
                    reporter.add_scalar("train_loss", loss.item(), step)
                t0 = time.time()

        ndcg = evaluate(model, val_set, device, cfg["batch_size"])
        best = max(best, ndcg)
        logger.info("epoch %d val NDCG@10 %.5f best %.5f", epoch, ndcg, best)
        if reporter is not None:
            reporter.add_scalar("val_ndcg@10", ndcg, step)
        save_checkpoint(last, model, optimizer, scheduler, epoch, best)
        if ndcg >= best:
            save_checkpoint(os.path.join(ckpt_dir, "best.pt"), model, optimizer, scheduler, epoch, best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
