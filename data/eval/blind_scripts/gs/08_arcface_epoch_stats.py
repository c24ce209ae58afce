"""ArcFace trainer (class based) for MS1MV3 / R50 with a sharded classifier.

torchrun --standalone --nproc_per_node=8 arcface_trainer.py --output work_dirs/r50_ms1mv3_bs1024
"""
import argparse
import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import List

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
from eval import verification

logger = logging.getLogger("trainer")


@dataclass
class TrainConfig:
    rec: str = "/train_tmp/ms1m-retinaface-t1"
    output: str = "work_dirs/r50_ms1mv3"
    network: str = "r50"
    num_classes: int = 93431
    embedding_size: int = 512
    batch_size: int = 128
    lr: float = 0.1
    weight_decay: float = 5e-4
    epochs: int = 20
    warmup_epochs: int = 1
    s: float = 64.0
    m: float = 0.5
    workers: int = 4
    amp: bool = True
    val_every: int = 2000
    val_targets: List[str] = field(default_factory=lambda: ["lfw", "cfp_fp", "agedb_30"])


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, *gather_list):
        gather_list = list(gather_list)
        dist.all_gather(gather_list, tensor)
        return tuple(gather_list)

    @staticmethod
    def backward(ctx, *grads):
        grads = list(grads)
        rank = dist.get_rank()
        reqs = [dist.reduce(g, i, dist.ReduceOp.SUM, async_op=True) for i, g in enumerate(grads)]
        for r in reqs:
            r.wait()
        return (grads[rank] * len(grads), *[None for _ in grads])


class DistCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, label):
        max_logits = logits.max(dim=1, keepdim=True)[0]
        dist.all_reduce(max_logits, dist.ReduceOp.MAX)
        logits.sub_(max_logits).exp_()
        denom = logits.sum(dim=1, keepdim=True)
        dist.all_reduce(denom, dist.ReduceOp.SUM)
        logits.div_(denom)
        index = torch.where(label != -1)[0]
        loss = torch.zeros(logits.size(0), 1, device=logits.device)
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


class ArcFaceShard(nn.Module):
    def __init__(self, cfg: TrainConfig, rank: int, world_size: int):
        super().__init__()
        self.world_size = world_size
        self.dim = cfg.embedding_size
        self.num_local = cfg.num_classes // world_size + int(rank < cfg.num_classes % world_size)
        self.class_start = cfg.num_classes // world_size * rank + min(rank, cfg.num_classes % world_size)
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, self.dim)))
        self.s = cfg.s
        self.cos_m, self.sin_m = math.cos(cfg.m), math.sin(cfg.m)
        self.th, self.mm = math.cos(math.pi - cfg.m), math.sin(math.pi - cfg.m) * cfg.m

    def forward(self, emb, labels):
        bs = emb.size(0)
        embs = AllGather.apply(emb, *[torch.zeros(bs, self.dim, device=emb.device) for _ in range(self.world_size)])
        labs = [torch.zeros(bs, dtype=torch.long, device=emb.device) for _ in range(self.world_size)]
        dist.all_gather(labs, labels)
        emb, labels = torch.cat(embs), torch.cat(labs).view(-1, 1)
        pos = (labels >= self.class_start) & (labels < self.class_start + self.num_local)
        labels[~pos] = -1
        labels[pos] -= self.class_start
        with torch.cuda.amp.autocast(enabled=False):
            cos = F.linear(F.normalize(emb.float()), F.normalize(self.weight)).clamp(-1, 1)
        idx = torch.where(labels != -1)[0]
        t = cos[idx, labels[idx].view(-1)]
        phi = t * self.cos_m - (1 - t * t).clamp_min(1e-6).sqrt() * self.sin_m
        cos[idx, labels[idx].view(-1)] = torch.where(t > self.th, phi, t - self.mm)
        return DistCrossEntropy.apply(cos * self.s, labels)


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        self.is_main = self.rank == 0

        os.makedirs(cfg.output, exist_ok=True)
        logging.basicConfig(level=logging.INFO if self.is_main else logging.WARNING,
                            format="%(asctime)s | %(message)s")
        self.writer = SummaryWriter(os.path.join(cfg.output, "tb")) if self.is_main else None
        if self.is_main:
            with open(os.path.join(cfg.output, "config.json"), "w") as f:
                json.dump(dataclasses.asdict(cfg), f, indent=2)

        self.dataset = MXFaceDataset(root_dir=cfg.rec, local_rank=self.local_rank)
        self.sampler = DistributedSampler(self.dataset, shuffle=True, seed=0)
        self.loader = DataLoader(self.dataset, batch_size=cfg.batch_size, sampler=self.sampler,
                                 num_workers=cfg.workers, pin_memory=True, drop_last=True)

        backbone = get_model(cfg.network, dropout=0.0, fp16=cfg.amp, num_features=cfg.embedding_size)
        self.backbone = DistributedDataParallel(backbone.to(self.device), device_ids=[self.local_rank],
                                                broadcast_buffers=False)
        self.head = ArcFaceShard(cfg, self.rank, self.world_size).to(self.device)

        self.optimizer = torch.optim.SGD(
            [{"params": self.backbone.parameters()}, {"params": self.head.parameters()}],
            lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
        self.steps_per_epoch = len(self.loader)
        self.total_steps = self.steps_per_epoch * cfg.epochs
        warmup = self.steps_per_epoch * cfg.warmup_epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda it: (it + 1) / warmup if it < warmup else (1 - (it - warmup) / (self.total_steps - warmup)) ** 2)
        self.scaler = torch.cuda.amp.GradScaler(enabled=cfg.amp, growth_interval=100)
        self.global_step = 0

        if self.is_main:
            self.val_sets = {}
            for name in cfg.val_targets:
                path = os.path.join(cfg.rec, name + ".bin")
                if os.path.exists(path):
                    self.val_sets[name] = verification.load_bin(path, (112, 112))

    def train_epoch(self, epoch):
        self.backbone.train()
        self.sampler.set_epoch(epoch)
        seen, data_time, loss_sum = 0, 0.0, 0.0
        end = time.time()
        for img, label in self.loader:
            img = img.to(self.device, non_blocking=True)
            label = label.to(self.device, non_blocking=True)
            data_time += time.time() - end

            loss = self.head(self.backbone(img), label)
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.backbone.parameters(), 5)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.scheduler.step()
            self.global_step += 1

            seen += img.size(0)
            loss_sum += loss.item()
            if self.is_main and self.global_step % 100 == 0:
                logger.info("ep %d it %d/%d loss %.4f lr %.5f", epoch, self.global_step, self.total_steps,
                            loss.item(), self.scheduler.get_last_lr()[0])
                self.writer.add_scalar("train/loss", loss.item(), self.global_step)
            if self.global_step % self.cfg.val_every == 0:
                self.validate()
            end = time.time()

        stats = torch.tensor([seen, data_time, loss_sum], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        if self.is_main:
            images, total_data_time, total_loss = stats.tolist()
            logger.info("epoch %d done: %d images, mean loss %.4f, data wait %.1fs/rank", epoch, int(images),
                        total_loss / (self.steps_per_epoch * self.world_size), total_data_time / self.world_size)
            self.writer.add_scalar("epoch/loss", total_loss / (self.steps_per_epoch * self.world_size), epoch)

    def validate(self):
        if self.is_main:
            model = self.backbone.module
            model.eval()
            for name, (data, issame) in self.val_sets.items():
                _, _, acc, std, _, _ = verification.test((data, issame), model, 10, 10)
                logger.info("[%s][%d] Accuracy-Flip: %1.5f+-%1.5f", name, self.global_step, acc, std)
                self.writer.add_scalar(f"val/{name}", acc, self.global_step)
            model.train()
        dist.barrier()

    def save(self, epoch):
        torch.save({"head": self.head.state_dict(), "epoch": epoch},
                   os.path.join(self.cfg.output, f"head_rank{self.rank}.pt"))
        if self.is_main:
            torch.save(self.backbone.module.state_dict(), os.path.join(self.cfg.output, "model.pt"))
        dist.barrier()

    def fit(self):
        for epoch in range(self.cfg.epochs):
            self.train_epoch(epoch)
            self.save(epoch)
        if self.writer is not None:
            self.writer.close()
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    for f in dataclasses.fields(TrainConfig):
        if f.type in (int, float, str):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=f.type, default=f.default)
    parser.add_argument("--no-amp", dest="amp", action="store_false")
    args = parser.parse_args()
    cfg = TrainConfig(**vars(args))
    Trainer(cfg).fit()


if __name__ == "__main__":
    main()
