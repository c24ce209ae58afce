#!/usr/bin/env python3
"""
GLDv2-clean landmark recognition, timm backbone + GeM + ArcFace margin head.
Two 8xA100 nodes:

  node0$ torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=10.0.0.11 \
             --master_port=29500 15_landmark_arcface_multinode.py --cfg b5_512
  node1$ torchrun --nnodes=2 --nproc_per_node=8 --node_rank=1 --master_addr=10.0.0.11 \
             --master_port=29500 15_landmark_arcface_multinode.py --cfg b5_512
"""
import os
import math
import time
import argparse

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision.io import read_image, ImageReadMode
import torchvision.transforms.v2 as T
import timm

CFGS = {
    "b5_512": dict(backbone="tf_efficientnet_b5.ns_jft_in1k", size=512, emb=512, bs=24,
                   lr=1e-3, epochs=10, s=30.0, m=0.3),
    "r2_448": dict(backbone="resnest101e", size=448, emb=512, bs=32, lr=8e-4, epochs=12,
                   s=30.0, m=0.35),
}


def init_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = torch.cuda.device_count()
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", world_size=world_size, rank=local_rank)
    return local_rank, dist.get_rank(), dist.get_world_size()


class GLDDataset(Dataset):
    def __init__(self, df, root, size, train):
        self.paths = [f"{root}/{i[0]}/{i[1]}/{i[2]}/{i}.jpg" for i in df.id.values]
        self.labels = df.label.values
        if train:
            self.tf = T.Compose([T.RandomResizedCrop(size, scale=(0.5, 1.0), antialias=True),
                                 T.RandomHorizontalFlip(), T.ColorJitter(0.2, 0.2, 0.2)])
        else:
            self.tf = T.Compose([T.Resize(size, antialias=True), T.CenterCrop(size)])
        self.norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = read_image(self.paths[i], ImageReadMode.RGB)
        return self.norm(self.tf(img).float().div_(255)), self.labels[i], i


class GeM(nn.Module):
    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p = nn.Parameter(torch.ones(1) * p)
        self.eps = eps

    def forward(self, x):
        return F.avg_pool2d(x.clamp(min=self.eps).pow(self.p), x.shape[-2:]).pow(1.0 / self.p)


class ArcMarginProduct(nn.Module):
    def __init__(self, in_f, out_f, s, m):
        super().__init__()
        self.W = nn.Parameter(torch.empty(out_f, in_f))
        nn.init.xavier_uniform_(self.W)
        self.s, self.m = s, m
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th = math.cos(math.pi - m)
        self.mm = math.sin(math.pi - m) * m

    def forward(self, emb, label):
        cosine = F.linear(F.normalize(emb), F.normalize(self.W)).float()
        sine = torch.sqrt((1.0 - cosine ** 2).clamp(0, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where(cosine > self.th, phi, cosine - self.mm)
        onehot = F.one_hot(label, cosine.size(1)).float()
        return self.s * (onehot * phi + (1 - onehot) * cosine), cosine


class LandmarkNet(nn.Module):
    def __init__(self, c, n_classes):
        super().__init__()
        self.backbone = timm.create_model(c["backbone"], pretrained=True, num_classes=0,
                                          global_pool="")
        self.pool = GeM()
        self.neck = nn.Sequential(nn.Linear(self.backbone.num_features, c["emb"]),
                                  nn.BatchNorm1d(c["emb"]), nn.PReLU())
        self.arc = ArcMarginProduct(c["emb"], n_classes, c["s"], c["m"])

    def forward(self, x, y):
        f = self.pool(self.backbone(x)).flatten(1)
        return self.arc(self.neck(f), y)


def gap_score(pred, conf, true):
    order = np.argsort(-conf)
    correct = (pred[order] == true[order]).astype(np.float64)
    prec = np.cumsum(correct) / np.arange(1, len(correct) + 1)
    return float((prec * correct).sum() / len(true))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default="b5_512", choices=list(CFGS))
    ap.add_argument("--root", default="/shared/gldv2/train")
    ap.add_argument("--csv", default="/shared/gldv2/train_clean_split.csv")
    ap.add_argument("--out", default="/shared/exp/landmark")
    args = ap.parse_args()
    c = CFGS[args.cfg]

    local_rank, rank, world = init_distributed()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    df = pd.read_csv(args.csv)
    n_classes = int(df.label.max()) + 1
    tr, va = df[df.split == "train"], df[df.split == "valid"].reset_index(drop=True)
    ds_tr = GLDDataset(tr, args.root, c["size"], True)
    ds_va = GLDDataset(va, args.root, c["size"], False)
    s_tr = DistributedSampler(ds_tr, shuffle=True, drop_last=True)
    s_va = DistributedSampler(ds_va, shuffle=False)
    dl_tr = DataLoader(ds_tr, c["bs"], sampler=s_tr, num_workers=10, pin_memory=True,
                       drop_last=True, persistent_workers=True)
    dl_va = DataLoader(ds_va, c["bs"] * 2, sampler=s_va, num_workers=10, pin_memory=True)

    model = LandmarkNet(c, n_classes).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=c["lr"], momentum=0.9, weight_decay=1e-5)
    total = c["epochs"] * len(dl_tr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=c["lr"], total_steps=total,
                                                pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler()
    ce = nn.CrossEntropyLoss()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for ep in range(c["epochs"]):
        s_tr.set_epoch(ep)
        model.train()
        t0 = time.time()
        for it, (x, y, _) in enumerate(dl_tr):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                logits, _ = model(x, y)
                loss = ce(logits, y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"ep {ep} it {it}/{len(dl_tr)} loss {loss.item():.3f}", flush=True)

        model.eval()
        rows = []
        with torch.no_grad():
            for x, y, i in dl_va:
                x, y = x.to(device), y.to(device)
                with torch.cuda.amp.autocast():
                    _, cos = model(x, y)
                conf, pred = cos.max(1)
                rows.append(torch.stack([i.to(device).double(), pred.double(), conf.double()], 1).cpu())
        part = torch.cat(rows).numpy()
        allp = [None] * world
        dist.all_gather_object(allp, part)
        if rank == 0:
            arr = np.concatenate(allp)
            _, k = np.unique(arr[:, 0], return_index=True)
            arr = arr[k]
            gap = gap_score(arr[:, 1].astype(int), arr[:, 2], va.label.values[arr[:, 0].astype(int)])
            print(f"epoch {ep} GAP {gap:.4f} time {time.time() - t0:.0f}s", flush=True)
            if gap > best:
                best = gap
                torch.save(model.module.state_dict(), f"{args.out}/{args.cfg}_best.pth")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
