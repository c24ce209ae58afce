#!/usr/bin/env python3
"""Product image retrieval: EfficientNet-B3 embedding trained with ArcFace.

    python 18_torchrun_popen_arcface.py --train-dir /data/sop/train --query-dir /data/sop/query \
        --gallery-dir /data/sop/gallery --nproc 4

`python this.py` is the job wrapper: it runs `torchrun ... this.py --worker`,
with torchrun's per-rank log files under <out>/ranks/, and retries the job up
to --attempts times. Workers resume from <out>/last.ckpt.
"""
import argparse
import math
import os
import subprocess
import sys
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--attempts", type=int, default=3)
    p.add_argument("--train-dir", default="/data/sop/train")
    p.add_argument("--query-dir", default="/data/sop/query")
    p.add_argument("--gallery-dir", default="/data/sop/gallery")
    p.add_argument("--out", default="runs/arcface_b3")
    p.add_argument("--backbone", default="efficientnet_b3")
    p.add_argument("--emb", type=int, default=512)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3, help="for a global batch of 256")
    p.add_argument("--margin", type=float, default=0.3)
    p.add_argument("--scale", type=float, default=30.0)
    return p.parse_args()


class ArcMargin(nn.Module):
    def __init__(self, emb, n_classes, s, m):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_classes, emb))
        nn.init.xavier_uniform_(self.weight)
        self.s, self.m = s, m

    def forward(self, x, labels):
        cos = F.linear(F.normalize(x), F.normalize(self.weight)).clamp(-1 + 1e-7, 1 - 1e-7)
        theta = torch.acos(cos)
        target = torch.cos(theta + self.m)
        onehot = F.one_hot(labels, cos.size(1)).bool()
        return self.s * torch.where(onehot, target, cos)


class Embedder(nn.Module):
    def __init__(self, backbone, emb, n_classes, s, m):
        super().__init__()
        self.body = timm.create_model(backbone, pretrained=True, num_classes=0)
        self.neck = nn.Sequential(nn.Linear(self.body.num_features, emb), nn.BatchNorm1d(emb))
        self.arc = ArcMargin(emb, n_classes, s, m)

    def embed(self, x):
        return self.neck(self.body(x))

    def forward(self, x, labels):
        return self.arc(self.embed(x), labels)


def transforms():
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train = T.Compose([T.RandomResizedCrop(288, scale=(0.3, 1.0)), T.RandomHorizontalFlip(),
                       T.ColorJitter(0.2, 0.2, 0.2), T.ToTensor(), norm])
    test = T.Compose([T.Resize(320), T.CenterCrop(288), T.ToTensor(), norm])
    return train, test


@torch.no_grad()
def extract(model, dataset, rank, world, device):
    """Embeddings + labels for the whole dataset, assembled on every rank."""
    idx = list(range(rank, len(dataset), world))
    loader = DataLoader(Subset(dataset, idx), batch_size=128, num_workers=6)
    feats, labels = [], []
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            feats.append(F.normalize(model.embed(x.to(device)).float()))
        labels.append(y.to(device))
    feats = torch.cat(feats) if feats else torch.zeros(0, model.neck[0].out_features, device=device)
    labels = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long, device=device)
    # pad to equal length for all_gather
    n = torch.tensor([feats.size(0)], device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    m = int(max(s.item() for s in sizes))
    pf = torch.zeros(m, feats.size(1), device=device)
    pl = torch.full((m,), -1, dtype=torch.long, device=device)
    pf[:feats.size(0)], pl[:labels.size(0)] = feats, labels
    all_f = [torch.zeros_like(pf) for _ in range(world)]
    all_l = [torch.zeros_like(pl) for _ in range(world)]
    dist.all_gather(all_f, pf)
    dist.all_gather(all_l, pl)
    f = torch.cat([a[:s.item()] for a, s in zip(all_f, sizes)])
    l = torch.cat([a[:s.item()] for a, s in zip(all_l, sizes)])
    return f, l


def recall_at_1(model, query, gallery, rank, world, device):
    model.eval()
    qf, ql = extract(model, query, rank, world, device)
    gf, gl = extract(model, gallery, rank, world, device)
    model.train()
    nn_idx = (qf @ gf.T).argmax(dim=1)
    return (gl[nn_idx] == ql).float().mean().item()


def worker(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_tf, test_tf = transforms()
    train_set = ImageFolder(args.train_dir, train_tf)
    query, gallery = ImageFolder(args.query_dir, test_tf), ImageFolder(args.gallery_dir, test_tf)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = Embedder(args.backbone, args.emb, len(train_set.classes), args.scale, args.margin)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    lr = args.lr * args.batch * world / 256
    opt = torch.optim.AdamW([{"params": model.body.parameters(), "lr": lr},
                             {"params": list(model.neck.parameters()) + list(model.arc.parameters()),
                              "lr": lr * 10}], weight_decay=1e-4)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    start, best = 0, 0.0
    ckpt_path = os.path.join(args.out, "last.ckpt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best = ck["epoch"] + 1, ck["best"]
    ddp = DDP(model, device_ids=[local_rank])
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(start, args.epochs):
        t0 = time.time()
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = ddp(x, y)
            loss = F.cross_entropy(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} it {i}/{len(loader)} loss {loss.item():.4f}", flush=True)

        r1 = recall_at_1(model, query, gallery, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} recall@1 {r1:.4f} ({time.time() - t0:.0f}s)", flush=True)
            best = max(best, r1)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if r1 >= best:
                torch.save(model.state_dict(), os.path.join(args.out, "best.ckpt"))
        dist.barrier()

    dist.destroy_process_group()


def wrapper(args):
    os.makedirs(args.out, exist_ok=True)
    # download pretrained weights once before the workers start
    timm.create_model(args.backbone, pretrained=True)
    for attempt in range(1, args.attempts + 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.nproc}", f"--log_dir={os.path.join(args.out, 'ranks', str(attempt))}",
               "--redirects=3", os.path.abspath(__file__), "--worker", *sys.argv[1:]]
        print(f"attempt {attempt}/{args.attempts}", flush=True)
        rc = subprocess.call(cmd)
        if rc == 0:
            return 0
        print(f"torchrun failed with {rc}", flush=True)
        time.sleep(20)
    return 1


if __name__ == "__main__":
    a = get_args()
    if a.worker:
        worker(a)
    else:
        sys.exit(wrapper(a))
