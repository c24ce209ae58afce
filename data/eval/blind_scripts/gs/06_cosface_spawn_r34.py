"""CosFace R34 on a single 4/8-GPU box, started with mp.spawn (no torchrun on this cluster image).

    python train_cosface_spawn.py --rec /data/faces_emore --gpus 8
"""
import argparse
import logging
import math
import os
import pickle
import socket
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from backbones.iresnet import iresnet34
from dataset import MXFaceDataset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--rec", default="/data/faces_emore")
    p.add_argument("--num-classes", type=int, default=85742)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--margin", type=float, default=0.35)
    p.add_argument("--scale", type=float, default=64.0)
    p.add_argument("--sync-bn", action="store_true")
    p.add_argument("--output", default="work_dirs/cosface_r34")
    p.add_argument("--val", default="agedb_30")
    return p.parse_args()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class GatherLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *outs):
        outs = list(outs)
        dist.all_gather(outs, x)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        grads = list(grads)
        rank = dist.get_rank()
        reqs = [dist.reduce(grads[i], i, async_op=True) for i in range(len(grads))]
        for r in reqs:
            r.wait()
        return (grads[rank] * len(grads),) + (None,) * len(grads)


class DistCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, label):
        m = logits.max(1, keepdim=True)[0]
        dist.all_reduce(m, dist.ReduceOp.MAX)
        logits.sub_(m).exp_()
        z = logits.sum(1, keepdim=True)
        dist.all_reduce(z)
        logits.div_(z)
        idx = torch.where(label != -1)[0]
        p = torch.zeros(logits.size(0), 1, device=logits.device)
        p[idx] = logits[idx].gather(1, label[idx])
        dist.all_reduce(p)
        ctx.save_for_backward(idx, logits, label)
        return -p.clamp_min_(1e-30).log_().mean()

    @staticmethod
    def backward(ctx, g):
        idx, prob, label = ctx.saved_tensors
        onehot = torch.zeros(idx.size(0), prob.size(1), device=prob.device).scatter_(1, label[idx], 1)
        prob[idx] -= onehot
        return prob.div_(prob.size(0)) * g.item(), None


class CosFacePFC(nn.Module):
    def __init__(self, dim, num_classes, s, m, rank, world):
        super().__init__()
        self.dim, self.s, self.m, self.world = dim, s, m, world
        base, extra = divmod(num_classes, world)
        self.num_local = base + (1 if rank < extra else 0)
        self.start = base * rank + min(rank, extra)
        self.weight = nn.Parameter(torch.randn(self.num_local, dim) * 0.01)

    def forward(self, x, y):
        xs = GatherLayer.apply(x, *[torch.zeros_like(x) for _ in range(self.world)])
        ys = [torch.zeros_like(y) for _ in range(self.world)]
        dist.all_gather(ys, y)
        x, y = torch.cat(xs), torch.cat(ys).unsqueeze(1)
        inside = (y >= self.start) & (y < self.start + self.num_local)
        y = torch.where(inside, y - self.start, torch.full_like(y, -1))
        cos = F.linear(F.normalize(x), F.normalize(self.weight)).clamp(-1, 1)
        rows = torch.where(y.squeeze(1) != -1)[0]
        cos[rows, y[rows, 0]] -= self.m
        return DistCE.apply(cos * self.s, y)


def load_bin(path):
    with open(path, "rb") as f:
        bins, issame = pickle.load(f, encoding="bytes")
    arr = np.stack([cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR)[:, :, ::-1] for b in bins])
    return torch.from_numpy(arr.transpose(0, 3, 1, 2).copy()), np.asarray(issame)


@torch.no_grad()
def distributed_verify(model, imgs, issame, device, rank, world, dim=512):
    """Every rank embeds its own slice of the pairs, rank 0 scores them."""
    model.eval()
    n = imgs.size(0)
    per = math.ceil(n / world)
    lo, hi = rank * per, min(n, (rank + 1) * per)
    feats = torch.zeros(per, dim, device=device)
    for i in range(lo, hi, 256):
        x = imgs[i:min(i + 256, hi)].to(device).float().div(255).sub(0.5).div(0.5)
        feats[i - lo:i - lo + x.size(0)] = F.normalize(model(x) + model(x.flip(3)))
    out = [torch.zeros_like(feats) for _ in range(world)]
    dist.all_gather(out, feats)
    model.train()
    if rank != 0:
        return None
    feats = torch.cat(out)[:n].cpu()
    sims = (feats[0::2] * feats[1::2]).sum(1).numpy()
    return max(((sims > t) == issame).mean() for t in np.arange(-1, 1, 0.005))


def main_worker(gpu, ngpus, args):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=gpu, world_size=ngpus)
    device = torch.device("cuda", gpu)
    logging.basicConfig(level=logging.INFO if gpu == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.backends.cudnn.benchmark = True

    train_set = MXFaceDataset(root_dir=args.rec, local_rank=gpu)
    sampler = DistributedSampler(train_set, num_replicas=ngpus, rank=gpu, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_imgs, val_issame = load_bin(os.path.join(args.rec, args.val + ".bin"))

    model = iresnet34(num_features=512)
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model.to(device), device_ids=[gpu])
    head = CosFacePFC(512, args.num_classes, args.scale, args.margin, gpu, ngpus).to(device)

    lr = args.lr * args.batch_size * ngpus / 512
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": head.parameters()}],
                          lr=lr, momentum=0.9, weight_decay=5e-4)
    steps = len(loader) * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (1 - s / steps) ** 2)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for img, label in loader:
            img = img.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            loss = head(model(img), label)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            step += 1
            if gpu == 0 and step % 100 == 0:
                logging.info("epoch %d step %d/%d loss %.3f lr %.4f %.0f img/s", epoch, step, steps, loss.item(),
                             sched.get_last_lr()[0], 100 * args.batch_size * ngpus / (time.time() - tic))
                tic = time.time()

        acc = distributed_verify(model.module, val_imgs, val_issame, device, gpu, ngpus)
        if gpu == 0:
            logging.info("epoch %d %s acc %.4f", epoch, args.val, acc)
            torch.save(model.module.state_dict(), os.path.join(args.output, f"r34_ep{epoch}.pt"))
        torch.save(head.state_dict(), os.path.join(args.output, f"head_ep{epoch}_part{gpu}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    args.port = free_port()
    os.makedirs(args.output, exist_ok=True)
    mp.spawn(main_worker, nprocs=args.gpus, args=(args.gpus, args))
