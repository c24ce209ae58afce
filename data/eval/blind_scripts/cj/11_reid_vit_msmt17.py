"""ViT-B/16 re-ID baseline on MSMT17 (TransReID-style, without JPM/SIE), distributed feature extraction.

torchrun --nproc_per_node=8 11_reid_vit_msmt17.py --root /data/MSMT17_V1 --output logs/vit_msmt
"""
import argparse
import math
import os
import os.path as osp
import time
from collections import defaultdict

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/MSMT17_V1")
    ap.add_argument("--output", default="logs/vit_msmt")
    ap.add_argument("--ims-per-gpu", type=int, default=16)
    ap.add_argument("--num-instance", type=int, default=4)
    ap.add_argument("--base-lr", type=float, default=0.008, help="SGD lr for 64 images / step")
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--eval-period", type=int, default=30)
    return ap.parse_args()


def load_list(root, name, subdir):
    out = []
    for line in open(osp.join(root, name)):
        rel, pid = line.strip().split(" ")
        out.append((osp.join(root, subdir, rel), int(pid), int(rel.split("_")[2])))
    return out


class Images(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, pid, cam = self.items[i]
        return self.tf(Image.open(p).convert("RGB")), pid, cam


class DistributedPKSampler(Sampler):
    def __init__(self, items, ims_per_gpu, k, world_size, rank, seed=1234):
        self.k, self.p = k, ims_per_gpu // k
        self.world_size, self.rank, self.seed, self.epoch = world_size, rank, seed, 0
        self.pid_to_idx = defaultdict(list)
        for i, (_, pid, _) in enumerate(items):
            self.pid_to_idx[pid].append(i)
        self.pids = sorted(self.pid_to_idx)
        # identities are consumed P per GPU per step
        self.steps = len(self.pids) // (self.p * world_size)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = np.random.RandomState(self.seed + self.epoch)
        pids = rng.permutation(self.pids)
        for s in range(self.steps):
            start = (s * self.world_size + self.rank) * self.p
            for pid in pids[start:start + self.p]:
                idx = self.pid_to_idx[pid]
                yield from rng.choice(idx, self.k, replace=len(idx) < self.k).tolist()

    def __len__(self):
        return self.steps * self.p * self.k


class ViTReID(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.vit = timm.create_model("vit_base_patch16_224.augreg_in21k_ft_in1k", pretrained=True,
                                     img_size=(256, 128), num_classes=0, drop_path_rate=0.1)
        self.neck = nn.BatchNorm1d(768)
        self.neck.bias.requires_grad_(False)
        self.cls = nn.Linear(768, num_classes, bias=False)
        nn.init.normal_(self.cls.weight, std=0.001)

    def forward(self, x):
        g = self.vit(x)
        f = self.neck(g)
        return (self.cls(f), g) if self.training else f


def triplet(feat, pid, margin=0.3):
    d = torch.cdist(feat.float(), feat.float())
    same = pid[:, None].eq(pid[None])
    ap = d.masked_fill(~same, 0).amax(1)
    an = d.masked_fill(same, float("inf")).amin(1)
    return F.margin_ranking_loss(an, ap, torch.ones_like(an), margin=margin)


@torch.no_grad()
def extract_all(model, items, tf, device, rank, world):
    """Each rank embeds every world-th image; the shards are interleaved back afterwards."""
    model.eval()
    shard = items[rank::world]
    loader = DataLoader(Images(shard, tf), batch_size=256, num_workers=8, pin_memory=True)
    feats = torch.cat([F.normalize(model(x.to(device, non_blocking=True)).float(), dim=1) for x, _, _ in loader])
    gathered = [torch.zeros_like(feats) for _ in range(world)]
    dist.all_gather(gathered, feats)
    return torch.stack(gathered, dim=1).reshape(-1, feats.size(1))[:len(items)]


def cmc_map(qf, gf, q_pid, g_pid, q_cam, g_cam, topk=(1, 5, 10)):
    cmc, aps = np.zeros(max(topk)), []
    for start in range(0, qf.size(0), 1024):
        sim = (qf[start:start + 1024] @ gf.t()).cpu()
        order = sim.argsort(dim=1, descending=True).numpy()
        for r, q in enumerate(range(start, min(start + 1024, qf.size(0)))):
            o = order[r]
            valid = ~((g_pid[o] == q_pid[q]) & (g_cam[o] == q_cam[q]))
            hit = g_pid[o][valid] == q_pid[q]
            if not hit.any():
                continue
            first = np.argmax(hit)
            if first < max(topk):
                cmc[first:] += 1
            pos = np.flatnonzero(hit)
            aps.append(np.mean((np.arange(len(pos)) + 1) / (pos + 1)))
    cmc /= len(aps)
    return {f"rank-{k}": cmc[k - 1] for k in topk} | {"mAP": float(np.mean(aps))}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train = load_list(args.root, "list_train.txt", "train") + load_list(args.root, "list_val.txt", "train")
    query = load_list(args.root, "list_query.txt", "test")
    gallery = load_list(args.root, "list_gallery.txt", "test")
    num_classes = len({pid for _, pid, _ in train})

    norm = T.Normalize([0.5] * 3, [0.5] * 3)
    train_tf = T.Compose([T.Resize((256, 128), interpolation=T.InterpolationMode.BICUBIC), T.RandomHorizontalFlip(),
                          T.Pad(10), T.RandomCrop((256, 128)), T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128), interpolation=T.InterpolationMode.BICUBIC), T.ToTensor(), norm])

    sampler = DistributedPKSampler(train, args.ims_per_gpu, args.num_instance, world, rank)
    loader = DataLoader(Images(train, train_tf), batch_size=args.ims_per_gpu, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(ViTReID(num_classes)).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.base_lr * args.ims_per_gpu * world / 64
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim == 1 or "pos_embed" in n or "cls_token" in n else decay).append(p)
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=lr, momentum=0.9)
    scaler = torch.cuda.amp.GradScaler()

    def lr_at(epoch):
        if epoch < args.warmup:
            return lr * (0.01 + 0.99 * epoch / args.warmup)
        return lr * 0.5 * (1 + math.cos(math.pi * (epoch - args.warmup) / (args.epochs - args.warmup)))

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"{num_classes} ids / {len(train)} images; world {world}; lr {lr:.4f}", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for g in optimizer.param_groups:
            g["lr"] = lr_at(epoch)
        model.train()
        t0, meter = time.time(), torch.zeros(2, device=device)
        for img, pid, _ in loader:
            img, pid = img.to(device, non_blocking=True), pid.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, feat = model(img)
                loss = F.cross_entropy(logits.float(), pid, label_smoothing=0.1) + triplet(feat, pid)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(meter)
        if rank == 0:
            print(f"epoch {epoch + 1} loss {(meter[0] / meter[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % args.eval_period == 0 or epoch + 1 == args.epochs:
            feats = extract_all(model.module, query + gallery, test_tf, device, rank, world)
            if rank == 0:
                nq = len(query)
                pid = np.array([p for _, p, _ in query + gallery])
                cam = np.array([c for _, _, c in query + gallery])
                res = cmc_map(feats[:nq], feats[nq:], pid[:nq], pid[nq:], cam[:nq], cam[nq:])
                print(f"epoch {epoch + 1}: " + " ".join(f"{k} {100 * v:.2f}" for k, v in res.items()), flush=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch + 1, "metrics": res},
                           osp.join(args.output, f"vit_msmt_{epoch + 1}.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
