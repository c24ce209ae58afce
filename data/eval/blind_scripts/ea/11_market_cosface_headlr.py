"""
Market-1501 with a CosFace identity head on the BNNeck feature plus batch-hard
triplet on the pooled feature. Backbone and head use separate learning rates.

    torchrun --nproc_per_node=4 11_market_cosface_headlr.py --root /data/Market-1501-v15.09.15
"""
import argparse
import math
import os
import os.path as osp
import random
import re
import time
from collections import defaultdict
from glob import glob

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.models import resnet50, ResNet50_Weights


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--batch", type=int, default=64, help="global")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--backbone-lr", type=float, default=3.5e-4)
    p.add_argument("--head-lr-mult", type=float, default=10.0)
    p.add_argument("--scale", type=float, default=30.0)
    p.add_argument("--margin", type=float, default=0.25)
    p.add_argument("--out", default="runs/market_cosface")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def read_market(d, relabel):
    pat = re.compile(r"([-\d]+)_c(\d)")
    items = [(p, *map(int, pat.search(p).groups())) for p in sorted(glob(osp.join(d, "*.jpg")))]
    items = [(p, pid, cam - 1) for p, pid, cam in items if pid != -1]
    if relabel:
        lut = {pid: i for i, pid in enumerate(sorted({x[1] for x in items}))}
        items = [(p, lut[pid], c) for p, pid, c in items]
    return items


class ReIDData(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, pid, cam = self.items[i]
        return self.tf(Image.open(p).convert("RGB")), pid, cam


class DistributedIdentitySampler(Sampler):
    def __init__(self, items, batch, k, rank, world, seed=3):
        self.batch, self.k, self.rank, self.world, self.seed = batch, k, rank, world, seed
        self.local = batch // world
        self.epoch = 0
        self.index = defaultdict(list)
        for i, (_, pid, _) in enumerate(items):
            self.index[pid].append(i)
        self.pids = sorted(self.index)
        self.num_batches = sum(max(len(v), k) // k for v in self.index.values()) * k // batch

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.num_batches * self.local

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        groups = {}
        for pid in self.pids:
            idx = self.index[pid][:]
            if len(idx) < self.k:
                idx += rng.choices(idx, k=self.k - len(idx))
            rng.shuffle(idx)
            groups[pid] = [idx[i:i + self.k] for i in range(0, len(idx) - self.k + 1, self.k)]
        live, seq = list(self.pids), []
        for _ in range(self.num_batches):
            if len(live) < self.batch // self.k:
                break
            for pid in rng.sample(live, self.batch // self.k):
                seq.extend(groups[pid].pop())
                if not groups[pid]:
                    live.remove(pid)
        for b in range(len(seq) // self.batch):
            start = b * self.batch + self.rank * self.local
            yield from seq[start:start + self.local]


class CosFace(nn.Module):
    def __init__(self, in_features, num_classes, s, m):
        super().__init__()
        self.s, self.m = s, m
        self.weight = nn.Parameter(torch.empty(num_classes, in_features))
        nn.init.normal_(self.weight, std=0.01)

    def forward(self, x, labels):
        cos = F.linear(F.normalize(x), F.normalize(self.weight))
        onehot = F.one_hot(labels, cos.size(1)).to(cos.dtype)
        return self.s * (cos - self.m * onehot)


class ReIDNet(nn.Module):
    def __init__(self, num_classes, s, m):
        super().__init__()
        r = resnet50(weights=ResNet50_Weights.IMAGENET1K_V1)
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.base = nn.Sequential(*list(r.children())[:-2])
        self.neck = nn.BatchNorm1d(2048)
        self.neck.bias.requires_grad_(False)
        self.head = CosFace(2048, num_classes, s, m)

    def forward(self, x, labels=None):
        f = F.adaptive_avg_pool2d(self.base(x), 1).flatten(1)
        b = self.neck(f)
        if not self.training:
            return b
        return self.head(b, labels), f


def batch_hard_triplet(f, y, margin=0.3):
    n = f.size(0)
    sq = f.pow(2).sum(1, keepdim=True)
    d = (sq + sq.t() - 2 * f @ f.t()).clamp(min=1e-12).sqrt()
    pos = y.view(n, 1).eq(y.view(1, n))
    return F.relu(d.masked_fill(~pos, 0).max(1)[0] - d.masked_fill(pos, 1e6).min(1)[0] + margin).mean()


def market_metrics(q, g, qf, gf):
    sim = (qf @ gf.t()).cpu().numpy()
    qp, qc = np.array([x[1] for x in q]), np.array([x[2] for x in q])
    gp, gc = np.array([x[1] for x in g]), np.array([x[2] for x in g])
    aps, cmc = [], np.zeros(10)
    n_valid = 0
    for i in range(len(q)):
        o = np.argsort(-sim[i])
        keep = (gp[o] != qp[i]) | (gc[o] != qc[i])
        m = gp[o][keep] == qp[i]
        if not m.any():
            continue
        n_valid += 1
        h = np.flatnonzero(m)
        aps.append((np.arange(1, len(h) + 1) / (h + 1)).mean())
        if h[0] < 10:
            cmc[h[0]:] += 1
    return float(np.mean(aps)), cmc / n_valid


@torch.no_grad()
def run_test(net, q, g, tf, device):
    net.eval()
    loader = DataLoader(ReIDData(q + g, tf), batch_size=256, num_workers=8, pin_memory=True)
    f = F.normalize(torch.cat([net(x.to(device, non_blocking=True)) for x, _, _ in loader]), dim=1)
    return market_metrics(q, g, f[:len(q)], f[len(q):])


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(3)

    train = read_market(osp.join(args.root, "bounding_box_train"), True)
    query = read_market(osp.join(args.root, "query"), False)
    gallery = read_market(osp.join(args.root, "bounding_box_test"), False)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                    T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])
    sampler = DistributedIdentitySampler(train, args.batch, args.k, rank, world)
    loader = DataLoader(ReIDData(train, tf), batch_size=args.batch // world, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    model = ReIDNet(len({x[1] for x in train}), args.scale, args.margin)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    head_params = [p for p in list(model.neck.parameters()) + list(model.head.parameters()) if p.requires_grad]
    optimizer = torch.optim.Adam([
        {"params": model.base.parameters(), "lr": args.backbone_lr},
        {"params": head_params, "lr": args.backbone_lr * args.head_lr_mult},
    ], weight_decay=5e-4)
    warm = 5 * len(loader)
    total = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: (it + 1) / warm if it < warm else 0.5 * (1 + math.cos(math.pi * (it - warm) / (total - warm))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stat = torch.zeros(3, device=device)
        for x, y, _ in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits, feat = model(x, y)
            l_cls = F.cross_entropy(logits, y)
            l_tri = batch_hard_triplet(feat, y)
            optimizer.zero_grad(set_to_none=True)
            (l_cls + l_tri).backward()
            optimizer.step()
            scheduler.step()
            stat += torch.stack([l_cls.detach(), l_tri.detach(), torch.ones_like(l_cls)])
        dist.all_reduce(stat)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} cls {stat[0] / stat[2]:.3f} tri {stat[1] / stat[2]:.3f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            if (epoch + 1) % 10 == 0:
                mAP, cmc = run_test(model.module, query, gallery, test_tf, device)
                print(f"  mAP {mAP:.1%} R1 {cmc[0]:.1%} R5 {cmc[4]:.1%} R10 {cmc[9]:.1%}", flush=True)
                if mAP > best:
                    best = mAP
                    torch.save(model.module.state_dict(), osp.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
