"""
ResNet101 BNNeck baseline, Market-1501. Test features are extracted on all GPUs.

    torchrun --standalone --nproc_per_node=8 09_market_r101_disteval.py --root /data/market1501
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
from torchvision.models import resnet101, ResNet101_Weights


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--ims-per-batch", type=int, default=128)
    p.add_argument("--num-instance", type=int, default=4)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--test-batch", type=int, default=128)
    p.add_argument("--eval-period", type=int, default=10)
    p.add_argument("--output-dir", default="logs/market_r101")
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def market_dir(d, relabel=False):
    pat = re.compile(r"([-\d]+)_c(\d)")
    out = []
    for p in sorted(glob(osp.join(d, "*.jpg"))):
        pid, cam = map(int, pat.search(p).groups())
        if pid == -1:
            continue
        out.append((p, pid, cam - 1))
    if relabel:
        lut = {pid: i for i, pid in enumerate(sorted({o[1] for o in out}))}
        out = [(p, lut[pid], c) for p, pid, c in out]
    return out


class CommDataset(Dataset):
    def __init__(self, items, transform):
        self.items, self.transform = items, transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, pid, cam = self.items[i]
        return {"images": self.transform(Image.open(p).convert("RGB")), "targets": pid, "camids": cam, "index": i}


class BalancedIdentitySampler(Sampler):
    def __init__(self, items, mini_batch, num_instance, rank, world, seed=0):
        self.rank, self.world, self.seed, self.k = rank, world, seed, num_instance
        self.mini_batch = mini_batch
        self.batch = mini_batch * world
        self.epoch = 0
        self.pid_index = defaultdict(list)
        for i, (_, pid, _) in enumerate(items):
            self.pid_index[pid].append(i)
        self.pids = sorted(self.pid_index)
        self.iters = sum(max(len(v), num_instance) // num_instance for v in self.pid_index.values()) \
            * num_instance // self.batch

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.iters * self.mini_batch

    def __iter__(self):
        g = np.random.default_rng(self.seed + self.epoch)
        pools = {}
        for pid in self.pids:
            v = np.array(self.pid_index[pid])
            if len(v) < self.k:
                v = g.choice(v, self.k, replace=True)
            v = g.permutation(v)
            pools[pid] = [v[i:i + self.k].tolist() for i in range(0, len(v) - self.k + 1, self.k)]
        alive = list(self.pids)
        stream = []
        while len(alive) >= self.batch // self.k and len(stream) < self.iters * self.batch:
            for pid in g.choice(alive, self.batch // self.k, replace=False).tolist():
                stream += pools[pid].pop()
                if not pools[pid]:
                    alive.remove(pid)
        for b in range(len(stream) // self.batch):
            s = b * self.batch + self.rank * self.mini_batch
            yield from stream[s:s + self.mini_batch]


class InferenceSampler(Sampler):
    """Contiguous shard per rank, padded with the first indices so every rank has the same count."""

    def __init__(self, size, rank, world):
        self.per_rank = math.ceil(size / world)
        idx = list(range(size))
        idx += idx[: self.per_rank * world - size]
        self.local = idx[rank * self.per_rank:(rank + 1) * self.per_rank]

    def __iter__(self):
        return iter(self.local)

    def __len__(self):
        return len(self.local)


class Baseline(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        r = resnet101(weights=ResNet101_Weights.IMAGENET1K_V2)
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.neck = nn.BatchNorm1d(2048)
        self.neck.bias.requires_grad_(False)
        self.cls = nn.Linear(2048, num_classes, bias=False)
        nn.init.normal_(self.cls.weight, std=0.001)

    def forward(self, x):
        f = F.adaptive_avg_pool2d(self.backbone(x), 1).flatten(1)
        bn = self.neck(f)
        if self.training:
            return self.cls(bn), f
        return bn


def triplet(f, y, margin=0.3):
    d = torch.cdist(f.float(), f.float())
    pos = y[:, None] == y[None]
    ap = torch.where(pos, d, d.new_zeros(())).amax(1)
    an = torch.where(pos, d.new_full((), 1e6), d).amin(1)
    return F.relu(ap - an + margin).mean()


def all_gather_cat(t):
    bufs = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, t)
    return torch.cat(bufs)


@torch.no_grad()
def inference(net, dataset, batch, rank, world, device):
    net.eval()
    loader = DataLoader(dataset, batch_size=batch, sampler=InferenceSampler(len(dataset), rank, world),
                        num_workers=4, pin_memory=True)
    feats, index = [], []
    for data in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            f = net(data["images"].to(device, non_blocking=True))
        feats.append(F.normalize(f.float(), dim=1).cpu())
        index.append(data["index"])
    feats = all_gather_cat(torch.cat(feats))
    index = all_gather_cat(torch.cat(index))
    out = torch.zeros(len(dataset), feats.shape[1])
    out[index] = feats
    return out


def eval_reid(dist_mat, q_pids, g_pids, q_cams, g_cams, max_rank=10):
    order = np.argsort(dist_mat, axis=1)
    all_cmc, all_ap = [], []
    for i in range(dist_mat.shape[0]):
        o = order[i]
        keep = np.invert((g_pids[o] == q_pids[i]) & (g_cams[o] == q_cams[i]))
        matches = (g_pids[o][keep] == q_pids[i]).astype(np.int32)
        if matches.sum() == 0:
            continue
        cmc = np.minimum(matches.cumsum(), 1)
        all_cmc.append(cmc[:max_rank])
        precision = matches.cumsum() / np.arange(1, len(matches) + 1)
        all_ap.append((precision * matches).sum() / matches.sum())
    return np.mean(all_cmc, axis=0), float(np.mean(all_ap))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(0)
    torch.manual_seed(0)

    train = market_dir(osp.join(args.root, "bounding_box_train"), relabel=True)
    query = market_dir(osp.join(args.root, "query"))
    gallery = market_dir(osp.join(args.root, "bounding_box_test"))
    num_classes = len({t[1] for t in train})

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.Resize((256, 128), interpolation=T.InterpolationMode.BICUBIC), T.RandomHorizontalFlip(),
                          T.Pad(10), T.RandomCrop((256, 128)), T.ToTensor(), norm, T.RandomErasing(p=0.5)])
    test_tf = T.Compose([T.Resize((256, 128), interpolation=T.InterpolationMode.BICUBIC), T.ToTensor(), norm])
    test_set = CommDataset(query + gallery, test_tf)

    mini_batch = args.ims_per_batch // world
    sampler = BalancedIdentitySampler(train, mini_batch, args.num_instance, rank, world)
    loader = DataLoader(CommDataset(train, train_tf), batch_size=mini_batch, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(Baseline(num_classes)).to(device)
    model = DDP(net, device_ids=[local_rank])
    backbone_params = [p for n, p in net.named_parameters() if n.startswith("backbone")]
    head_params = [p for n, p in net.named_parameters() if not n.startswith("backbone") and p.requires_grad]
    optim = torch.optim.AdamW([{"params": backbone_params}, {"params": head_params, "lr": args.lr * 2}],
                              lr=args.lr, weight_decay=5e-4)
    total = args.epochs * len(loader)
    warm = args.warmup_epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    scaler = torch.cuda.amp.GradScaler()
    xent = nn.CrossEntropyLoss(label_smoothing=0.1)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        acc = torch.zeros(2, device=device)
        for data in loader:
            x = data["images"].to(device, non_blocking=True)
            y = data["targets"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits, feat = model(x)
                loss = xent(logits, y)
            loss = loss + triplet(feat, y)
            optim.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optim)
            scaler.update()
            sched.step()
            acc += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch + 1} loss {acc[0] / acc[1]:.4f} time {time.time() - tic:.0f}s", flush=True)

        if (epoch + 1) % args.eval_period == 0 or epoch + 1 == args.epochs:
            feats = inference(net, test_set, args.test_batch, rank, world, device)
            if rank == 0:
                nq = len(query)
                dmat = (2 - 2 * feats[:nq] @ feats[nq:].t()).numpy()
                cmc, mAP = eval_reid(dmat, np.array([q[1] for q in query]), np.array([g[1] for g in gallery]),
                                     np.array([q[2] for q in query]), np.array([g[2] for g in gallery]))
                print(f"  mAP {mAP:.2%}  R1 {cmc[0]:.2%}  R5 {cmc[4]:.2%}", flush=True)
                torch.save({"model": net.state_dict(), "epoch": epoch + 1}, osp.join(args.output_dir, "last.pth"))
                if mAP > best:
                    best = mAP
                    torch.save({"model": net.state_dict(), "epoch": epoch + 1, "mAP": mAP},
                               osp.join(args.output_dir, "best.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
