"""Supervised contrastive metric learning on Stanford Online Products.

Embeddings from all GPUs are gathered so every rank sees the full global batch
of positives / negatives. Evaluation is Recall@K over the 60,502 test images.

    torchrun --nproc_per_node=4 06_supcon_sop_retrieval.py --root /data/Stanford_Online_Products
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
import timm
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/Stanford_Online_Products")
    ap.add_argument("--model", default="vit_small_patch16_224.dino")
    ap.add_argument("--embed-dim", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--head-lr-mult", type=float, default=100.0)
    ap.add_argument("--temperature", type=float, default=0.07)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--save", default="runs/supcon_sop")
    return ap.parse_args()


class SOP(Dataset):
    def __init__(self, root, split, transform):
        info = os.path.join(root, "Ebay_train.txt" if split == "train" else "Ebay_test.txt")
        with open(info) as f:
            lines = [l.split() for l in f.read().splitlines()[1:]]
        self.paths = [os.path.join(root, l[3]) for l in lines]
        classes = sorted({int(l[1]) for l in lines})
        cmap = {c: i for i, c in enumerate(classes)}
        self.labels = [cmap[int(l[1])] for l in lines]
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("RGB")
        return self.transform(img), self.labels[i], i


class TwoCrop:
    def __init__(self, tf):
        self.tf = tf

    def __call__(self, x):
        return torch.stack([self.tf(x), self.tf(x)])


class Embedder(nn.Module):
    def __init__(self, name, embed_dim):
        super().__init__()
        self.backbone = timm.create_model(name, pretrained=True, num_classes=0)
        self.head = nn.Linear(self.backbone.num_features, embed_dim)

    def forward(self, x):
        return F.normalize(self.head(self.backbone(x)), dim=-1)


def supcon_loss(z, labels, temperature):
    """z: (N, 2, D) normalised views; labels: (N,). Computed over the global batch."""
    n = z.size(0)
    feats = torch.cat(z.unbind(1), dim=0)
    labels = labels.repeat(2)
    logits = feats @ feats.t() / temperature
    self_mask = torch.eye(2 * n, dtype=torch.bool, device=z.device)
    logits = logits.masked_fill(self_mask, -1e9)
    pos_mask = (labels[:, None] == labels[None, :]) & ~self_mask
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    mean_log_prob_pos = (log_prob * pos_mask).sum(1) / pos_mask.sum(1).clamp(min=1)
    return -mean_log_prob_pos.mean()


def train_one_epoch(model, loader, optimizer, scheduler, scaler, args, epoch, device, rank):
    model.train()
    world = dist.get_world_size()
    t0 = time.time()
    for it, (views, labels, _) in enumerate(loader):
        views = views.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        b = views.size(0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            z = model(views.flatten(0, 1)).float().view(b, 2, -1)
        # autograd-aware gather: gradients flow back to the rank that produced them
        z_all = torch.cat(dist_fn.all_gather(z), dim=0)
        labels_all = [torch.empty_like(labels) for _ in range(world)]
        dist.all_gather(labels_all, labels)
        loss = supcon_loss(z_all, torch.cat(labels_all), args.temperature)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        if rank == 0 and it % 50 == 0:
            print(f"epoch {epoch} it {it}/{len(loader)} loss {loss.item():.4f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)


@torch.no_grad()
def recall_at_k(model, loader, device, ks=(1, 10, 100, 1000)):
    model.eval()
    feats, labels, idxs = [], [], []
    for x, y, i in loader:
        feats.append(model(x.to(device, non_blocking=True)))
        labels.append(y.to(device))
        idxs.append(i.to(device))
    feats, labels, idxs = torch.cat(feats), torch.cat(labels), torch.cat(idxs)
    world = dist.get_world_size()
    gathered = []
    for t in (feats, labels, idxs):
        buf = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(buf, t)
        gathered.append(torch.cat(buf))
    feats, labels, idxs = gathered
    # DistributedSampler pads with repeated samples: keep one copy of each index
    order = torch.argsort(idxs)
    keep = torch.ones_like(order, dtype=torch.bool)
    keep[1:] = idxs[order][1:] != idxs[order][:-1]
    feats, labels = feats[order][keep], labels[order][keep]
    recalls = {k: 0.0 for k in ks}
    for s in range(0, feats.size(0), 4096):
        sim = feats[s:s + 4096] @ feats.t()
        sim[torch.arange(sim.size(0)), torch.arange(s, s + sim.size(0))] = -float("inf")
        top = sim.topk(max(ks), dim=1).indices
        hit = labels[top] == labels[s:s + 4096, None]
        for k in ks:
            recalls[k] += hit[:, :k].any(1).float().sum().item()
    model.train()
    return {k: v / feats.size(0) for k, v in recalls.items()}


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.2, 1.0)),
                                   transforms.RandomHorizontalFlip(),
                                   transforms.ColorJitter(0.4, 0.4, 0.4, 0.1),
                                   transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                  transforms.ToTensor(), norm])
    train_set = SOP(args.root, "train", TwoCrop(train_tf))
    test_set = SOP(args.root, "test", test_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=256, num_workers=args.workers, pin_memory=True,
                             sampler=DistributedSampler(test_set, shuffle=False))

    model = Embedder(args.model, args.embed_dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW([
        {"params": model.module.backbone.parameters(), "lr": args.lr},
        {"params": model.module.head.parameters(), "lr": args.lr * args.head_lr_mult},
    ], weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * len(train_loader))
    scaler = torch.cuda.amp.GradScaler(enabled=False)

    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
    best_r1 = 0.0
    for epoch in range(args.epochs):
        train_one_epoch(model, train_loader, optimizer, scheduler, scaler, args, epoch, device, rank)
        rec = recall_at_k(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"R@{k}={v:.4f}" for k, v in rec.items()), flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(args.save, "last.pt"))
            if rec[1] > best_r1:
                best_r1 = rec[1]
                torch.save(model.module.state_dict(), os.path.join(args.save, "best.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
