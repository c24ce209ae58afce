"""MSMT17 person re-ID: ResNet-50 + softmax + circle loss, with multi-GPU evaluation.

Feature extraction for the 93k query+gallery images is split over the GPUs and the
features are gathered before ranking.

    torchrun --nproc_per_node=8 14_msmt17_circle_dist_eval.py --root /data/MSMT17_V1
"""
import argparse
import math
import os
import os.path as osp
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import timm
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
import torchvision.transforms as T


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/MSMT17_V1")
    p.add_argument("--arch", default="resnet50.a1_in1k")
    p.add_argument("--P", type=int, default=16)
    p.add_argument("--K", type=int, default=4)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=3.5e-4)
    p.add_argument("--gamma", type=float, default=64)
    p.add_argument("--circle-m", type=float, default=0.25)
    p.add_argument("--eval-period", type=int, default=15)
    p.add_argument("--out", default="logs/msmt17_circle")
    return p.parse_args()


def read_msmt_list(root, list_name, img_dir, relabel=False):
    rows = []
    with open(osp.join(root, list_name)) as f:
        for line in f:
            rel, pid = line.split()
            cam = int(rel.split("_")[2]) - 1
            rows.append((osp.join(root, img_dir, rel), int(pid), cam))
    if relabel:
        remap = {p: i for i, p in enumerate(sorted({r[1] for r in rows}))}
        rows = [(a, remap[b], c) for a, b, c in rows]
    return rows


class Images(Dataset):
    def __init__(self, rows, tf):
        self.rows, self.tf = rows, tf

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, pid, cam = self.rows[i]
        return self.tf(Image.open(path).convert("RGB")), pid, cam


class PKSampler(Sampler):
    def __init__(self, rows, P, K, rank, world, seed=0):
        self.index = defaultdict(list)
        for i, (_, pid, _) in enumerate(rows):
            self.index[pid].append(i)
        self.pids = sorted(self.index)
        self.P, self.K, self.rank, self.world, self.seed = P, K, rank, world, seed
        self.epoch = 0
        self.per_rank = len(self.pids) // (P * world)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.per_rank * self.P * self.K

    def __iter__(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        order = rng.permutation(self.pids)[: self.per_rank * self.P * self.world]
        groups = order.reshape(-1, self.P)[self.rank::self.world]
        for group in groups:
            for pid in group:
                cand = self.index[pid]
                yield from rng.choice(cand, self.K, replace=len(cand) < self.K).tolist()


class ReIDModel(nn.Module):
    def __init__(self, arch, num_classes):
        super().__init__()
        self.backbone = timm.create_model(arch, pretrained=True, num_classes=0, global_pool="avg")
        dim = self.backbone.num_features
        self.bnneck = nn.BatchNorm1d(dim)
        self.bnneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(dim, num_classes, bias=False)

    def forward(self, x):
        f = self.backbone(x)
        b = self.bnneck(f)
        if self.training:
            return self.classifier(b), f
        return b


def circle_loss(feats, labels, m=0.25, gamma=64):
    feats = F.normalize(feats)
    sim = feats @ feats.t()
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool, device=feats.device)
    pos_mask, neg_mask = same & ~eye, ~same
    ap = torch.clamp_min(-sim.detach() + 1 + m, 0.0)
    an = torch.clamp_min(sim.detach() + m, 0.0)
    logit_p = -gamma * ap * (sim - (1 - m))
    logit_n = gamma * an * (sim - m)
    logit_p = logit_p.masked_fill(~pos_mask, -float("inf"))
    logit_n = logit_n.masked_fill(~neg_mask, -float("inf"))
    return F.softplus(torch.logsumexp(logit_n, 1) + torch.logsumexp(logit_p, 1)).mean()


@torch.no_grad()
def extract_distributed(model, rows, tf, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = rows[rank::world]
    loader = DataLoader(Images(shard, tf), batch_size=256, num_workers=8, pin_memory=True)
    model.eval()
    feats = []
    for x, _, _ in loader:
        x = x.to(device, non_blocking=True)
        feats.append(F.normalize(model(x) + model(x.flip(3))))
    model.train()
    feats = torch.cat(feats)
    buckets = [torch.empty_like(feats) for _ in range(world)]
    dist.all_gather(buckets, feats)
    # undo the strided split: global index i lives on rank i % world at position i // world
    out = torch.empty(len(rows), feats.size(1), device=device)
    for r in range(world):
        out[r::world] = buckets[r]
    return out


def rank_metrics(qf, gf, q, g, topk=(1, 5, 10)):
    q_pids = np.array([r[1] for r in q]); q_cams = np.array([r[2] for r in q])
    g_pids = np.array([r[1] for r in g]); g_cams = np.array([r[2] for r in g])
    aps, cmc = [], np.zeros(max(topk))
    n_valid = 0
    for s in range(0, len(q), 1024):
        order = torch.argsort(-(qf[s:s + 1024] @ gf.t()), dim=1).cpu().numpy()
        for j, o in enumerate(order):
            i = s + j
            keep = ~((g_pids[o] == q_pids[i]) & (g_cams[o] == q_cams[i]))
            good = g_pids[o][keep] == q_pids[i]
            if not good.any():
                continue
            n_valid += 1
            first = np.argmax(good)
            if first < len(cmc):
                cmc[first:] += 1
            hit_pos = np.flatnonzero(good)
            aps.append(np.mean((np.arange(len(hit_pos)) + 1) / (hit_pos + 1)))
    return float(np.mean(aps)), {k: cmc[k - 1] / n_valid for k in topk}


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                          T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])
    train_rows = read_msmt_list(args.root, "list_train.txt", "train", relabel=True)
    query = read_msmt_list(args.root, "list_query.txt", "test")
    gallery = read_msmt_list(args.root, "list_gallery.txt", "test")

    sampler = PKSampler(train_rows, args.P, args.K, rank, world)
    loader = DataLoader(Images(train_rows, train_tf), batch_size=args.P * args.K, sampler=sampler,
                        num_workers=8, pin_memory=True, drop_last=True)
    model = ReIDModel(args.arch, num_classes=len({r[1] for r in train_rows}))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=5e-4)
    warmup = 10 * len(loader)
    total = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, pid, _) in enumerate(loader):
            x, pid = x.to(device, non_blocking=True), pid.to(device, non_blocking=True)
            logits, feat = model(x)
            loss = ce(logits, pid) + circle_loss(feat, pid, args.circle_m, args.gamma)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 50 == 0:
                print(f"ep {epoch} it {it}/{len(loader)} loss {loss.item():.3f} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % args.eval_period == 0:
            qf = extract_distributed(model.module, query, test_tf, device)
            gf = extract_distributed(model.module, gallery, test_tf, device)
            if rank == 0:
                mAP, cmc = rank_metrics(qf, gf, query, gallery)
                print(f"[eval] ep {epoch}: mAP {mAP:.4f} " + " ".join(f"R{k} {v:.4f}" for k, v in cmc.items()))
                torch.save(model.module.state_dict(), osp.join(args.out, f"model_ep{epoch + 1}.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
