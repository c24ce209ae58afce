# -*- coding: utf-8 -*-
"""
ESMM 多任务模型 (CTR + CTCVR), 单机多卡 DDP.

启动: torchrun --standalone --nproc_per_node=8 --max-restarts=3 14_esmm_ctr_cvr.py \
        --data-dir /data/rec/ali_ccp --save-dir /data/rec/ckpt/esmm
进程挂掉后 torchrun 会自动重启, 脚本从 save-dir 里的 last.pt 继续.
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--emb-dim", type=int, default=16)
    p.add_argument("--bs", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--log-every", type=int, default=200)
    return p.parse_args()


class CCPData(Dataset):
    """预处理好的 npz: sparse 特征 id (已经 hash 到各字段的词表内), click, conversion."""

    def __init__(self, path):
        d = np.load(path)
        self.x = torch.from_numpy(d["feat"].astype(np.int64))
        self.click = torch.from_numpy(d["click"].astype(np.float32))
        self.conv = torch.from_numpy(d["conv"].astype(np.float32))

    def __len__(self):
        return self.x.size(0)

    def __getitem__(self, i):
        return self.x[i], self.click[i], self.conv[i]


class Tower(nn.Module):
    def __init__(self, d_in):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, 360), nn.ReLU(), nn.Linear(360, 200),
                                 nn.ReLU(), nn.Linear(200, 80), nn.ReLU(), nn.Linear(80, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


class ESMM(nn.Module):
    def __init__(self, field_sizes, emb_dim):
        super().__init__()
        # 两个 tower 共享 embedding
        self.embs = nn.ModuleList([nn.Embedding(n, emb_dim) for n in field_sizes])
        d = emb_dim * len(field_sizes)
        self.ctr = Tower(d)
        self.cvr = Tower(d)

    def forward(self, x):
        e = torch.cat([emb(x[:, i]) for i, emb in enumerate(self.embs)], dim=1)
        p_ctr = torch.sigmoid(self.ctr(e))
        p_cvr = torch.sigmoid(self.cvr(e))
        return p_ctr, p_ctr * p_cvr  # pCTR, pCTCVR


@torch.no_grad()
def evaluate(model, loader, device, rank, world):
    model.eval()
    preds, labels = [], []
    for x, c, v in loader:
        p_ctr, p_ctcvr = model.module(x.to(device, non_blocking=True))
        preds.append(torch.stack([p_ctr, p_ctcvr], 1))
        labels.append(torch.stack([c, c * v], 1).to(device))
    preds, labels = torch.cat(preds), torch.cat(labels)
    # 各 rank 样本数可能差一个, 先 gather 到 rank 0 再算 AUC
    gathered_p = [None] * world if rank == 0 else None
    gathered_l = [None] * world if rank == 0 else None
    dist.gather_object(preds.cpu(), gathered_p, dst=0)
    dist.gather_object(labels.cpu(), gathered_l, dst=0)
    model.train()
    if rank != 0:
        return None
    P, L = torch.cat(gathered_p).numpy(), torch.cat(gathered_l).numpy()
    return roc_auc_score(L[:, 0], P[:, 0]), roc_auc_score(L[:, 1], P[:, 1])


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    field_sizes = np.load(os.path.join(args.data_dir, "field_sizes.npy")).tolist()
    train_ds = CCPData(os.path.join(args.data_dir, "train.npz"))
    test_ds = CCPData(os.path.join(args.data_dir, "test.npz"))
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=2024, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler,
                          num_workers=4, pin_memory=True, drop_last=True)
    test_dl = DataLoader(torch.utils.data.Subset(test_ds, range(rank, len(test_ds), world)),
                         batch_size=args.bs * 4, num_workers=4, pin_memory=True)

    model = DDP(ESMM(field_sizes, args.emb_dim).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    bce = nn.BCELoss()

    os.makedirs(args.save_dir, exist_ok=True)
    last = os.path.join(args.save_dir, "last.pt")
    start_epoch, best_auc = 0, 0.0
    if os.path.exists(last):
        ck = torch.load(last, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start_epoch, best_auc = ck["epoch"] + 1, ck["best_auc"]
        if rank == 0:
            print(f"断点续训: 从 epoch {start_epoch} 开始", flush=True)

    # 恢复训练时 sampler 也要对齐 epoch
    train_sampler.set_epoch(start_epoch)
    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        agg = torch.zeros(3, device=device)
        for step, (x, c, v) in enumerate(train_dl):
            x, c, v = x.to(device, non_blocking=True), c.to(device, non_blocking=True), \
                v.to(device, non_blocking=True)
            p_ctr, p_ctcvr = model(x)
            # ESMM: CTR 用点击监督, CTCVR 用 点击*转化 监督, CVR 塔不直接监督
            loss_ctr = bce(p_ctr.clamp(1e-7, 1 - 1e-7), c)
            loss_ctcvr = bce(p_ctcvr.clamp(1e-7, 1 - 1e-7), c * v)
            loss = loss_ctr + loss_ctcvr
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([loss_ctr.detach(), loss_ctcvr.detach(), torch.ones((), device=device)])
            if rank == 0 and step % args.log_every == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} ctr {loss_ctr.item():.4f} "
                      f"ctcvr {loss_ctcvr.item():.4f}", flush=True)
        dist.all_reduce(agg)

        res = evaluate(model, test_dl, device, rank, world)
        if rank == 0:
            ctr_auc, ctcvr_auc = res
            print(f"[epoch {epoch}] loss_ctr {(agg[0] / agg[2]).item():.4f} "
                  f"loss_ctcvr {(agg[1] / agg[2]).item():.4f} CTR-AUC {ctr_auc:.4f} "
                  f"CTCVR-AUC {ctcvr_auc:.4f} 用时 {time.time() - t0:.0f}s", flush=True)
            if ctcvr_auc > best_auc:
                best_auc = ctcvr_auc
                torch.save(model.module.state_dict(), os.path.join(args.save_dir, "best.pt"))
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch, "best_auc": best_auc}, last + ".tmp")
            os.replace(last + ".tmp", last)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
