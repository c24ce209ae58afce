"""Glint360K / R100 with Partial FC (sample rate 0.3).

    torchrun --nproc_per_node=8 train_glint360k.py --config configs/glint360k_r100.yaml
"""
import argparse
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from easydict import EasyDict
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from backbones import get_model
from dataset import MXFaceDataset
from eval.verification import CallBackVerification

DEFAULTS = dict(
    network="r100",
    embedding_size=512,
    num_classes=360232,
    num_image=17091657,
    rec="/train_tmp/glint360k",
    output="work_dirs/glint360k_r100",
    sample_rate=0.3,
    margin=0.5,
    scale=64.0,
    batch_size=128,      # per GPU
    lr=0.1,              # for the 8 x 128 global batch
    momentum=0.9,
    weight_decay=1e-4,
    num_epoch=20,
    warmup_epoch=2,
    num_workers=4,
    fp16=True,
    frequent=50,
    verbose=5000,
    val_targets=["lfw", "cfp_fp", "agedb_30"],
)


def all_gather_with_grad(tensor):
    world_size = dist.get_world_size()
    buffers = [torch.zeros_like(tensor) for _ in range(world_size)]
    return torch.cat(_AllGather.apply(tensor, *buffers))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, *gather_list):
        gather_list = list(gather_list)
        dist.all_gather(gather_list, tensor)
        return tuple(gather_list)

    @staticmethod
    def backward(ctx, *grads):
        grads = list(grads)
        rank = dist.get_rank()
        handles = [dist.reduce(grads[i], i, dist.ReduceOp.SUM, async_op=True) for i in range(len(grads))]
        for h in handles:
            h.wait()
        return (grads[rank] * len(grads), *[None for _ in grads])


class _DistCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, label):
        batch_size = logits.size(0)
        max_logits, _ = logits.max(dim=1, keepdim=True)
        dist.all_reduce(max_logits, dist.ReduceOp.MAX)
        logits.sub_(max_logits)
        logits.exp_()
        sum_exp = logits.sum(dim=1, keepdim=True)
        dist.all_reduce(sum_exp, dist.ReduceOp.SUM)
        logits.div_(sum_exp)
        index = torch.where(label != -1)[0]
        loss = torch.zeros(batch_size, 1, device=logits.device)
        loss[index] = logits[index].gather(1, label[index])
        dist.all_reduce(loss, dist.ReduceOp.SUM)
        ctx.save_for_backward(index, logits, label)
        return loss.clamp_min_(1e-30).log_().mean() * (-1)

    @staticmethod
    def backward(ctx, grad):
        index, logits, label = ctx.saved_tensors
        one_hot = torch.zeros(index.size(0), logits.size(1), device=logits.device)
        one_hot.scatter_(1, label[index], 1)
        logits[index] -= one_hot
        logits.div_(logits.size(0))
        return logits * grad.item(), None


class PartialFC(nn.Module):
    def __init__(self, embedding_size, num_classes, sample_rate, s, m):
        super().__init__()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.num_local = num_classes // self.world_size + int(self.rank < num_classes % self.world_size)
        self.class_start = num_classes // self.world_size * self.rank + min(self.rank, num_classes % self.world_size)
        self.num_sample = int(sample_rate * self.num_local)
        self.sample_rate = sample_rate
        self.s = s
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th, self.mm = math.cos(math.pi - m), math.sin(math.pi - m) * m
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, embedding_size)))

    def sample(self, labels, index_positive):
        with torch.no_grad():
            positive = torch.unique(labels[index_positive], sorted=True)
            if self.num_sample - positive.size(0) >= 0:
                perm = torch.rand(size=[self.num_local], device=labels.device)
                perm[positive] = 2.0
                index = torch.topk(perm, k=self.num_sample)[1].sort()[0]
            else:
                index = positive
            labels[index_positive] = torch.searchsorted(index, labels[index_positive])
        return self.weight[index]

    def forward(self, local_embeddings, local_labels):
        embeddings = all_gather_with_grad(local_embeddings)
        gathered = [torch.zeros_like(local_labels) for _ in range(self.world_size)]
        dist.all_gather(gathered, local_labels)
        labels = torch.cat(gathered).view(-1, 1).long()

        index_positive = (self.class_start <= labels) & (labels < self.class_start + self.num_local)
        labels[~index_positive] = -1
        labels[index_positive] -= self.class_start
        weight = self.sample(labels, index_positive) if self.sample_rate < 1 else self.weight

        with torch.cuda.amp.autocast(False):
            cosine = F.linear(F.normalize(embeddings.float()), F.normalize(weight)).clamp(-1, 1)
        index = torch.where(labels != -1)[0]
        target = cosine[index, labels[index].view(-1)]
        sine = (1.0 - target.pow(2)).clamp_min(1e-6).sqrt()
        phi = target * self.cos_m - sine * self.sin_m
        phi = torch.where(target > self.th, phi, target - self.mm)
        cosine[index, labels[index].view(-1)] = phi
        return _DistCrossEntropy.apply(cosine * self.s, labels)


class PolyWarmup(torch.optim.lr_scheduler._LRScheduler):
    def __init__(self, optimizer, warmup_iters, total_iters, power=2.0, last_epoch=-1):
        self.warmup_iters = warmup_iters
        self.total_iters = total_iters
        self.power = power
        super().__init__(optimizer, last_epoch)

    def get_lr(self):
        step = self.last_epoch
        if step < self.warmup_iters:
            factor = (step + 1) / self.warmup_iters
        else:
            progress = (step - self.warmup_iters) / max(1, self.total_iters - self.warmup_iters)
            factor = max(0.0, 1.0 - progress) ** self.power
        return [base * factor for base in self.base_lrs]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="")
    args = parser.parse_args()
    cfg = EasyDict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()

    os.makedirs(cfg.output, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s-rank%(process)d-%(message)s",
        handlers=[logging.FileHandler(os.path.join(cfg.output, f"training_rank{rank}.log")), logging.StreamHandler()],
    )
    writer = SummaryWriter(os.path.join(cfg.output, "tensorboard")) if rank == 0 else None

    train_set = MXFaceDataset(root_dir=cfg.rec, local_rank=local_rank)
    sampler = DistributedSampler(train_set, shuffle=True, seed=2048)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    backbone = get_model(cfg.network, dropout=0.0, fp16=cfg.fp16, num_features=cfg.embedding_size).cuda()
    backbone = DistributedDataParallel(backbone, device_ids=[local_rank], broadcast_buffers=False, bucket_cap_mb=16)
    backbone.train()
    pfc = PartialFC(cfg.embedding_size, cfg.num_classes, cfg.sample_rate, cfg.scale, cfg.margin).cuda()
    pfc.train()

    opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": pfc.parameters()}],
                          lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    cfg.warmup_step = cfg.num_image // cfg.batch_size * cfg.warmup_epoch
    cfg.total_step = cfg.num_image // cfg.batch_size * cfg.num_epoch
    scheduler = PolyWarmup(opt, cfg.warmup_step, cfg.total_step)
    scaler = torch.cuda.amp.GradScaler(growth_interval=100, enabled=cfg.fp16)

    verification = CallBackVerification(val_targets=cfg.val_targets, rec_prefix=cfg.rec,
                                        summary_writer=writer) if rank == 0 else None

    global_step = 0
    tic = time.time()
    for epoch in range(cfg.num_epoch):
        sampler.set_epoch(epoch)
        for img, labels in loader:
            img = img.cuda(non_blocking=True)
            labels = labels.cuda(non_blocking=True)
            global_step += 1

            loss = pfc(backbone(img), labels)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scheduler.step()

            if rank == 0 and global_step % cfg.frequent == 0:
                speed = cfg.frequent * cfg.batch_size * world_size / (time.time() - tic)
                tic = time.time()
                lr = scheduler.get_last_lr()[0]
                logging.info("Epoch %d Step %d/%d Loss %.4f LR %.6f Speed %.1f samples/s",
                             epoch, global_step, cfg.total_step, loss.item(), lr, speed)
                writer.add_scalar("loss", loss.item(), global_step)
                writer.add_scalar("lr", lr, global_step)

            if rank == 0 and global_step % cfg.verbose == 0:
                verification(global_step, backbone.module)

        torch.save({"epoch": epoch + 1, "pfc": pfc.state_dict()},
                   os.path.join(cfg.output, f"softmax_fc_gpu_{rank}.pt"))
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(cfg.output, "model.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
