"""
ChestX-ray14 multi-label classification (ResNet-50), one process per GPU via mp.spawn.

    python 02_cxr14_resnet_spawn.py --data /datasets/nih_cxr14 --gpus 4
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
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

FINDINGS = [
    "Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia",
    "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia",
]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--gpus", type=int, default=None)
    ap.add_argument("--port", type=int, default=29511)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--bs", type=int, default=32, help="batch size per process")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--size", type=int, default=384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-dir", default="checkpoints/cxr14_r50")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


class CXR14(Dataset):
    def __init__(self, root, list_file, transform):
        meta = pd.read_csv(os.path.join(root, "Data_Entry_2017.csv"))
        with open(os.path.join(root, list_file)) as f:
            keep = set(line.strip() for line in f if line.strip())
        meta = meta[meta["Image Index"].isin(keep)].sort_values("Image Index").reset_index(drop=True)
        self.files = meta["Image Index"].tolist()
        y = np.zeros((len(meta), len(FINDINGS)), dtype=np.float32)
        for i, s in enumerate(meta["Finding Labels"]):
            for lab in s.split("|"):
                if lab in FINDINGS:
                    y[i, FINDINGS.index(lab)] = 1.0
        self.targets = y
        self.img_dir = os.path.join(root, "images")
        self.transform = transform

    def __len__(self):
        return len(self.files)

    def __getitem__(self, idx):
        img = Image.open(os.path.join(self.img_dir, self.files[idx])).convert("RGB")
        return self.transform(img), torch.from_numpy(self.targets[idx]), idx


def make_model():
    m = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
    m.fc = nn.Linear(m.fc.in_features, len(FINDINGS))
    return m


@torch.no_grad()
def validate(model, loader, rank, world_size, n_total):
    model.eval()
    local_p, local_y, local_i = [], [], []
    for x, y, idx in loader:
        x = x.cuda(rank, non_blocking=True)
        local_p.append(torch.sigmoid(model(x)).float())
        local_y.append(y.cuda(rank))
        local_i.append(idx.cuda(rank))
    p = torch.cat(local_p)
    y = torch.cat(local_y)
    i = torch.cat(local_i)

    # DistributedSampler pads every rank to the same length, so the shapes match
    ps = [torch.empty_like(p) for _ in range(world_size)]
    ys = [torch.empty_like(y) for _ in range(world_size)]
    iis = [torch.empty_like(i) for _ in range(world_size)]
    dist.all_gather(ps, p)
    dist.all_gather(ys, y)
    dist.all_gather(iis, i)
    model.train()

    p = torch.cat(ps).cpu().numpy()
    y = torch.cat(ys).cpu().numpy()
    i = torch.cat(iis).cpu().numpy()
    # drop the padded duplicates before computing AUC
    _, first = np.unique(i, return_index=True)
    p, y = p[first], y[first]
    assert len(p) == n_total
    return [roc_auc_score(y[:, k], p[:, k]) for k in range(len(FINDINGS))]


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(args.size, scale=(0.7, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), norm,
    ])
    val_tf = transforms.Compose([transforms.Resize((args.size, args.size)), transforms.ToTensor(), norm])

    train_set = CXR14(args.data, "train_val_list.txt", train_tf)
    val_set = CXR14(args.data, "test_list.txt", val_tf)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                       seed=args.seed)
    val_sampler = DistributedSampler(val_set, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.bs * 2, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = make_model()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda(rank)
    model = DDP(model, device_ids=[rank])

    # linear scaling from the 1-GPU recipe (bs 32, lr 3e-4)
    lr = args.lr * world_size
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    warmup = 500
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + np.cos(np.pi * min(s, total) / total)))

    start_epoch, best = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ck = torch.load(args.resume, map_location=f"cuda:{rank}")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}")

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        loss_sum = torch.zeros(2, device=f"cuda:{rank}")
        for step, (x, y, _) in enumerate(train_loader):
            x = x.cuda(rank, non_blocking=True)
            y = y.cuda(rank, non_blocking=True)
            logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
        dist.all_reduce(loss_sum)
        train_loss = (loss_sum[0] / loss_sum[1]).item()

        aucs = validate(model, val_loader, rank, world_size, len(val_set))
        mean_auc = float(np.mean(aucs))
        if rank == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f}  test mAUC {mean_auc:.4f}  "
                  f"({time.time() - tic:.0f}s)")
            ck = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                  "sched": sched.state_dict(), "epoch": epoch, "best": max(best, mean_auc)}
            torch.save(ck, os.path.join(args.ckpt_dir, "last.pth"))
            if mean_auc > best:
                torch.save(ck, os.path.join(args.ckpt_dir, "best.pth"))
        best = max(best, mean_auc)
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = get_args()
    world_size = args.gpus or torch.cuda.device_count()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
