#!/usr/bin/env python
"""Person re-ID (Market-1501) with an identity-centroid memory bank.

The memory holds one L2-normalised centroid per training identity. It is rebuilt from a full
pass over the training set at the start of every epoch and momentum-updated with the
features of all ranks after every step.

    torchrun --nproc_per_node=4 09_reid_centroid_memory.py --root /data/Market-1501-v15.09.15 \
        --out logs/market_r50_mem [--resume logs/market_r50_mem/checkpoint.pth]
"""
import argparse
import glob
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

PATTERN = re.compile(r"([-\d]+)_c(\d)")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="logs/market_mem")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=256, help="total over GPUs")
    p.add_argument("--lr", type=float, default=3.5e-4)
    p.add_argument("--temp", type=float, default=0.05)
    p.add_argument("--mem-momentum", type=float, default=0.2)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--resume", default="")
    return p.parse_args()


def scan(folder, relabel=False):
    items = []
    for path in sorted(glob.glob(os.path.join(folder, "*.jpg"))):
        pid, cam = map(int, PATTERN.search(os.path.basename(path)).groups())
        if pid == -1:
            continue
        items.append([path, pid, cam - 1])
    if relabel:
        pids = sorted({it[1] for it in items})
        remap = {p: i for i, p in enumerate(pids)}
        for it in items:
            it[1] = remap[it[1]]
    return items


class ReIDSet(Dataset):
    def __init__(self, items, transform):
        self.items, self.transform = items, transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, pid, cam = self.items[i]
        return self.transform(Image.open(path).convert("RGB")), pid, cam, i


class ReIDNet(nn.Module):
    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.body = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3, r.layer4)
        self.bnneck = nn.BatchNorm1d(2048)
        self.bnneck.bias.requires_grad_(False)

    def forward(self, x):
        f = F.adaptive_avg_pool2d(self.body(x), 1).flatten(1)
        return F.normalize(self.bnneck(f), dim=1)


@torch.no_grad()
def gather(t):
    bufs = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, t.contiguous())
    return torch.cat(bufs)


@torch.no_grad()
def extract(model, dataset, device, workers):
    """Every rank embeds its shard; returns features for the full dataset on every rank."""
    model.eval()
    loader = DataLoader(dataset, batch_size=256, num_workers=workers,
                        sampler=DistributedSampler(dataset, shuffle=False), pin_memory=True)
    feats, idxs = [], []
    for x, _, _, i in loader:
        feats.append(model(x.to(device, non_blocking=True)))
        idxs.append(i.to(device))
    feats, idxs = gather(torch.cat(feats)), gather(torch.cat(idxs))
    out = torch.zeros(len(dataset), feats.shape[1], device=device)
    out[idxs] = feats
    model.train()
    return out


@torch.no_grad()
def rebuild_memory(model, dataset, num_ids, device, workers):
    feats = extract(model, dataset, device, workers)
    labels = torch.tensor([it[1] for it in dataset.items], device=device)
    mem = torch.zeros(num_ids, feats.shape[1], device=device)
    mem.index_add_(0, labels, feats)
    return F.normalize(mem, dim=1)


@torch.no_grad()
def evaluate(model, query, gallery, device, workers):
    qf, gf = extract(model, query, device, workers), extract(model, gallery, device, workers)
    qp = torch.tensor([it[1] for it in query.items], device=device)
    qc = torch.tensor([it[2] for it in query.items], device=device)
    gp = torch.tensor([it[1] for it in gallery.items], device=device)
    gc = torch.tensor([it[2] for it in gallery.items], device=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    acc = torch.zeros(5, device=device, dtype=torch.float64)  # AP sum, R1, R5, R10, count
    for qi in range(rank, len(qf), world):
        order = (gf @ qf[qi]).argsort(descending=True)
        keep = ~((gp[order] == qp[qi]) & (gc[order] == qc[qi]))
        match = (gp[order] == qp[qi])[keep].float()
        if match.sum() == 0:
            continue
        first = match.nonzero()[0, 0]
        hits = match.cumsum(0)
        prec = hits / torch.arange(1, len(match) + 1, device=device)
        acc[0] += (prec * match).sum() / match.sum()
        acc[1] += float(first < 1)
        acc[2] += float(first < 5)
        acc[3] += float(first < 10)
        acc[4] += 1
    dist.all_reduce(acc)
    return {"mAP": 100 * acc[0] / acc[4], "R1": 100 * acc[1] / acc[4], "R5": 100 * acc[2] / acc[4],
            "R10": 100 * acc[3] / acc[4]}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                          T.ToTensor(), norm, T.RandomErasing(p=0.5, value=0)])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])
    train_items = scan(os.path.join(args.root, "bounding_box_train"), relabel=True)
    num_ids = len({it[1] for it in train_items})
    train_set = ReIDSet(train_items, train_tf)
    plain_train = ReIDSet(train_items, test_tf)
    query = ReIDSet(scan(os.path.join(args.root, "query")), test_tf)
    gallery = ReIDSet(scan(os.path.join(args.root, "bounding_box_test")), test_tf)

    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(ReIDNet()).to(device)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                 weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[20, 40], gamma=0.1)
    start_epoch, best_map = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_map = ckpt["epoch"], ckpt["best_map"]
        if rank == 0:
            print(f"resumed at epoch {start_epoch}, best mAP {best_map:.2f}", flush=True)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        memory = rebuild_memory(model, plain_train, num_ids, device, args.workers)
        sampler.set_epoch(epoch)
        ddp.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for x, y, _, _ in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            f = ddp(x)
            loss = F.cross_entropy(f @ memory.T / args.temp, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                gf, gy = gather(f.detach()), gather(y)
                for feat, lab in zip(gf, gy):
                    memory[lab] = F.normalize(args.mem_momentum * memory[lab] + (1 - args.mem_momentum) * feat, dim=0)
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        scheduler.step()
        dist.all_reduce(tot)
        msg = f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} {time.time() - t0:.0f}s"

        is_best = False
        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            res = evaluate(model, query, gallery, device, args.workers)
            msg += " " + " ".join(f"{k} {v.item():.2f}" for k, v in res.items())
            is_best = res["mAP"].item() > best_map
            best_map = max(best_map, res["mAP"].item())
        if rank == 0:
            print(msg, flush=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch + 1, "best_map": best_map}
            torch.save(state, os.path.join(args.out, "checkpoint.pth"))
            if is_best:
                torch.save(state, os.path.join(args.out, "model_best.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
