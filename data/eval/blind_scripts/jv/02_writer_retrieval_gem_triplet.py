"""Writer retrieval with a ResNet-34 + GeM embedding and a cross-GPU batch-hard triplet loss.

Trained on writer-disjoint splits of page crops (ICDAR17 historical WI style layout:
<root>/<writer_id>/<page>.png). Evaluation is leave-one-out retrieval mAP over all
validation pages, gathered from every rank.

    torchrun --nproc_per_node=8 02_writer_retrieval_ms_loss.py --root /data/icdar17 --out runs/wr_r34
"""
import argparse
import math
import os
import random
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="runs/wr_r34")
    ap.add_argument("--val-writers", type=float, default=0.15)
    ap.add_argument("--split-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--writers-per-batch", type=int, default=16, help="P, per GPU")
    ap.add_argument("--pages-per-writer", type=int, default=4, help="K")
    ap.add_argument("--crop", type=int, default=384)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--margin", type=float, default=0.2)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--iters-per-epoch", type=int, default=400, help="global batches per epoch")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def index_pages(root):
    items = []
    for writer in sorted(os.listdir(root)):
        wdir = os.path.join(root, writer)
        if not os.path.isdir(wdir):
            continue
        for fn in sorted(os.listdir(wdir)):
            if fn.lower().endswith((".png", ".jpg", ".tif")):
                items.append((os.path.join(wdir, fn), writer))
    return items


def writer_disjoint_split(items, frac, seed):
    writers = sorted({w for _, w in items})
    rng = random.Random(seed)
    rng.shuffle(writers)
    n_val = int(round(len(writers) * frac))
    val_w = set(writers[:n_val])
    train = [it for it in items if it[1] not in val_w]
    val = [it for it in items if it[1] in val_w]
    return train, val


class PageCrops(Dataset):
    def __init__(self, items, writer_to_label, crop, train):
        self.items = items
        self.labels = [writer_to_label[w] for _, w in items]
        self.crop = crop
        self.train = train
        norm = torchvision.transforms.Normalize([0.5], [0.5])
        if train:
            self.tf = torchvision.transforms.Compose([
                torchvision.transforms.RandomCrop(crop, pad_if_needed=True, fill=255),
                torchvision.transforms.RandomAffine(3, shear=5, fill=255),
                torchvision.transforms.ToTensor(), norm])
        else:
            self.tf = torchvision.transforms.Compose([
                torchvision.transforms.Resize(crop * 2),
                torchvision.transforms.CenterCrop(crop * 2),
                torchvision.transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img = Image.open(self.items[i][0]).convert("L")
        return self.tf(img), self.labels[i], i


class DistributedPKSampler(Sampler):
    """Builds the same list of P x K batches on every rank and hands each rank its own slice."""

    def __init__(self, labels, p, k, global_batches, rank, world, seed=0):
        self.by_label = defaultdict(list)
        for idx, lab in enumerate(labels):
            self.by_label[lab].append(idx)
        self.label_ids = sorted(self.by_label)
        self.p, self.k = p, k
        self.global_batches = global_batches - global_batches % world
        self.rank, self.world, self.seed = rank, world, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        batches = []
        for _ in range(self.global_batches):
            labs = rng.sample(self.label_ids, self.p)
            batch = []
            for lab in labs:
                pool = self.by_label[lab]
                batch.extend(rng.sample(pool, self.k) if len(pool) >= self.k else rng.choices(pool, k=self.k))
            batches.append(batch)
        for b in batches[self.rank::self.world]:
            yield b

    def __len__(self):
        return self.global_batches // self.world


class GeM(nn.Module):
    def __init__(self, p=3.0):
        super().__init__()
        self.p = nn.Parameter(torch.tensor(p))

    def forward(self, x):
        return F.adaptive_avg_pool2d(x.clamp(min=1e-6).pow(self.p), 1).pow(1.0 / self.p).flatten(1)


class WriterNet(nn.Module):
    def __init__(self, dim):
        super().__init__()
        r = torchvision.models.resnet34(weights="IMAGENET1K_V1")
        w = r.conv1.weight.sum(dim=1, keepdim=True)
        r.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)
        r.conv1.weight.data.copy_(w)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.pool = GeM()
        self.fc = nn.Linear(512, dim)

    def forward(self, x):
        return F.normalize(self.fc(self.pool(self.backbone(x))), dim=1)


def batch_hard_triplet(emb, labels, margin):
    d = torch.cdist(emb, emb)
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool, device=emb.device)
    hardest_pos = (d * (same & ~eye)).max(1).values
    hardest_neg = d.masked_fill(same, float("inf")).min(1).values
    return F.relu(hardest_pos - hardest_neg + margin).mean()


def gather_variable(t, world):
    """all_gather for tensors whose first dim differs between ranks."""
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros((max_n,) + t.shape[1:], dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])


def retrieval_map(emb, labels):
    sim = emb @ emb.t()
    sim.fill_diagonal_(-float("inf"))
    order = sim.argsort(dim=1, descending=True)[:, :-1]
    rel = (labels[order] == labels[:, None]).float()
    hits = rel.cumsum(1)
    ranks = torch.arange(1, rel.shape[1] + 1, device=emb.device).float()
    n_rel = rel.sum(1)
    ap = (hits / ranks * rel).sum(1) / n_rel.clamp(min=1)
    valid = n_rel > 0
    top1 = rel[:, 0]
    return ap[valid].mean().item(), top1[valid].mean().item()


@torch.no_grad()
def evaluate(model, val_ds, rank, world, device, workers):
    model.eval()
    idx = list(range(rank, len(val_ds), world))
    loader = DataLoader(torch.utils.data.Subset(val_ds, idx), batch_size=16, num_workers=workers)
    feats, labs, inds = [], [], []
    for x, y, i in loader:
        feats.append(model(x.to(device, non_blocking=True)))
        labs.append(y.to(device))
        inds.append(i.to(device))
    feats = gather_variable(torch.cat(feats), world)
    labs = gather_variable(torch.cat(labs), world)
    inds = gather_variable(torch.cat(inds), world)
    order = inds.argsort()
    model.train()
    return retrieval_map(feats[order], labs[order])


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    # per-rank seeds only drive augmentation; the writer split has its own RNG
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    items = index_pages(args.root)
    train_items, val_items = writer_disjoint_split(items, args.val_writers, args.split_seed)
    train_w = sorted({w for _, w in train_items})
    val_w = sorted({w for _, w in val_items})
    train_ds = PageCrops(train_items, {w: i for i, w in enumerate(train_w)}, args.crop, train=True)
    val_ds = PageCrops(val_items, {w: i for i, w in enumerate(val_w)}, args.crop, train=False)

    sampler = DistributedPKSampler(train_ds.labels, args.writers_per_batch, args.pages_per_writer,
                                   args.iters_per_epoch, rank, world, seed=args.seed)
    loader = DataLoader(train_ds, batch_sampler=sampler, num_workers=args.workers, pin_memory=True,
                        persistent_workers=True)

    torch.manual_seed(args.seed)  # identical init on every rank (DDP broadcasts anyway)
    if rank != 0:
        dist.barrier()  # rank 0 fetches the ImageNet weights into the torch hub cache first
    net = WriterNet(args.dim)
    if rank == 0:
        dist.barrier()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(model, device_ids=[local_rank])
    torch.manual_seed(args.seed + rank)

    lr = args.lr * world / 8  # reference lr was tuned on 8 GPUs
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    total = args.epochs * len(sampler)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 500) * 0.5 * (1 + math.cos(math.pi * s / total)))
    start_epoch, best = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]

    tb = SummaryWriter(args.out) if rank == 0 else None
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for it, (x, y, _) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            emb = model(x)
            # negatives from every GPU: differentiable all_gather, same P*K on each rank
            all_emb = torch.cat(dist_fn.all_gather(emb))
            ys = [torch.empty_like(y) for _ in range(world)]
            dist.all_gather(ys, y)
            all_y = torch.cat(ys)
            loss = batch_hard_triplet(all_emb, all_y, args.margin)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if tb is not None and it % 50 == 0:
                step = epoch * len(sampler) + it
                tb.add_scalar("train/loss", loss.item(), step)
                tb.add_scalar("train/lr", sched.get_last_lr()[0], step)

        m_ap, top1 = evaluate(model.module, val_ds, rank, world, device, args.workers)
        if rank == 0:
            tb.add_scalar("val/mAP", m_ap, epoch)
            tb.add_scalar("val/top1", top1, epoch)
            print(f"epoch {epoch}: mAP {m_ap:.4f} top1 {top1:.4f}", flush=True)
            ck = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                  "epoch": epoch, "best": max(best, m_ap)}
            os.makedirs(args.out, exist_ok=True)
            torch.save(ck, os.path.join(args.out, "last.pth"))
            if m_ap > best:
                torch.save(ck, os.path.join(args.out, "best.pth"))
        best = max(best, m_ap)
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
