# -*- coding: utf-8 -*-
"""
广告 CTR / CVR 联合建模 —— ESMM（Entire Space Multi-task Model）

pCTCVR = pCTR * pCVR，在曝光全空间上用 click 与 click&conversion 两个 label 监督。
验证指标：CTR AUC、CTCVR AUC，每个 epoch 上报到内部看板，按 CTCVR AUC 选最优模型。

启动：
    torchrun --nproc_per_node=8 20_esmm_ads.py --config configs/esmm_ads.yaml
"""
import os
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

from ads_ml.monitor import Dashboard

logger = logging.getLogger("esmm")


class AdsDataset(Dataset):
    def __init__(self, path, num_fields):
        d = np.load(path)
        self.feat = d["feat"].astype(np.int64)[:, :num_fields]
        self.click = d["click"].astype(np.float32)
        self.conv = d["conv"].astype(np.float32)

    def __len__(self):
        return len(self.click)

    def __getitem__(self, i):
        return self.feat[i], self.click[i], self.conv[i]


def mlp(in_dim, dims, dropout):
    layers = []
    for h in dims:
        layers += [nn.Linear(in_dim, h), nn.ReLU(), nn.Dropout(dropout)]
        in_dim = h
    layers.append(nn.Linear(in_dim, 1))
    return nn.Sequential(*layers)


class ESMM(nn.Module):
    def __init__(self, vocab_size, num_fields, emb_dim=12, tower=(360, 200, 80), dropout=0.1):
        super().__init__()
        # 所有 field 共享一张大表，特征 id 已经做过全局偏移
        self.embedding = nn.Embedding(vocab_size, emb_dim)
        nn.init.normal_(self.embedding.weight, std=1e-3)
        in_dim = num_fields * emb_dim
        self.ctr_tower = mlp(in_dim, tower, dropout)
        self.cvr_tower = mlp(in_dim, tower, dropout)

    def forward(self, feat):
        x = self.embedding(feat).flatten(1)
        p_ctr = torch.sigmoid(self.ctr_tower(x)).squeeze(1)
        p_cvr = torch.sigmoid(self.cvr_tower(x)).squeeze(1)
        return p_ctr, p_ctr * p_cvr


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    ctr_p, ctcvr_p, clicks, convs = [], [], [], []
    for feat, click, conv in loader:
        p_ctr, p_ctcvr = model.module(feat.to(device, non_blocking=True))
        ctr_p.append(p_ctr.cpu().numpy())
        ctcvr_p.append(p_ctcvr.cpu().numpy())
        clicks.append(click.numpy())
        convs.append(conv.numpy())
    model.train()
    clicks, convs = np.concatenate(clicks), np.concatenate(convs)
    ctr_auc = roc_auc_score(clicks, np.concatenate(ctr_p))
    ctcvr_auc = roc_auc_score(clicks * convs, np.concatenate(ctcvr_p))
    return ctr_auc, ctcvr_auc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(cfg["seed"])

    train_set = AdsDataset(cfg["train_path"], cfg["num_fields"])
    val_set = AdsDataset(cfg["val_path"], cfg["num_fields"])
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg["seed"])
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=cfg["batch_size"] * 4, sampler=val_sampler,
                            num_workers=cfg["num_workers"], pin_memory=True)
    logger.info("训练 %d 条 (ctr %.4f, cvr|click %.4f), 验证 %d 条", len(train_set), train_set.click.mean(),
                train_set.conv[train_set.click > 0].mean(), len(val_set))

    model = ESMM(cfg["vocab_size"], cfg["num_fields"], cfg["emb_dim"], tuple(cfg["tower"]), cfg["dropout"]).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    bce = nn.BCELoss()

    dashboard = Dashboard(app="ads_esmm", exp=cfg["exp_name"]) if rank == 0 else None
    if rank == 0:
        os.makedirs(cfg["save_dir"], exist_ok=True)

    best, step = 0.0, 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for feat, click, conv in train_loader:
            feat = feat.to(device, non_blocking=True)
            click = click.to(device, non_blocking=True)
            conv = conv.to(device, non_blocking=True)
            p_ctr, p_ctcvr = model(feat)
            loss_ctr = bce(p_ctr.clamp(1e-7, 1 - 1e-7), click)
            loss_ctcvr = bce(p_ctcvr.clamp(1e-7, 1 - 1e-7), click * conv)
            loss = loss_ctr + cfg["ctcvr_weight"] * loss_ctcvr
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % cfg["log_every"] == 0:
                logger.info("epoch %d step %d loss %.5f (ctr %.5f ctcvr %.5f) %.0f samples/s", epoch, step,
                            loss.item(), loss_ctr.item(), loss_ctcvr.item(),
                            cfg["log_every"] * cfg["batch_size"] * world / (time.time() - t0))
                t0 = time.time()

        ctr_auc, ctcvr_auc = evaluate(model, val_loader, device)
        if rank == 0:
            logger.info("epoch %d 验证 CTR AUC %.5f CTCVR AUC %.5f", epoch, ctr_auc, ctcvr_auc)
            dashboard.report({"ctr_auc": ctr_auc, "ctcvr_auc": ctcvr_auc}, step=epoch)
            torch.save(model.module.state_dict(), os.path.join(cfg["save_dir"], "esmm_epoch%d.pt" % epoch))
            if ctcvr_auc > best:
                best = ctcvr_auc
                torch.save(model.module.state_dict(), os.path.join(cfg["save_dir"], "esmm_best.pt"))
                logger.info("CTCVR AUC 提升到 %.5f, 已保存", best)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
