"""Happywhale - individual ID with ArcFace + EfficientNet-B5 embeddings.

Two nodes x 4 GPUs:
    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        19_happywhale_arcface_llrd.py --cfg cfgs/effb5_arc.yaml
"""
import argparse
import datetime
import math
import os

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


class WhaleDS(Dataset):
    def __init__(self, df, img_dir, size, train):
        self.paths = [os.path.join(img_dir, f) for f in df.image]
        self.labels = df.label_id.values
        aug = [T.RandomResizedCrop(size, scale=(0.8, 1.0)), T.RandomHorizontalFlip(),
               T.ColorJitter(0.2, 0.2, 0.2)] if train else [T.Resize((size, size))]
        self.tf = T.Compose(aug + [T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB")), int(self.labels[i])


class ArcMarginProduct(nn.Module):
    def __init__(self, in_f, out_f, s=30.0, m=0.5):
        super().__init__()
        self.W = nn.Parameter(torch.empty(out_f, in_f))
        nn.init.xavier_uniform_(self.W)
        self.s, self.cos_m, self.sin_m = s, math.cos(m), math.sin(m)
        self.th, self.mm = math.cos(math.pi - m), math.sin(math.pi - m) * m

    def forward(self, emb, label):
        cosine = F.linear(F.normalize(emb), F.normalize(self.W)).float()
        sine = torch.sqrt((1.0 - cosine ** 2).clamp(0, 1))
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where(cosine > self.th, phi, cosine - self.mm)
        one_hot = F.one_hot(label, cosine.size(1)).float()
        return self.s * (one_hot * phi + (1.0 - one_hot) * cosine)


class WhaleNet(nn.Module):
    def __init__(self, backbone, weights, n_ids, emb_dim=512):
        super().__init__()
        self.backbone = timm.create_model(backbone, pretrained=False, num_classes=0, global_pool="")
        if weights:
            self.backbone.load_state_dict(torch.load(weights, map_location="cpu"), strict=False)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.neck = nn.Sequential(nn.Linear(self.backbone.num_features, emb_dim), nn.BatchNorm1d(emb_dim))
        self.arc = ArcMarginProduct(emb_dim, n_ids)

    def extract(self, x):
        return self.neck(self.pool(self.backbone(x)).flatten(1))

    def forward(self, x, label):
        return self.arc(self.extract(x), label)

    def param_groups(self, lr, backbone_mult):
        return [
            {"params": self.backbone.parameters(), "lr": lr * backbone_mult},
            {"params": list(self.neck.parameters()) + list(self.arc.parameters()), "lr": lr},
        ]


@torch.no_grad()
def embed(net, loader, device):
    net.eval()
    out = []
    for x, _ in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out.append(F.normalize(net.extract(x.to(device)).float()).cpu())
    return torch.cat(out)


def map5(gallery, g_lab, query, q_lab):
    sims = query @ gallery.T
    top = sims.topk(50, dim=1).indices
    score = 0.0
    for i in range(len(query)):
        seen = []
        for j in top[i].tolist():
            lab = g_lab[j]
            if lab not in seen:
                seen.append(lab)
            if len(seen) == 5:
                break
        if q_lab[i] in seen:
            score += 1.0 / (seen.index(q_lab[i]) + 1)
    return score / len(query)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # long timeout: rank 0 runs the retrieval eval alone while the others sit in the barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    df = pd.read_csv(cfg["csv"])
    df["label_id"] = df.individual_id.astype("category").cat.codes
    trn, val = df[df.fold != cfg["fold"]], df[df.fold == cfg["fold"]]
    tr_ds = WhaleDS(trn, cfg["img_dir"], cfg["size"], train=True)
    sampler = DistributedSampler(tr_ds, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr_ds, batch_size=cfg["bs"], sampler=sampler, num_workers=8, pin_memory=True,
                       drop_last=True)

    model = WhaleNet(cfg["backbone"], cfg.get("weights"), int(df.label_id.max()) + 1).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.param_groups(cfg["lr"], cfg["backbone_lr_mult"]), weight_decay=1e-4)
    total = cfg["epochs"] * len(tr_dl)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=[cfg["lr"] * cfg["backbone_lr_mult"], cfg["lr"]], total_steps=total, pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for step, (x, y) in enumerate(tr_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x, y)
            loss = F.cross_entropy(logits.float(), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} {step}/{len(tr_dl)} loss {loss.item():.3f}", flush=True)

        if rank == 0 and ((epoch + 1) % cfg.get("eval_every", 2) == 0 or epoch == cfg["epochs"] - 1):
            # single-process retrieval eval on rank 0; the other ranks wait at the barrier below
            g_dl = DataLoader(WhaleDS(trn, cfg["img_dir"], cfg["size"], False), batch_size=128, num_workers=8)
            q_dl = DataLoader(WhaleDS(val, cfg["img_dir"], cfg["size"], False), batch_size=128, num_workers=8)
            g, q = embed(model.module, g_dl, device), embed(model.module, q_dl, device)
            score = map5(g, trn.label_id.values, q, val.label_id.values)
            print(f"epoch {epoch} MAP@5 {score:.4f}", flush=True)
            os.makedirs(cfg["out_dir"], exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(cfg["out_dir"], f"arc_fold{cfg['fold']}_ep{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
