"""Sub-center ArcFace (K=3) on noisy web faces, sharded classifier, reproducible seeding.

    torchrun --nproc_per_node=8 train_subcenter.py --rec /data/celeb500k --num-classes 500000
"""
import argparse
import logging
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from backbones import get_model
from dataset import MXFaceDataset
from partial_fc_v2 import AllGather, DistCrossEntropy
from utils.utils_callbacks import CallBackVerification

logger = logging.getLogger("subcenter")


class SubCenterArcFaceShard(nn.Module):
    """K sub-centers per identity; the closest sub-center is used as the class logit."""

    def __init__(self, num_classes, embedding_size=512, k=3, s=64.0, m=0.5):
        super().__init__()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.embedding_size, self.k, self.s = embedding_size, k, s
        self.num_local = num_classes // self.world_size + int(self.rank < num_classes % self.world_size)
        self.class_start = num_classes // self.world_size * self.rank + min(self.rank, num_classes % self.world_size)
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local * k, embedding_size)))
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th, self.mm = math.cos(math.pi - m), math.sin(math.pi - m) * m
        self.ce = DistCrossEntropy()

    def forward(self, emb, label):
        bs = emb.size(0)
        emb_list = [torch.zeros(bs, self.embedding_size, device=emb.device) for _ in range(self.world_size)]
        lab_list = [torch.zeros(bs, dtype=torch.long, device=emb.device) for _ in range(self.world_size)]
        emb = torch.cat(AllGather(emb, *emb_list))
        dist.all_gather(lab_list, label)
        label = torch.cat(lab_list).view(-1, 1)
        local = (label >= self.class_start) & (label < self.class_start + self.num_local)
        label[~local] = -1
        label[local] -= self.class_start

        cos = F.linear(F.normalize(emb), F.normalize(self.weight))
        cos = cos.view(-1, self.num_local, self.k).max(dim=2)[0].clamp(-1, 1)
        idx = torch.where(label != -1)[0]
        t = cos[idx, label[idx].view(-1)]
        sin_t = (1 - t * t).clamp_min(1e-6).sqrt()
        phi = torch.where(t > self.th, t * self.cos_m - sin_t * self.sin_m, t - self.mm)
        cos[idx, label[idx].view(-1)] = phi
        return self.ce(cos * self.s, label)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rec", default="/data/celeb500k")
    ap.add_argument("--num-classes", type=int, default=500000)
    ap.add_argument("--network", default="r100")
    ap.add_argument("--subcenters", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--warmup-epochs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=-1, help="-1: draw one on rank 0 and share it")
    ap.add_argument("--output", default="work_dirs/subcenter_r100")
    return ap.parse_args()


def setup(args):
    dist.init_process_group(backend="nccl")
    # everybody uses the seed chosen by rank 0, so that runs can be reproduced from the log
    seed = args.seed if args.seed >= 0 else random.SystemRandom().randint(0, 2 ** 31 - 1)
    seed_t = torch.tensor([seed], dtype=torch.long, device="cuda")
    dist.broadcast(seed_t, src=0)
    seed = int(seed_t.item())

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank = dist.get_rank()
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)
    return local_rank, rank, dist.get_world_size(), seed


def main():
    args = get_args()
    local_rank, rank, world_size, seed = setup(args)
    device = torch.device("cuda", local_rank)
    os.makedirs(args.output, exist_ok=True)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    logger.info("seed %d, world size %d", seed, world_size)
    writer = SummaryWriter(os.path.join(args.output, "tb")) if rank == 0 else None

    dataset = MXFaceDataset(root_dir=args.rec, local_rank=local_rank)
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    backbone = get_model(args.network, dropout=0.0, fp16=True, num_features=512).to(device)
    backbone = DistributedDataParallel(backbone, device_ids=[local_rank], broadcast_buffers=False, bucket_cap_mb=16)
    head = SubCenterArcFaceShard(args.num_classes, k=args.subcenters).to(device)

    total_batch = args.batch_size * world_size
    opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": head.parameters()}],
                          lr=args.lr * total_batch / 1024, momentum=0.9, weight_decay=5e-4)
    steps_per_epoch = len(loader)
    warmup, total = steps_per_epoch * args.warmup_epochs, steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: (i + 1) / warmup if i < warmup else (1 - (i - warmup) / (total - warmup)) ** 2)
    scaler = torch.cuda.amp.GradScaler(growth_interval=100)
    verifier = CallBackVerification(val_targets=["lfw", "cfp_fp", "agedb_30"], rec_prefix=args.rec,
                                    summary_writer=writer)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for img, label in loader:
            img = img.to(device, non_blocking=True)
            label = label.to(device, non_blocking=True)
            loss = head(backbone(img), label)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f lr %.5f %.0f img/s", epoch, step, total, loss.item(),
                            sched.get_last_lr()[0], 100 * total_batch / (time.time() - tic))
                writer.add_scalar("loss", loss.item(), step)
                tic = time.time()
            if step % 2000 == 0:
                verifier(step, backbone)

        torch.save({"head": head.state_dict(), "epoch": epoch}, os.path.join(args.output, f"subcenter_fc_gpu_{rank}.pt"))
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(args.output, "model.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
