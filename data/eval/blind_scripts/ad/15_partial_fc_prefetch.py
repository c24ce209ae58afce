"""Face recognition: ResNet backbone + CosFace on a model-parallel (sharded) classifier.

Data is prefetched to the GPU on a side CUDA stream so the H2D copy overlaps with compute.

    torchrun --nproc_per_node=8 15_partial_fc_prefetch.py --config configs/ms1mv3_r50.py
"""
import argparse
import importlib.util
import logging
import os
import queue as Queue
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from backbones import get_model


def load_config(path):
    spec = importlib.util.spec_from_file_location("cfg", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.config


class BackgroundGenerator(threading.Thread):
    def __init__(self, generator, local_rank, max_prefetch=6):
        super().__init__(daemon=True)
        self.queue = Queue.Queue(max_prefetch)
        self.generator = generator
        self.local_rank = local_rank
        self.start()

    def run(self):
        torch.cuda.set_device(self.local_rank)
        for item in self.generator:
            self.queue.put(item)
        self.queue.put(None)

    def __iter__(self):
        return self

    def __next__(self):
        item = self.queue.get()
        if item is None:
            raise StopIteration
        return item


class DataLoaderX(DataLoader):
    def __init__(self, *args, local_rank=0, **kwargs):
        super().__init__(*args, **kwargs)
        self.stream = torch.cuda.Stream(local_rank)
        self.local_rank = local_rank

    def __iter__(self):
        self.iter = super().__iter__()
        self.iter = BackgroundGenerator(self.iter, self.local_rank)
        self.preload()
        return self

    def preload(self):
        self.batch = next(self.iter, None)
        if self.batch is None:
            return None
        with torch.cuda.stream(self.stream):
            for k in range(len(self.batch)):
                self.batch[k] = self.batch[k].to(device=self.local_rank, non_blocking=True)

    def __next__(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        batch = self.batch
        if batch is None:
            raise StopIteration
        self.preload()
        return batch


class GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        g = torch.stack(grads)
        # every shard contributes to the gradient of every embedding
        dist.all_reduce(g)
        # x world_size because DDP averages the backbone gradients
        return g[dist.get_rank()] * dist.get_world_size()


class ShardedCosFace(nn.Module):
    """Each rank keeps num_classes / world_size class centres; logits are never materialised in full."""

    def __init__(self, embedding_size, num_classes, rank, world_size, s=64.0, m=0.4):
        super().__init__()
        self.rank, self.world_size, self.s, self.m = rank, world_size, s, m
        per = (num_classes + world_size - 1) // world_size
        self.start = per * rank
        self.num_local = max(0, min(per, num_classes - self.start))
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, embedding_size)))

    def forward(self, local_emb, local_labels):
        emb = torch.cat(GatherWithGrad.apply(local_emb))
        labels = [torch.zeros_like(local_labels) for _ in range(self.world_size)]
        dist.all_gather(labels, local_labels)
        labels = torch.cat(labels)
        logits = F.linear(F.normalize(emb), F.normalize(self.weight))
        local_mask = (labels >= self.start) & (labels < self.start + self.num_local)
        idx = torch.nonzero(local_mask).squeeze(1)
        logits[idx, labels[idx] - self.start] -= self.m
        logits = logits * self.s

        with torch.no_grad():
            max_logit = logits.max(dim=1, keepdim=True).values
            dist.all_reduce(max_logit, op=dist.ReduceOp.MAX)
        exp = torch.exp(logits - max_logit)
        sum_exp = exp.sum(dim=1, keepdim=True)
        sum_exp_all = sum_exp.detach().clone()
        dist.all_reduce(sum_exp_all)
        # log-sum-exp over all shards with a gradient that only flows through the local part
        log_z = torch.log(sum_exp_all) + (sum_exp - sum_exp.detach()) / sum_exp_all + max_logit
        target = torch.zeros_like(max_logit.squeeze(1))
        target[idx] = logits[idx, labels[idx] - self.start]
        tgt_all = target.detach().clone()
        dist.all_reduce(tgt_all)
        target = tgt_all + (target - target.detach())
        return (log_z.squeeze(1) - target).mean()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    cfg = load_config(parser.parse_args().config)

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")
    os.makedirs(cfg.output, exist_ok=True)

    tf = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize(mean=[0.5] * 3, std=[0.5] * 3)])
    train_set = datasets.ImageFolder(cfg.rec, tf)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed)
    train_loader = DataLoaderX(dataset=train_set, batch_size=cfg.batch_size, sampler=sampler,
                               num_workers=cfg.num_workers, pin_memory=True, drop_last=True)

    backbone = get_model(cfg.network, dropout=0.0, num_features=cfg.embedding_size)
    backbone = nn.SyncBatchNorm.convert_sync_batchnorm(backbone).cuda()
    backbone = DistributedDataParallel(backbone, device_ids=[local_rank], broadcast_buffers=False,
                                       bucket_cap_mb=16)
    head = ShardedCosFace(cfg.embedding_size, len(train_set.classes), rank, world_size).cuda()

    opt = torch.optim.SGD([{"params": backbone.parameters()}, {"params": head.parameters()}],
                          lr=cfg.lr * cfg.batch_size * world_size / 1024, momentum=0.9, weight_decay=cfg.weight_decay)
    total_step = len(train_loader) * cfg.num_epoch
    warmup_step = len(train_loader) * cfg.warmup_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / warmup_step if s < warmup_step else (1 - (s - warmup_step) / (total_step - warmup_step)) ** 2)

    global_step = 0
    for epoch in range(cfg.num_epoch):
        sampler.set_epoch(epoch)
        backbone.train()
        tic = time.time()
        for img, label in train_loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                emb = backbone(img)
            loss = head(emb.float(), label)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            opt.step()
            sched.step()
            global_step += 1
            if global_step % cfg.frequent == 0 and rank == 0:
                logging.info("epoch %d step %d/%d loss %.4f lr %.4f %.1f img/s", epoch, global_step, total_step,
                             loss.item(), sched.get_last_lr()[0],
                             cfg.frequent * cfg.batch_size * world_size / (time.time() - tic))
                tic = time.time()

        torch.save(head.state_dict(), os.path.join(cfg.output, f"head_rank{rank:02d}_of_{world_size}.pt"))
        if rank == 0:
            torch.save(backbone.module.state_dict(), os.path.join(cfg.output, "model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
