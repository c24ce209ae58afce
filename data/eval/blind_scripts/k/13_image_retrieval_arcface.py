"""Visual product search: ResNet-50 + ArcFace embedding model, evaluated with recall@k on a query/gallery split.

    torchrun --nproc_per_node=8 13_image_retrieval_arcface.py --cfg configs/retrieval_r50.yaml
"""
import argparse
import logging
import math
import os
from dataclasses import dataclass

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

log = logging.getLogger("retrieval")


@dataclass
class Cfg:
    image_root: str = "/data/products/images"
    train_csv: str = "/data/products/train.csv"
    query_csv: str = "/data/products/query.csv"
    gallery_csv: str = "/data/products/gallery.csv"
    embed_dim: int = 512
    margin: float = 0.3
    scale: float = 30.0
    batch_size: int = 96
    lr: float = 0.01
    epochs: int = 25
    eval_every: int = 5
    out_dir: str = "/ckpt/retrieval_r50"


class ImageCSV(Dataset):
    def __init__(self, csv, root, tf):
        df = pd.read_csv(csv)
        self.paths, self.labels = df["path"].tolist(), df["product_id"].astype("category").cat.codes.tolist()
        self.pids = df["product_id"].tolist()
        self.root, self.tf = root, tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, self.paths[i])).convert("RGB")
        return self.tf(img), self.labels[i], i


class ArcFaceHead(nn.Module):
    def __init__(self, dim, n_classes, s, m):
        super().__init__()
        self.W = nn.Parameter(torch.randn(n_classes, dim) * 0.01)
        self.s, self.m = s, m

    def forward(self, emb, labels):
        cos = F.linear(F.normalize(emb), F.normalize(self.W)).clamp(-1 + 1e-7, 1 - 1e-7)
        theta = torch.acos(cos)
        target = torch.cos(theta + self.m)
        onehot = F.one_hot(labels, cos.size(1)).bool()
        return self.s * torch.where(onehot, target, cos)


class EmbeddingNet(nn.Module):
    def __init__(self, dim, n_classes, s, m):
        super().__init__()
        backbone = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.neck = nn.Sequential(nn.Linear(2048, dim), nn.BatchNorm1d(dim))
        self.head = ArcFaceHead(dim, n_classes, s, m)

    def forward(self, x, labels=None):
        emb = self.neck(self.backbone(x))
        if labels is None:
            return F.normalize(emb, dim=-1)
        return self.head(emb, labels)


@torch.no_grad()
def embed_split(model, ds, device, rank, world_size):
    """Each rank embeds its own slice of the split; results are gathered on every rank."""
    shard = Subset(ds, list(range(rank, len(ds), world_size)))
    loader = DataLoader(shard, batch_size=256, num_workers=6, pin_memory=True)
    embs, idxs = [], []
    for x, _, idx in loader:
        embs.append(model(x.to(device, non_blocking=True)))
        idxs.append(idx.to(device))
    local_emb, local_idx = torch.cat(embs), torch.cat(idxs)
    all_emb = [torch.empty_like(local_emb) for _ in range(world_size)]
    all_idx = [torch.empty_like(local_idx) for _ in range(world_size)]
    dist.all_gather(all_emb, local_emb)
    dist.all_gather(all_idx, local_idx)
    emb, idx = torch.cat(all_emb), torch.cat(all_idx)
    return emb[idx.argsort()]


@torch.no_grad()
def recall_at_k(model, query_ds, gallery_ds, device, rank, world_size, ks=(1, 5, 10)):
    model.eval()
    q = embed_split(model, query_ds, device, rank, world_size)
    g = embed_split(model, gallery_ds, device, rank, world_size)
    q_pid = torch.tensor(pd.factorize(pd.Series(query_ds.pids + gallery_ds.pids))[0][: len(query_ds)], device=device)
    g_pid = torch.tensor(pd.factorize(pd.Series(query_ds.pids + gallery_ds.pids))[0][len(query_ds):], device=device)
    topk = (q @ g.T).topk(max(ks), dim=1).indices
    hits = g_pid[topk] == q_pid[:, None]
    model.train()
    return {f"R@{k}": hits[:, :k].any(1).float().mean().item() for k in ks}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = Cfg(**yaml.safe_load(open(ap.parse_args().cfg)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.5, 1.0)), T.RandomHorizontalFlip(),
                          T.ColorJitter(0.2, 0.2, 0.2), T.ToTensor(), norm])
    eval_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
    train_ds = ImageCSV(cfg.train_csv, cfg.image_root, train_tf)
    query_ds = ImageCSV(cfg.query_csv, cfg.image_root, eval_tf)
    gallery_ds = ImageCSV(cfg.gallery_csv, cfg.image_root, eval_tf)
    n_classes = max(train_ds.labels) + 1

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = EmbeddingNet(cfg.embed_dim, n_classes, cfg.scale, cfg.margin)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    params = [{"params": model.module.backbone.parameters(), "lr": cfg.lr * 0.1},
              {"params": list(model.module.neck.parameters()) + list(model.module.head.parameters())}]
    opt = torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * len(loader))
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        for it, (x, y, _) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x, y), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 50 == 0:
                log.info("epoch %d it %d loss %.4f", epoch, it, loss.item())
        if (epoch + 1) % cfg.eval_every == 0:
            metrics = recall_at_k(model.module, query_ds, gallery_ds, device, rank, world_size)
            if rank == 0:
                log.info("epoch %d %s", epoch, metrics)
                os.makedirs(cfg.out_dir, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics},
                           os.path.join(cfg.out_dir, f"epoch_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
