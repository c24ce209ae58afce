"""Model-parallel FC with combined margin (m1, m2, m3), R50, MS1MV2.

torchrun --nproc_per_node=8 train_mp_fc.py --rec /data/faces_emore --margin 1.0 0.5 0.0
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from backbones import get_model
from dataset import MXFaceDataset
from utils.utils_callbacks import CallBackVerification

log = logging.getLogger("mpfc")


class CombinedMargin(nn.Module):
    """cos(m1 * theta + m2) - m3"""

    def __init__(self, s, m1, m2, m3):
        super().__init__()
        self.s, self.m1, self.m2, self.m3 = s, m1, m2, m3

    def forward(self, cosine, target):
        rows = torch.where(target != -1)[0]
        cols = target[rows].view(-1)
        t = cosine[rows, cols].clamp(-1 + 1e-7, 1 - 1e-7)
        if self.m1 != 1.0 or self.m2 != 0.0:
            t = torch.cos(self.m1 * torch.acos(t) + self.m2)
        t = t - self.m3
        cosine[rows, cols] = t
        return cosine * self.s


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *bufs):
        bufs = list(bufs)
        dist.all_gather(bufs, x)
        return tuple(bufs)

    @staticmethod
    def backward(ctx, *grads):
        grads = list(grads)
        me = dist.get_rank()
        handles = [dist.reduce(grads[i], i, dist.ReduceOp.SUM, async_op=True) for i in range(len(grads))]
        [h.wait() for h in handles]
        return (grads[me] * len(grads), *([None] * len(grads)))


class _ShardedSoftmaxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):
        mx_ = logits.max(1, keepdim=True)[0]
        dist.all_reduce(mx_, dist.ReduceOp.MAX)
        logits.sub_(mx_).exp_()
        s = logits.sum(1, keepdim=True)
        dist.all_reduce(s, dist.ReduceOp.SUM)
        logits.div_(s)
        rows = torch.where(target != -1)[0]
        p = torch.zeros(logits.size(0), 1, device=logits.device)
        p[rows] = logits[rows].gather(1, target[rows])
        dist.all_reduce(p, dist.ReduceOp.SUM)
        ctx.save_for_backward(rows, logits, target)
        return -p.clamp_min_(1e-30).log_().mean()

    @staticmethod
    def backward(ctx, g):
        rows, prob, target = ctx.saved_tensors
        oh = torch.zeros(rows.size(0), prob.size(1), device=prob.device)
        oh.scatter_(1, target[rows], 1)
        prob[rows] -= oh
        prob.div_(prob.size(0))
        return prob * g.item(), None


class ModelParallelFC(nn.Module):
    def __init__(self, margin, dim, num_classes, rank, world_size):
        super().__init__()
        self.margin, self.dim, self.world_size = margin, dim, world_size
        splits = [num_classes // world_size] * world_size
        for i in range(num_classes % world_size):
            splits[i] += 1
        self.num_local = splits[rank]
        self.class_start = sum(splits[:rank])
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, dim)))

    def forward(self, feat, label):
        n = feat.size(0)
        feats = _Gather.apply(feat, *[torch.zeros(n, self.dim, device=feat.device) for _ in range(self.world_size)])
        labels = [torch.zeros(n, dtype=torch.long, device=feat.device) for _ in range(self.world_size)]
        dist.all_gather(labels, label.long())
        feat = torch.cat(feats)
        target = torch.cat(labels).view(-1, 1)

        in_shard = (target >= self.class_start) & (target <= self.class_start + self.num_local)
        target = torch.where(in_shard, target - self.class_start, torch.full_like(target, -1))

        with torch.cuda.amp.autocast(False):
            cosine = F.linear(F.normalize(feat.float()), F.normalize(self.weight)).clamp(-1, 1)
        logits = self.margin(cosine, target)
        return _ShardedSoftmaxLoss.apply(logits, target)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rec", default="/data/faces_emore")
    ap.add_argument("--num-classes", type=int, default=85742)
    ap.add_argument("--num-image", type=int, default=5822653)
    ap.add_argument("--network", default="r50")
    ap.add_argument("--margin", type=float, nargs=3, default=[1.0, 0.5, 0.0])
    ap.add_argument("--scale", type=float, default=64.0)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--warmup-epochs", type=int, default=1)
    ap.add_argument("--output", default="work_dirs/mpfc_r50")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--fp16", action="store_true")
    return ap.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    os.makedirs(args.output, exist_ok=True)

    np.random.seed(1234 + rank)
    torch.manual_seed(1234 + rank)

    ds = MXFaceDataset(root_dir=args.rec, local_rank=local_rank)
    sampler = DistributedSampler(ds, shuffle=True, seed=1234)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4, pin_memory=True,
                        drop_last=True)

    backbone = get_model(args.network, dropout=0.0, fp16=args.fp16, num_features=512).to(device)
    backbone = DistributedDataParallel(backbone, device_ids=[local_rank], broadcast_buffers=False, bucket_cap_mb=16)
    margin = CombinedMargin(args.scale, *args.margin)
    fc = ModelParallelFC(margin, 512, args.num_classes, rank, world_size).to(device)

    global_batch = args.batch_size * world_size
    opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": fc.parameters()}],
                          lr=args.lr * global_batch / 1024, momentum=0.9, weight_decay=5e-4)
    steps_per_epoch = args.num_image // global_batch
    warmup = steps_per_epoch * args.warmup_epochs
    total = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / max(1, warmup)) * (1 - i / total) ** 2)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    start_epoch, global_step = 0, 0
    ckpt_file = os.path.join(args.output, f"checkpoint_gpu_{rank}.pt")
    if args.resume and os.path.isfile(ckpt_file):
        ck = torch.load(ckpt_file, map_location=device)
        backbone.module.load_state_dict(ck["backbone"])
        fc.load_state_dict(ck["fc"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, global_step = ck["epoch"], ck["global_step"]

    verifier = CallBackVerification(val_targets=["lfw", "cfp_fp", "agedb_30"], rec_prefix=args.rec)

    tic = time.time()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for img, label in loader:
            img, label = img.to(device, non_blocking=True), label.to(device, non_blocking=True)
            with torch.cuda.amp.autocast(enabled=args.fp16):
                emb = backbone(img)
            loss = fc(emb.float(), label)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            scaler.step(opt)
            scaler.update()
            sched.step()
            global_step += 1

            if rank == 0 and global_step % 50 == 0:
                log.info("epoch %d step %d/%d loss %.4f lr %.5f %.0f samples/s", epoch, global_step, total,
                         loss.item(), sched.get_last_lr()[0], 50 * global_batch / (time.time() - tic))
                tic = time.time()
            if global_step % 2000 == 0:
                verifier(global_step, backbone)

        torch.save({"backbone": backbone.module.state_dict(), "fc": fc.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "epoch": epoch + 1, "global_step": global_step}, ckpt_file)
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(args.output, "model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
