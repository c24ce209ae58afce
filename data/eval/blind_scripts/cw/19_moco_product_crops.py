"""Self-supervised MoCo pre-training on unlabeled product crops (listed in a text file), with a
recall@1 probe on a small labeled product set every few epochs.

torchrun --nproc_per_node=8 19_moco_product_crops.py --crops lists/crops_2m.txt \
    --probe lists/probe_labeled.csv --out runs/moco_crops
"""
import argparse
import csv
import math
import os
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


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--crops", required=True, help="text file, one image path per line")
    p.add_argument("--probe", required=True, help="csv with path,product_id")
    p.add_argument("--out", default="runs/moco_crops")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--base-lr", type=float, default=0.03, help="per 256 images")
    p.add_argument("--queue", type=int, default=65536)
    p.add_argument("--m", type=float, default=0.999)
    p.add_argument("--t", type=float, default=0.2)
    p.add_argument("--probe-every", type=int, default=5)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


class Crops(Dataset):
    def __init__(self, list_file, tf):
        with open(list_file) as f:
            self.paths = [l.strip() for l in f if l.strip()]
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("RGB")
        return self.tf(img), self.tf(img)


class Probe(Dataset):
    def __init__(self, csv_file, tf):
        with open(csv_file) as f:
            rows = list(csv.DictReader(f))
        self.paths = [r["path"] for r in rows]
        self.pids = [int(r["product_id"]) for r in rows]
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB")), i


def encoder(dim=128):
    net = torchvision.models.resnet50()
    net.fc = nn.Sequential(nn.Linear(2048, 2048), nn.BatchNorm1d(2048), nn.ReLU(inplace=True), nn.Linear(2048, dim))
    return net


@torch.no_grad()
def all_gather_cat(t):
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


class MoCo(nn.Module):
    def __init__(self, K, m, t, dim=128):
        super().__init__()
        self.q, self.k = encoder(dim), encoder(dim)
        self.k.load_state_dict(self.q.state_dict())
        self.k.requires_grad_(False)
        self.K, self.m, self.t = K, m, t
        self.register_buffer("queue", F.normalize(torch.randn(K, dim), dim=1))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def forward(self, a, b):
        q = F.normalize(self.q(a), dim=1)
        with torch.no_grad():
            for pq, pk in zip(self.q.parameters(), self.k.parameters()):
                pk.mul_(self.m).add_(pq.detach(), alpha=1 - self.m)
            k = F.normalize(self.k(b), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.clone().T], 1) / self.t
        loss = F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long, device=q.device))
        with torch.no_grad():
            ks = all_gather_cat(k)
            slots = (self.ptr + torch.arange(len(ks), device=ks.device)) % self.K
            self.queue[slots] = ks
            self.ptr.copy_((self.ptr + len(ks)) % self.K)
        return loss, (logits.argmax(1) == 0).float().mean()


@torch.no_grad()
def probe_recall(backbone, ds, device, workers):
    backbone.eval()
    sampler = DistributedSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_size=256, sampler=sampler, num_workers=workers)
    f, ix = [], []
    for x, i in loader:
        f.append(F.normalize(backbone(x.to(device)), dim=1))
        ix.append(i.to(device))
    f, ix = all_gather_cat(torch.cat(f)), all_gather_cat(torch.cat(ix))
    feats = torch.zeros(len(ds), f.shape[1], device=device)
    feats[ix] = f
    pids = torch.tensor(ds.pids, device=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    q = torch.arange(rank, len(ds), world, device=device)
    sim = feats[q] @ feats.T
    sim[torch.arange(len(q), device=device), q] = -2
    hit = (pids[sim.argmax(1)] == pids[q]).sum().float()
    c = torch.stack([hit, torch.tensor(float(len(q)), device=device)])
    dist.all_reduce(c)
    backbone.train()
    return (100 * c[0] / c[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    aug = T.Compose([T.RandomResizedCrop(224, scale=(0.2, 1.0)), T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], 0.8),
                     T.RandomGrayscale(0.2), T.RandomApply([T.GaussianBlur(23, (0.1, 2.0))], 0.5),
                     T.RandomHorizontalFlip(), T.ToTensor(), norm])
    plain = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
    train_ds = Crops(args.crops, aug)
    probe_ds = Probe(args.probe, plain)
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = MoCo(args.queue, args.m, args.t)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    lr = args.base_lr * args.batch_size * world / 256
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)

    ckpt_path = os.path.join(args.out, "last.pth")
    start = 0
    if os.path.isfile(ckpt_path):
        state = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["epoch"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(start, args.epochs):
        cur = lr * 0.5 * (1 + math.cos(math.pi * epoch / args.epochs))
        for g in opt.param_groups:
            g["lr"] = cur
        ddp.train()
        t0, acc = time.time(), torch.zeros(3, device=device)
        for a, b in loader:
            loss, inst_acc = ddp(a.to(device, non_blocking=True), b.to(device, non_blocking=True))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), inst_acc, torch.ones((), device=device)])
        dist.all_reduce(acc)
        msg = (f"epoch {epoch} lr {cur:.4f} loss {(acc[0] / acc[2]).item():.4f} "
               f"inst-acc {(100 * acc[1] / acc[2]).item():.1f} {time.time() - t0:.0f}s")
        if (epoch + 1) % args.probe_every == 0:
            backbone = nn.Sequential(*list(model.q.children())[:-1], nn.Flatten())
            msg += f" probe R@1 {probe_recall(backbone, probe_ds, device, args.workers):.2f}"
        if rank == 0:
            print(msg, flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1},
                       ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
