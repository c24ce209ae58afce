"""
ViT-B/16 re-ID with side-information (camera) embedding, BNNeck, ID + triplet.
Activation checkpointing and gradient accumulation to fit 256x128 / batch 128
on 24 GB cards.

    torchrun --nproc_per_node=4 18_duke_vit_sie_ckpt.py --root /data/DukeMTMC-reID --accum 2
"""
import argparse
import contextlib
import math
import os
import os.path as osp
import random
import re
import time
from collections import defaultdict
from glob import glob

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

NUM_CAMS = 8


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", default="logs/duke_vit_sie")
    p.add_argument("--micro-batch", type=int, default=16, help="images per GPU per forward")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--base-lr", type=float, default=0.008, help="SGD lr for a batch of 64")
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sie-coe", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def duke(folder, relabel):
    rx = re.compile(r"([-\d]+)_c(\d)")
    out = []
    for f in sorted(glob(osp.join(folder, "*.jpg"))):
        pid, cam = map(int, rx.search(osp.basename(f)).groups())
        out.append((f, pid, cam - 1))
    if relabel:
        lut = {pid: i for i, pid in enumerate(sorted({o[1] for o in out}))}
        out = [(f, lut[pid], c) for f, pid, c in out]
    return out


class Data(Dataset):
    def __init__(self, items, tf):
        self.items, self.tf = items, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, pid, cam = self.items[i]
        return self.tf(Image.open(f).convert("RGB")), pid, cam, i


class PKMicroBatchSampler(Sampler):
    """Global step = world * accum micro-batches, each micro-batch holds whole identities.
    The order comes from (seed, epoch) only, so it is the same on every rank."""

    def __init__(self, items, micro, k, accum, rank, world, seed):
        self.micro, self.k, self.rank, self.world, self.seed = micro, k, rank, world, seed
        self.step = micro * accum * world
        self.epoch = 0
        self.by_pid = defaultdict(list)
        for i, (_, pid, _) in enumerate(items):
            self.by_pid[pid].append(i)
        self.pids = sorted(self.by_pid)
        self.n_steps = sum(max(len(v), k) // k for v in self.by_pid.values()) * k // self.step

    def set_epoch(self, e):
        self.epoch = e

    def __len__(self):
        return self.n_steps * self.step // self.world

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        chunks = {}
        for pid in self.pids:
            v = self.by_pid[pid][:]
            v += [rng.choice(v) for _ in range(max(0, self.k - len(v)))]
            rng.shuffle(v)
            chunks[pid] = [v[i:i + self.k] for i in range(0, len(v) - self.k + 1, self.k)]
        live, order = list(self.pids), []
        while len(live) >= self.step // self.k and len(order) < self.n_steps * self.step:
            for pid in rng.sample(live, self.step // self.k):
                order += chunks[pid].pop()
                if not chunks[pid]:
                    live.remove(pid)
        # micro-batches are dealt round-robin: micro-batch j of a step goes to rank j % world
        n_micro = len(order) // self.step * self.step // self.micro
        for j in range(self.rank, n_micro, self.world):
            yield from order[j * self.micro:(j + 1) * self.micro]


class ViTSIE(nn.Module):
    def __init__(self, num_classes, sie_coe):
        super().__init__()
        self.vit = timm.create_model("vit_base_patch16_224.augreg_in21k_ft_in1k", pretrained=True,
                                     img_size=(256, 128), num_classes=0, drop_path_rate=0.1)
        d = self.vit.embed_dim
        self.sie = nn.Parameter(torch.zeros(NUM_CAMS, 1, d))
        nn.init.trunc_normal_(self.sie, std=0.02)
        self.sie_coe = sie_coe
        self.bottleneck = nn.BatchNorm1d(d)
        self.bottleneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(d, num_classes, bias=False)
        nn.init.normal_(self.classifier.weight, std=0.001)
        self.grad_ckpt = True

    def forward(self, x, cam):
        v = self.vit
        x = v.patch_embed(x)
        x = torch.cat([v.cls_token.expand(x.size(0), -1, -1), x], 1) + v.pos_embed
        x = v.pos_drop(x + self.sie_coe * self.sie[cam])
        for blk in v.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        cls = v.norm(x)[:, 0]
        bn = self.bottleneck(cls)
        return (self.classifier(bn), cls) if self.training else bn


def triplet(f, y, m=0.3):
    f = f.float()
    d = torch.cdist(f, f)
    s = y[:, None] == y[None]
    return F.relu(d.masked_fill(~s, 0).amax(1) - d.masked_fill(s, 1e6).amin(1) + m).mean()


@torch.no_grad()
def extract_all(net, dataset, device, world):
    """Sharded extraction; DistributedSampler pads to equal shards, duplicates dropped via the index."""
    net.eval()
    loader = DataLoader(dataset, batch_size=128, num_workers=4, pin_memory=True,
                        sampler=DistributedSampler(dataset, shuffle=False))
    feats, idx = [], []
    for x, _, cam, i in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            feats.append(net(x.to(device, non_blocking=True), cam.to(device)).float())
        idx.append(i.to(device))
    feats, idx = torch.cat(feats), torch.cat(idx)
    all_feats = feats.new_empty((world * feats.size(0), feats.size(1)))
    all_idx = idx.new_empty(world * idx.size(0))
    dist.all_gather_into_tensor(all_feats, feats)
    dist.all_gather_into_tensor(all_idx, idx)
    out = feats.new_zeros((len(dataset), feats.size(1)))
    out[all_idx] = all_feats
    return F.normalize(out, dim=1)


def score(feats, query, gallery):
    nq = len(query)
    dm = torch.cdist(feats[:nq], feats[nq:]).cpu().numpy()
    qp, qc = np.array([q[1] for q in query]), np.array([q[2] for q in query])
    gp, gc = np.array([g[1] for g in gallery]), np.array([g[2] for g in gallery])
    aps, cmc, nv = [], np.zeros(10), 0
    for i in range(nq):
        o = np.argsort(dm[i])
        m = gp[o][(gp[o] != qp[i]) | (gc[o] != qc[i])] == qp[i]
        if not m.any():
            continue
        nv += 1
        h = np.flatnonzero(m)
        aps.append(np.mean(np.arange(1, len(h) + 1) / (h + 1)))
        if h[0] < 10:
            cmc[h[0]:] += 1
    return float(np.mean(aps)), cmc / nv


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # per-rank seed for augmentation / drop-path; DDP broadcasts rank 0's weights at construction
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    train = duke(osp.join(args.root, "bounding_box_train"), True)
    query = duke(osp.join(args.root, "query"), False)
    gallery = duke(osp.join(args.root, "bounding_box_test"), False)
    norm = T.Normalize([0.5] * 3, [0.5] * 3)
    tf = T.Compose([T.Resize((256, 128), interpolation=T.InterpolationMode.BICUBIC), T.RandomHorizontalFlip(),
                    T.Pad(10), T.RandomCrop((256, 128)), T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128), interpolation=T.InterpolationMode.BICUBIC), T.ToTensor(), norm])
    test_set = Data(query + gallery, test_tf)

    sampler = PKMicroBatchSampler(train, args.micro_batch, args.k, args.accum, rank, world, args.seed)
    loader = DataLoader(Data(train, tf), batch_size=args.micro_batch, sampler=sampler, drop_last=True,
                        num_workers=args.workers, pin_memory=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(ViTSIE(len({t[1] for t in train}), args.sie_coe)).to(device)
    model = DDP(net, device_ids=[local_rank])
    images_per_step = args.micro_batch * args.accum * world
    lr = args.base_lr * images_per_step / 64
    decay, no_decay = [], []
    for n, p in net.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim == 1 or n.endswith(("pos_embed", "cls_token", "sie")) else decay).append(p)
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4}, {"params": no_decay, "weight_decay": 0.0}],
                          lr=lr, momentum=0.9)
    steps_per_epoch = len(loader) // args.accum
    total, warm = args.epochs * steps_per_epoch, args.warmup * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: max(0.01, s / warm) if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    scaler = torch.cuda.amp.GradScaler()
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{world} GPUs x {args.micro_batch} x {args.accum} accum = {images_per_step} images/step, lr {lr:.4f}")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(3, device=device)
        for it, (x, y, cam, _) in enumerate(loader):
            x, y, cam = x.to(device, non_blocking=True), y.to(device, non_blocking=True), cam.to(device)
            boundary = (it + 1) % args.accum == 0
            with (contextlib.nullcontext() if boundary else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.float16):
                    logits, feat = model(x, cam)
                    l_id = ce(logits, y)
                l_tri = triplet(feat, y)
                scaler.scale((l_id + l_tri) / args.accum).backward()
            if boundary:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                sched.step()
            meter += torch.stack([l_id.detach().float(), l_tri.detach(), torch.ones((), device=device)])
        dist.all_reduce(meter)
        if rank == 0:
            print(f"epoch {epoch + 1}: id {meter[0] / meter[2]:.3f} tri {meter[1] / meter[2]:.3f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        if (epoch + 1) % 20 == 0 or epoch + 1 == args.epochs:
            feats = extract_all(net, test_set, device, world)
            if rank == 0:
                mAP, cmc = score(feats, query, gallery)
                print(f"  mAP {100 * mAP:.1f} R1 {100 * cmc[0]:.1f} R5 {100 * cmc[4]:.1f}", flush=True)
                torch.save({"model": net.state_dict(), "epoch": epoch + 1}, osp.join(args.out, f"vit_sie_{epoch + 1}.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
