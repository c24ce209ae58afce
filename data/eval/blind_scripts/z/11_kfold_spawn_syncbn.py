# -*- coding: utf-8 -*-
"""
5 折交叉验证（二分类，病灶 / 非病灶），单机多卡 mp.spawn 启动。
每折：SyncBN ResNet50 训练 -> 每个 epoch 验证 AUC -> 早停 -> 用最优权重出 OOF 预测。
最后 rank 0 汇总所有折的 OOF，算整体 AUC。

python 11_kfold_spawn_syncbn.py --csv data/labels.csv --img-dir data/images --folds 5 --gpus 4
"""
import argparse
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torchvision
from PIL import Image
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True, help="两列: image_id,label")
    p.add_argument("--img-dir", required=True)
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16, help="每卡 batch，BN 用 SyncBN 同步统计量")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--img-size", type=int, default=512)
    p.add_argument("--out", default="cv_out")
    p.add_argument("--port", default="29611")
    p.add_argument("--seed", type=int, default=2024)
    return p.parse_args()


class LesionDataset(Dataset):
    def __init__(self, df, img_dir, tf):
        self.ids = df["image_id"].tolist()
        self.labels = df["label"].astype(np.float32).tolist()
        self.rows = df.index.tolist()  # 原始 csv 中的行号，OOF 回填用
        self.img_dir, self.tf = img_dir, tf

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, self.ids[i] + ".png")).convert("RGB")
        return self.tf(img), torch.tensor(self.labels[i]), self.rows[i]


def build_model():
    m = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V2)
    m.fc = nn.Linear(m.fc.in_features, 1)
    return m


@torch.no_grad()
def predict(model, loader, device, world_size):
    """返回去重后的 {csv 行号: 概率}，以及对应标签。DistributedSampler 的补齐样本在这里去掉。"""
    model.eval()
    local = []
    for x, y, rows in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logit = model(x.to(device, non_blocking=True)).squeeze(1)
        prob = torch.sigmoid(logit.float()).cpu().tolist()
        local.extend(zip(rows.tolist(), prob, y.tolist()))
    parts = [None] * world_size
    dist.all_gather_object(parts, local)
    merged = {}
    for part in parts:
        for r, p, y in part:
            merged[r] = (p, y)
    return merged


def run_fold(fold, tr_df, va_df, args, rank, world_size, device):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.img_size, scale=(0.7, 1.0)),
        transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip(),
        transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize((args.img_size, args.img_size)), transforms.ToTensor(), norm])

    tr_set, va_set = LesionDataset(tr_df, args.img_dir, train_tf), LesionDataset(va_df, args.img_dir, val_tf)
    tr_sampler = DistributedSampler(tr_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    va_sampler = DistributedSampler(va_set, num_replicas=world_size, rank=rank, shuffle=False)
    tr_loader = DataLoader(tr_set, batch_size=args.batch_size, sampler=tr_sampler, num_workers=4,
                           pin_memory=True, drop_last=True, persistent_workers=True)
    va_loader = DataLoader(va_set, batch_size=args.batch_size * 2, sampler=va_sampler, num_workers=4,
                           pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model()).to(device)
    model = DDP(model, device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.BCEWithLogitsLoss()
    best_path = os.path.join(args.out, f"fold{fold}_best.pth")

    best_auc, bad = -1.0, 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y, _ in tr_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x).squeeze(1), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        scheduler.step()

        merged = predict(model.module, va_loader, device, world_size)
        stop = torch.zeros(1, device=device)
        if rank == 0:
            probs = np.array([v[0] for v in merged.values()])
            ys = np.array([v[1] for v in merged.values()])
            auc = roc_auc_score(ys, probs)
            print(f"[折{fold}] epoch {epoch} 验证 AUC={auc:.4f} (n={len(ys)}) 用时 {time.time() - t0:.0f}s", flush=True)
            if auc > best_auc:
                best_auc, bad = auc, 0
                torch.save(model.module.state_dict(), best_path)
            else:
                bad += 1
                if bad >= args.patience:
                    print(f"[折{fold}] 连续 {bad} 个 epoch 没有提升，早停", flush=True)
                    stop.fill_(1)
        # rank 0 决定是否早停，广播给所有进程，保证大家一起退出循环
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            break

    dist.barrier()  # 等 rank 0 写完 best 权重
    state = torch.load(best_path, map_location=device)
    model.module.load_state_dict(state)
    return predict(model.module, va_loader, device, world_size)


def worker(rank, world_size, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = args.port
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    df = pd.read_csv(args.csv)
    skf = StratifiedKFold(n_splits=args.folds, shuffle=True, random_state=args.seed)
    oof = np.full(len(df), np.nan, dtype=np.float32)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    for fold, (tr_idx, va_idx) in enumerate(skf.split(df, df["label"])):
        merged = run_fold(fold, df.iloc[tr_idx], df.iloc[va_idx], args, rank, world_size, device)
        for r, (p, _) in merged.items():
            oof[r] = p
        if rank == 0:
            fold_auc = roc_auc_score(df.loc[va_idx, "label"], oof[va_idx])
            print(f"==== 折 {fold} 最优权重 OOF AUC: {fold_auc:.4f} ====", flush=True)

    if rank == 0:
        df["oof_prob"] = oof
        df.to_csv(os.path.join(args.out, "oof.csv"), index=False)
        print(f"全部 {args.folds} 折 OOF AUC: {roc_auc_score(df['label'], oof):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    assert args.gpus <= torch.cuda.device_count(), "指定的卡数超过了可用 GPU 数"
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
