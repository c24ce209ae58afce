"""Product catalog retrieval: ConvNeXt embedder, multi-similarity loss with cross-batch memory.

The catalog CSV has one row per image (product_id,image_path). Held-out products are
split into query/gallery images for recall@K.

    torchrun --nproc_per_node=8 05_catalog_retrieval_ms_xbm.py --catalog data/catalog.csv \
        --image-root /mnt/catalog/images --out runs/convnext_ms_xbm
"""
import argparse
import csv
import json
import os
import random
from collections import defaultdict

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--catalog", required=True)
    ap.add_argument("--image-root", required=True)
    ap.add_argument("--out", default="runs/catalog")
    ap.add_argument("--model", default="convnext_tiny.fb_in22k")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--test-frac", type=float, default=0.2)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4, help="for a global batch of 512")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--mem-size", type=int, default=16384)
    ap.add_argument("--mem-warmup-epochs", type=int, default=1)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def split_catalog(csv_path, test_frac):
    by_pid = defaultdict(list)
    with open(csv_path) as f:
        for row in csv.DictReader(f):
            by_pid[row["product_id"]].append(row["image_path"])
    pids = sorted(p for p, imgs in by_pid.items() if len(imgs) >= 2)
    random.shuffle(pids)
    n_test = int(len(pids) * test_frac)
    test_pids, train_pids = pids[:n_test], pids[n_test:]
    label_of = {p: i for i, p in enumerate(train_pids)}
    train = [(img, label_of[p]) for p in train_pids for img in by_pid[p]]
    query, gallery = [], []
    for j, p in enumerate(test_pids):
        imgs = by_pid[p]
        query.append((imgs[0], j))
        gallery.extend((img, j) for img in imgs[1:])
    return train, query, gallery


class ImageList(Dataset):
    def __init__(self, root, items, transform):
        self.root, self.items, self.transform = root, items, transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        img = Image.open(os.path.join(self.root, path)).convert("RGB")
        return self.transform(img), label, i


class Embedder(nn.Module):
    def __init__(self, name, dim):
        super().__init__()
        self.backbone = timm.create_model(name, pretrained=True, num_classes=0)
        self.neck = nn.Sequential(nn.Linear(self.backbone.num_features, dim), nn.LayerNorm(dim))

    def forward(self, x):
        return F.normalize(self.neck(self.backbone(x)), dim=-1)


def ms_loss(x, y, ref_x, ref_y, alpha=2.0, beta=50.0, base=0.5, margin=0.1, self_in_ref=False):
    sim = x @ ref_x.T
    same = y[:, None] == ref_y[None, :]
    if self_in_ref:
        same = same & ~torch.eye(len(x), dtype=torch.bool, device=x.device)
    diff = y[:, None] != ref_y[None, :]
    losses = []
    for i in range(len(x)):
        pos, neg = sim[i][same[i]], sim[i][diff[i]]
        if pos.numel() == 0 or neg.numel() == 0:
            losses.append(sim[i].sum() * 0.0)
            continue
        neg = neg[neg + margin > pos.min()]
        pos = pos[pos - margin < sim[i][diff[i]].max()]
        if pos.numel() == 0 or neg.numel() == 0:
            losses.append(sim[i].sum() * 0.0)
            continue
        lp = torch.log1p(torch.exp(-alpha * (pos - base)).sum()) / alpha
        ln = torch.log1p(torch.exp(beta * (neg - base)).sum()) / beta
        losses.append(lp + ln)
    return torch.stack(losses).mean()


@torch.no_grad()
def gather_cat(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


@torch.no_grad()
def embed(model, dataset, args, device):
    loader = DataLoader(dataset, batch_size=128, num_workers=args.workers,
                        sampler=DistributedSampler(dataset, shuffle=False))
    feats, idx = [], []
    for x, _, i in loader:
        feats.append(model(x.to(device, non_blocking=True)))
        idx.append(i.to(device))
    feats, idx = gather_cat(torch.cat(feats)), gather_cat(torch.cat(idx))
    out = torch.empty(len(dataset), feats.shape[1], device=device)
    out[idx] = feats
    return out


@torch.no_grad()
def evaluate(model, query_ds, gallery_ds, args, device, ks=(1, 5, 10, 20)):
    model.eval()
    g = embed(model, gallery_ds, args, device)
    g_lab = torch.tensor([l for _, l in gallery_ds.items], device=device)
    q = embed(model, query_ds, args, device)
    q_lab = torch.tensor([l for _, l in query_ds.items], device=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(rank, len(q), world, device=device)
    top = (q[mine] @ g.T).topk(max(ks), dim=1).indices
    match = g_lab[top] == q_lab[mine][:, None]
    stats = torch.tensor([match[:, :k].any(1).sum().item() for k in ks] + [len(mine)],
                         dtype=torch.float64, device=device)
    dist.all_reduce(stats)
    model.train()
    return {f"R@{k}": 100.0 * (stats[i] / stats[-1]).item() for i, k in enumerate(ks)}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    # distinct augmentation stream on every rank
    seed_everything(args.seed + rank)

    train_items, query_items, gallery_items = split_catalog(args.catalog, args.test_frac)
    cfg = timm.data.resolve_data_config({}, model=args.model)
    norm = T.Normalize(cfg["mean"], cfg["std"])
    train_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.3, 1.0)), T.RandomHorizontalFlip(),
                          T.ColorJitter(0.2, 0.2, 0.2), T.ToTensor(), norm])
    test_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
    train_ds = ImageList(args.image_root, train_items, train_tf)
    query_ds = ImageList(args.image_root, query_items, test_tf)
    gallery_ds = ImageList(args.image_root, gallery_items, test_tf)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = DDP(Embedder(args.model, args.dim).to(device), device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    total = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total, pct_start=0.05)

    mem_x = torch.zeros(args.mem_size, args.dim, device=device)
    mem_y = torch.full((args.mem_size,), -1, dtype=torch.long, device=device)
    ptr, filled = 0, 0

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "split_sizes.json"), "w") as f:
            json.dump({"train": len(train_items), "query": len(query_items), "gallery": len(gallery_items)}, f)
    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for x, y, _ in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                emb = model(x)
            emb = emb.float()
            loss = ms_loss(emb, y, emb, y, self_in_ref=True)

            all_x, all_y = gather_cat(emb.detach()), gather_cat(y)
            n = all_x.shape[0]
            idx = (torch.arange(n, device=device) + ptr) % args.mem_size
            mem_x[idx], mem_y[idx] = all_x, all_y
            ptr, filled = (ptr + n) % args.mem_size, min(filled + n, args.mem_size)
            if epoch >= args.mem_warmup_epochs:
                loss = loss + ms_loss(emb, y, mem_x[:filled], mem_y[:filled])

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])

        dist.all_reduce(running)
        rec = evaluate(model.module, query_ds, gallery_ds, args, device)
        if rank == 0:
            print(f"epoch {epoch} loss {(running[0] / running[1]).item():.4f} "
                  + " ".join(f"{k}={v:.2f}" for k, v in rec.items()), flush=True)
            if rec["R@1"] > best:
                best = rec["R@1"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "recall": rec},
                           os.path.join(args.out, "best.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
