#!/usr/bin/env python
# DukeMTMC-reID / Market-1501 training with distributed feature extraction.
#
#   torchrun --nproc_per_node=4 02_duke_dist_eval.py --root /data/reid --dataset dukemtmc
#
import argparse
import glob
import logging
import os
import os.path as osp
import random
import re
import sys
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

DATASETS = {
    "market1501": ("Market-1501-v15.09.15", "bounding_box_train", "query", "bounding_box_test"),
    "dukemtmc": ("DukeMTMC-reID", "bounding_box_train", "query", "bounding_box_test"),
}
PATTERN = re.compile(r"([-\d]+)_c(\d+)")

logger = logging.getLogger("reid")


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="/data/reid")
    parser.add_argument("--dataset", default="dukemtmc", choices=DATASETS.keys())
    parser.add_argument("--batch-size", type=int, default=64, help="images per iteration over all GPUs")
    parser.add_argument("--num-instances", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=120)
    parser.add_argument("--base-lr", type=float, default=3.5e-4)
    parser.add_argument("--wd", type=float, default=5e-4)
    parser.add_argument("--margin", type=float, default=0.3)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--out", default="./output/duke_r50")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def read_split(folder, relabel):
    paths = sorted(glob.glob(osp.join(folder, "*.jpg")))
    records = []
    for p in paths:
        pid, cam = map(int, PATTERN.search(osp.basename(p)).groups())
        if pid == -1:
            continue
        records.append([p, pid, cam - 1])
    if relabel:
        mapping = {pid: i for i, pid in enumerate(sorted({r[1] for r in records}))}
        for r in records:
            r[1] = mapping[r[1]]
    return [tuple(r) for r in records]


class ReIDImages(Dataset):
    def __init__(self, records, transform):
        self.records, self.transform = records, transform

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        path, pid, cam = self.records[i]
        return self.transform(Image.open(path).convert("RGB")), pid, cam


class DistributedPKSampler(Sampler):
    """Identity-balanced sampler for DDP. The global P x K order is drawn from a
    generator seeded with seed + epoch, so it is identical on every rank; rank r
    takes the r-th slice of each global batch (P / world identities, K each)."""

    def __init__(self, records, batch_size, k, world_size, rank, seed=0):
        assert batch_size % (k * world_size) == 0, "batch must split into whole identities per GPU"
        self.k, self.world_size, self.rank, self.seed = k, world_size, rank, seed
        self.batch_size = batch_size
        self.per_rank = batch_size // world_size
        self.epoch = 0
        self.by_pid = defaultdict(list)
        for i, (_, pid, _) in enumerate(records):
            self.by_pid[pid].append(i)
        self.pids = sorted(self.by_pid)
        n = sum(max(len(v), k) // k * k for v in self.by_pid.values())
        self.num_batches = n // batch_size

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.num_batches * self.per_rank

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        groups = {}
        for pid in self.pids:
            idx = torch.tensor(self.by_pid[pid])
            if len(idx) < self.k:
                idx = idx[torch.randint(len(idx), (self.k,), generator=g)]
            idx = idx[torch.randperm(len(idx), generator=g)].tolist()
            groups[pid] = [idx[j:j + self.k] for j in range(0, len(idx) // self.k * self.k, self.k)]
        p = self.batch_size // self.k
        alive = list(self.pids)
        flat = []
        while len(alive) >= p and len(flat) < self.num_batches * self.batch_size:
            pick = torch.randperm(len(alive), generator=g)[:p].tolist()
            chosen = [alive[j] for j in pick]
            for pid in chosen:
                flat.extend(groups[pid].pop())
                if not groups[pid]:
                    alive.remove(pid)
        for b in range(len(flat) // self.batch_size):
            s = b * self.batch_size + self.rank * self.per_rank
            yield from flat[s:s + self.per_rank]


class BNNeckResNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        net = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V1)
        net.layer4[0].conv2.stride = (1, 1)
        net.layer4[0].downsample[0].stride = (1, 1)
        self.backbone = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool,
                                      net.layer1, net.layer2, net.layer3, net.layer4)
        self.neck = nn.BatchNorm1d(2048)
        self.neck.bias.requires_grad_(False)
        self.head = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.head.weight, std=0.001)

    def forward(self, x):
        f = F.adaptive_avg_pool2d(self.backbone(x), 1).flatten(1)
        bn = self.neck(f)
        if not self.training:
            return bn
        return self.head(bn), f


def hard_triplet(feats, labels, margin):
    d = torch.cdist(feats, feats).clamp(min=1e-12)
    same = labels[:, None] == labels[None, :]
    ap = torch.where(same, d, torch.zeros_like(d)).amax(1)
    an = torch.where(same, torch.full_like(d, 1e4), d).amin(1)
    return F.relu(ap - an + margin).mean()


def gather_varlen(t):
    """all_gather for tensors whose first dim differs across ranks."""
    world = dist.get_world_size()
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    longest = max(sizes)
    padded = torch.zeros((longest,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[:t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes)])


def compute_map_cmc(dist_qg, q_pids, g_pids, q_cams, g_cams, topk=10):
    order = np.argsort(dist_qg, axis=1)
    aps, cmcs = [], []
    for i in range(len(q_pids)):
        o = order[i]
        keep = ~((g_pids[o] == q_pids[i]) & (g_cams[o] == q_cams[i]))
        hit = (g_pids[o][keep] == q_pids[i]).astype(np.float64)
        if hit.sum() == 0:
            continue
        cmc = np.minimum(hit.cumsum(), 1)[:topk]
        cmcs.append(cmc)
        prec = hit.cumsum() / np.arange(1, len(hit) + 1)
        aps.append((prec * hit).sum() / hit.sum())
    return float(np.mean(aps)), np.mean(np.stack(cmcs), 0)


@torch.no_grad()
def evaluate(net, records, transform, num_query, rank, world, device):
    """Every rank embeds a strided share of query+gallery; features are gathered
    (with their pids / cams, so order does not matter) and scored on rank 0."""
    net.eval()
    share = list(range(rank, len(records), world))
    loader = DataLoader(ReIDImages([records[i] for i in share], transform),
                        batch_size=128, num_workers=4, pin_memory=True)
    feats, meta = [], []
    for img, pid, cam in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            out = net(img.to(device, non_blocking=True))
        feats.append(F.normalize(out.float(), dim=1))
        meta.append(torch.stack([pid, cam], 1))
    idx = torch.tensor(share, device=device)
    feats = gather_varlen(torch.cat(feats))
    meta = gather_varlen(torch.cat(meta).to(device))
    idx = gather_varlen(idx)
    if rank != 0:
        return None
    is_query = idx < num_query
    qf, gf = feats[is_query], feats[~is_query]
    qm, gm = meta[is_query].cpu().numpy(), meta[~is_query].cpu().numpy()
    d = (1 - qf @ gf.t()).cpu().numpy()
    return compute_map_cmc(d, qm[:, 0], gm[:, 0], qm[:, 1], gm[:, 1])


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [r{rank}] %(message)s", stream=sys.stdout)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    folder, tr, q, g = DATASETS[args.dataset]
    base = osp.join(args.root, folder)
    train = read_split(osp.join(base, tr), relabel=True)
    query, gallery = read_split(osp.join(base, q), False), read_split(osp.join(base, g), False)
    num_classes = len({r[1] for r in train})
    logger.info("%s: %d ids / %d imgs, query %d, gallery %d",
                args.dataset, num_classes, len(train), len(query), len(gallery))

    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    train_tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10),
                          T.RandomCrop((256, 128)), T.ToTensor(), T.Normalize(mean, std),
                          T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128)), T.ToTensor(), T.Normalize(mean, std)])

    sampler = DistributedPKSampler(train, args.batch_size, args.num_instances, world, rank, args.seed)
    loader = DataLoader(ReIDImages(train, train_tf), batch_size=args.batch_size // world, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)

    net = BNNeckResNet(num_classes)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank], broadcast_buffers=False)

    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.Adam(params, lr=args.base_lr, weight_decay=args.wd)
    iters = len(loader)
    warm = 10 * iters
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda it: min(1.0, (it + 1) / warm) * (0.1 ** sum(it >= m * iters for m in (40, 70))))
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)

    os.makedirs(args.out, exist_ok=True)
    ckpt_path = osp.join(args.out, "checkpoint.pth")
    start_epoch = 0
    if osp.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        sched.load_state_dict(ckpt["sched"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"]
        logger.info("resumed from epoch %d", start_epoch)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        stats = torch.zeros(3, device=device)
        for imgs, pids, _ in loader:
            imgs, pids = imgs.to(device, non_blocking=True), pids.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                logits, feats = model(imgs)
                l_id = ce(logits, pids)
            l_tri = hard_triplet(feats.float(), pids, args.margin)
            loss = l_id + l_tri
            optim.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optim)
            scaler.update()
            sched.step()
            acc = (logits.argmax(1) == pids).float().mean()
            stats += torch.stack([l_id.detach(), l_tri.detach(), acc])
        dist.all_reduce(stats)
        stats /= world * iters
        logger.info("ep %d  id %.3f  tri %.3f  acc %.3f  lr %.2e  %.0fs", epoch + 1, *stats.tolist(),
                    sched.get_last_lr()[0], time.time() - tic)

        if rank == 0:
            torch.save({"model": net.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
                        "scaler": scaler.state_dict(), "epoch": epoch + 1}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            res = evaluate(net, query + gallery, test_tf, len(query), rank, world, device)
            if res is not None:
                mAP, cmc = res
                logger.info("eval ep %d  mAP %.1f  R1 %.1f  R5 %.1f", epoch + 1, 100 * mAP, 100 * cmc[0], 100 * cmc[4])
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
