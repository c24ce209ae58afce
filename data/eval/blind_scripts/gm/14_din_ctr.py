# -*- coding: utf-8 -*-
"""
电商详情页"猜你喜欢" DIN 模型训练（Deep Interest Network）

特征：
    user 侧：user_id / 年龄段 / 性别 / 城市等级
    行为序列：最近 50 个点击商品 id 及其类目 id
    target item：商品 id / 类目 id / 店铺 id
启动：
    python -m torch.distributed.run --nproc_per_node=8 14_din_ctr.py --cfg configs/din_guess_like.yaml
"""
import os
import sys
import time
import argparse
import logging

import yaml
import numpy as np
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from sklearn.metrics import roc_auc_score

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common.dashboard import report  # noqa: E402

logger = logging.getLogger("din")


def reduce_mean(t, world_size):
    rt = t.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    return rt / world_size


class DinDataset(Dataset):
    def __init__(self, npz_path):
        d = np.load(npz_path)
        self.user = d["user"].astype(np.int64)           # N, 4
        self.hist_item = d["hist_item"].astype(np.int64)  # N, 50
        self.hist_cate = d["hist_cate"].astype(np.int64)  # N, 50
        self.target = d["target"].astype(np.int64)       # N, 3
        self.label = d["label"].astype(np.float32)

    def __len__(self):
        return len(self.label)

    def __getitem__(self, i):
        return self.user[i], self.hist_item[i], self.hist_cate[i], self.target[i], self.label[i]


class Dice(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.bn = nn.BatchNorm1d(dim, affine=False)
        self.alpha = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        shape = x.shape
        p = torch.sigmoid(self.bn(x.reshape(-1, shape[-1]))).reshape(shape)
        return p * x + (1 - p) * self.alpha * x


class AttentionUnit(nn.Module):
    def __init__(self, dim, hidden=(80, 40)):
        super().__init__()
        layers, d = [], dim * 4
        for h in hidden:
            layers += [nn.Linear(d, h), Dice(h)]
            d = h
        layers.append(nn.Linear(d, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, query, keys, mask):
        q = query.unsqueeze(1).expand_as(keys)
        att = self.mlp(torch.cat([q, keys, q - keys, q * keys], dim=-1)).squeeze(-1)
        att = att.masked_fill(~mask, 0.0)   # DIN 原文不做 softmax
        return (att.unsqueeze(-1) * keys).sum(1)


class DIN(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["emb_dim"]
        self.user_embs = nn.ModuleList([nn.Embedding(v, d) for v in cfg["user_vocab"]])
        self.item_emb = nn.Embedding(cfg["item_vocab"], d, padding_idx=0)
        self.cate_emb = nn.Embedding(cfg["cate_vocab"], d, padding_idx=0)
        self.shop_emb = nn.Embedding(cfg["shop_vocab"], d)
        self.att = AttentionUnit(2 * d)
        in_dim = len(cfg["user_vocab"]) * d + 2 * d + 3 * d
        layers = []
        for h in cfg["mlp"]:
            layers += [nn.Linear(in_dim, h), Dice(h)]
            in_dim = h
        layers.append(nn.Linear(in_dim, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, user, hist_item, hist_cate, target):
        u = torch.cat([e(user[:, i]) for i, e in enumerate(self.user_embs)], dim=-1)
        keys = torch.cat([self.item_emb(hist_item), self.cate_emb(hist_cate)], dim=-1)
        t_item, t_cate, t_shop = self.item_emb(target[:, 0]), self.cate_emb(target[:, 1]), self.shop_emb(target[:, 2])
        query = torch.cat([t_item, t_cate], dim=-1)
        interest = self.att(query, keys, hist_item > 0)
        x = torch.cat([u, interest, t_item, t_cate, t_shop], dim=-1)
        return self.mlp(x).squeeze(-1)


@torch.no_grad()
def evaluate(model, dataset, device, bs):
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    idx = list(range(rank, len(dataset), world))
    loader = DataLoader(torch.utils.data.Subset(dataset, idx), batch_size=bs, num_workers=4)
    preds = []
    for user, hi, hc, tgt, _ in loader:
        logit = model.module(user.to(device), hi.to(device), hc.to(device), tgt.to(device))
        preds.append(torch.sigmoid(logit).float().cpu())
    preds = torch.cat(preds).numpy() if preds else np.zeros(0, dtype=np.float32)
    gathered = [None] * world
    dist.all_gather_object(gathered, (idx, preds))
    model.train()
    all_idx = np.concatenate([np.asarray(g[0], dtype=np.int64) for g in gathered])
    all_pred = np.concatenate([g[1] for g in gathered])
    return roc_auc_score(dataset.label[all_idx], all_pred)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(parser.parse_args().cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    train_set = DinDataset(cfg["train_npz"])
    val_set = DinDataset(cfg["val_npz"])
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)

    model = DIN(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    criterion = nn.BCEWithLogitsLoss()

    step, best_auc = 0, 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for user, hi, hc, tgt, label in loader:
            user, hi, hc, tgt, label = [x.to(device, non_blocking=True) for x in (user, hi, hc, tgt, label)]
            loss = criterion(model(user, hi, hc, tgt), label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1

            if rank == 0 and step % cfg["log_interval"] == 0:
                avg_loss = reduce_mean(loss.detach(), world).item()
                cost = time.time() - t0
                logger.info("epoch %d step %d loss %.5f %.0f samples/s", epoch, step, avg_loss,
                            cfg["log_interval"] * cfg["batch_size"] * world / cost)
                report("din_guess_like", {"loss": avg_loss}, step)
                t0 = time.time()

        auc = evaluate(model, val_set, device, cfg["batch_size"] * 2)
        if rank == 0:
            logger.info("epoch %d val AUC %.5f", epoch, auc)
            report("din_guess_like", {"val_auc": auc}, step)
            os.makedirs(cfg["save_dir"], exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(cfg["save_dir"], "din_epoch%d.pt" % epoch))
            if auc > best_auc:
                best_auc = auc
                torch.save(model.module.state_dict(), os.path.join(cfg["save_dir"], "din_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
