# -*- coding: utf-8 -*-
"""
首页推荐 Wide&Deep 排序模型 —— 流式读取 HDFS 上的样本分片

训练样本量太大（单天 30 亿+），不能整体加载到内存，用 IterableDataset 按文件流式读取：
    每个 rank 负责 files[rank::world_size]，每个 dataloader worker 再在其中按 worker_id 切分。
启动：
    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=${MASTER_ADDR}:29500 \
        10_wide_deep_stream.py --config conf/wd_home.yaml
"""
import os
import time
import argparse
import logging

import yaml
import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import IterableDataset, DataLoader, get_worker_info
from sklearn.metrics import roc_auc_score

from rec_platform.fs import hdfs_list
from rec_platform.dashboard import MetricSender

logger = logging.getLogger("wd")


class ParquetStream(IterableDataset):
    def __init__(self, files, sparse_cols, dense_cols, label_col, batch_rows=4096):
        super().__init__()
        self.files = files
        self.sparse_cols = sparse_cols
        self.dense_cols = dense_cols
        self.label_col = label_col
        self.batch_rows = batch_rows

    def __iter__(self):
        info = get_worker_info()
        files = self.files if info is None else self.files[info.id::info.num_workers]
        cols = self.sparse_cols + self.dense_cols + [self.label_col]
        for path in files:
            pf = pq.ParquetFile(path)
            for rb in pf.iter_batches(batch_size=self.batch_rows, columns=cols):
                df = rb.to_pandas()
                sparse = torch.from_numpy(df[self.sparse_cols].values.astype(np.int64))
                dense = torch.from_numpy(df[self.dense_cols].values.astype(np.float32))
                label = torch.from_numpy(df[self.label_col].values.astype(np.float32))
                yield sparse, dense, label


class WideDeep(nn.Module):
    def __init__(self, vocab_sizes, num_dense, emb_dim=32, hidden=(1024, 512, 256)):
        super().__init__()
        self.wide = nn.ModuleList([nn.Embedding(v, 1) for v in vocab_sizes])
        self.deep_emb = nn.ModuleList([nn.Embedding(v, emb_dim) for v in vocab_sizes])
        layers, d = [], len(vocab_sizes) * emb_dim + num_dense
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        layers.append(nn.Linear(d, 1))
        self.deep = nn.Sequential(*layers)

    def forward(self, sparse, dense):
        wide = torch.stack([w(sparse[:, i]) for i, w in enumerate(self.wide)], dim=1).sum(dim=1)
        emb = torch.cat([e(sparse[:, i]) for i, e in enumerate(self.deep_emb)], dim=1)
        deep = self.deep(torch.cat([emb, dense], dim=1))
        return (wide + deep).squeeze(1)


@torch.no_grad()
def evaluate(model, files, cfg, device):
    """验证集文件同样按 rank 切分，预测结果 gather 到 rank0 计算 AUC"""
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    ds = ParquetStream(files[rank::world], cfg["sparse_cols"], cfg["dense_cols"], cfg["label_col"])
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    preds, labels = [], []
    for sparse, dense, label in loader:
        preds.append(torch.sigmoid(model.module(sparse.to(device), dense.to(device))).cpu().numpy())
        labels.append(label.numpy())
    local = (np.concatenate(preds) if preds else np.zeros(0), np.concatenate(labels) if labels else np.zeros(0))
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    model.train()
    if rank != 0:
        return None
    p = np.concatenate([g[0] for g in gathered])
    y = np.concatenate([g[1] for g in gathered])
    return roc_auc_score(y, p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(levelname)s] %(message)s")
    if rank != 0:
        logger.setLevel(logging.WARNING)
    torch.manual_seed(cfg["seed"])

    train_files = sorted(hdfs_list(cfg["train_path"], suffix=".parquet"))
    val_files = sorted(hdfs_list(cfg["val_path"], suffix=".parquet"))
    logger.info("训练文件 %d 个, 验证文件 %d 个, world_size %d", len(train_files), len(val_files), world)

    train_ds = ParquetStream(train_files[rank::world], cfg["sparse_cols"], cfg["dense_cols"],
                             cfg["label_col"], batch_rows=cfg["batch_size"])
    # dataset 内部已经按 batch 产出，这里 batch_size=None
    train_loader = DataLoader(train_ds, batch_size=None, num_workers=cfg["num_workers"],
                              pin_memory=True, prefetch_factor=4)

    model = WideDeep(cfg["vocab_sizes"], len(cfg["dense_cols"]), cfg["emb_dim"], tuple(cfg["hidden"])).to(device)
    model = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)

    sparse_params = [p for n, p in model.named_parameters() if "emb" in n or "wide" in n]
    dense_params = [p for n, p in model.named_parameters() if not ("emb" in n or "wide" in n)]
    optimizer = torch.optim.Adam([
        {"params": sparse_params, "lr": cfg["sparse_lr"]},
        {"params": dense_params, "lr": cfg["dense_lr"]},
    ])
    criterion = nn.BCEWithLogitsLoss()
    sender = MetricSender(job=cfg["job_name"]) if rank == 0 else None

    step = 0
    for epoch in range(cfg["epochs"]):
        model.train()
        t0, seen = time.time(), 0
        for sparse, dense, label in train_loader:
            sparse = sparse.to(device, non_blocking=True)
            dense = dense.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            loss = criterion(model(sparse, dense), label)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            seen += label.size(0)
            if step % cfg["log_every"] == 0:
                qps = seen * world / (time.time() - t0)
                logger.info("epoch %d step %d loss %.5f 全局QPS %.0f", epoch, step, loss.item(), qps)
                if sender:
                    sender.send({"loss": loss.item(), "qps": qps}, step)
                t0, seen = time.time(), 0

        auc = evaluate(model, val_files, cfg, device)
        if rank == 0:
            logger.info("epoch %d 验证 AUC %.5f", epoch, auc)
            sender.send({"val_auc": auc}, step)
            os.makedirs(cfg["ckpt_dir"], exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "step": step}, os.path.join(cfg["ckpt_dir"], "wd_epoch%d.pt" % epoch))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
