#!/usr/bin/env python
"""MoCo v2 on CIFAR-100 / ImageNet-100 folders, with a kNN monitor each epoch.

torchrun --nproc_per_node=4 moco_v2.py --data /data/imagenet100 --arch resnet50 --moco-k 16384
"""
import argparse
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from PIL import ImageFilter
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


@torch.no_grad()
def concat_all_gather(tensor):
    gathered = [torch.ones_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor, async_op=False)
    return torch.cat(gathered, dim=0)


class MoCo(nn.Module):
    def __init__(self, base_encoder, dim=128, K=16384, m=0.999, T=0.2):
        super().__init__()
        self.K, self.m, self.T = K, m, T
        self.encoder_q = base_encoder(num_classes=dim)
        self.encoder_k = base_encoder(num_classes=dim)
        dim_mlp = self.encoder_q.fc.weight.shape[1]
        self.encoder_q.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.encoder_q.fc)
        self.encoder_k.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), self.encoder_k.fc)
        for pq, pk in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            pk.data.copy_(pq.data)
            pk.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, K), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        for pq, pk in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            pk.data = pk.data * self.m + pq.data * (1.0 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        keys = concat_all_gather(keys)
        bs = keys.shape[0]
        ptr = int(self.queue_ptr)
        assert self.K % bs == 0
        self.queue[:, ptr:ptr + bs] = keys.T
        self.queue_ptr[0] = (ptr + bs) % self.K

    @torch.no_grad()
    def _batch_shuffle_ddp(self, x):
        bs_this = x.shape[0]
        x_gather = concat_all_gather(x)
        bs_all = x_gather.shape[0]
        num_gpus = bs_all // bs_this
        idx_shuffle = torch.randperm(bs_all, device=x.device)
        dist.broadcast(idx_shuffle, src=0)
        idx_unshuffle = torch.argsort(idx_shuffle)
        gpu_idx = dist.get_rank()
        idx_this = idx_shuffle.view(num_gpus, -1)[gpu_idx]
        return x_gather[idx_this], idx_unshuffle

    @torch.no_grad()
    def _batch_unshuffle_ddp(self, x, idx_unshuffle):
        bs_this = x.shape[0]
        x_gather = concat_all_gather(x)
        num_gpus = x_gather.shape[0] // bs_this
        return x_gather[idx_unshuffle.view(num_gpus, -1)[dist.get_rank()]]

    def forward(self, im_q, im_k):
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            im_k, idx_unshuffle = self._batch_shuffle_ddp(im_k)
            k = F.normalize(self.encoder_k(im_k), dim=1)
            k = self._batch_unshuffle_ddp(k, idx_unshuffle)
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1) / self.T
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        self._dequeue_and_enqueue(k)
        return logits, labels


class GaussianBlur:
    def __init__(self, sigma=(0.1, 2.0)):
        self.sigma = sigma

    def __call__(self, x):
        return x.filter(ImageFilter.GaussianBlur(radius=random.uniform(*self.sigma)))


class TwoCrops:
    def __init__(self, t):
        self.t = t

    def __call__(self, x):
        return [self.t(x), self.t(x)]


@torch.no_grad()
def knn_monitor(encoder, memory_loader, test_loader, device, k=200, t=0.1, num_classes=100):
    encoder.eval()
    feats, labels = [], []
    for x, y in memory_loader:
        f = F.normalize(encoder(x.to(device, non_blocking=True)), dim=1)
        feats.append(concat_all_gather(f))
        labels.append(concat_all_gather(y.to(device, non_blocking=True)))
    bank, bank_labels = torch.cat(feats).T.contiguous(), torch.cat(labels)

    correct, total = 0, 0
    for x, y in test_loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        f = F.normalize(encoder(x), dim=1)
        sim = f @ bank
        w, idx = sim.topk(k, dim=-1)
        nl = torch.gather(bank_labels.expand(x.size(0), -1), -1, idx)
        w = (w / t).exp()
        scores = torch.zeros(x.size(0) * k, num_classes, device=device)
        scores.scatter_(1, nl.view(-1, 1), 1.0)
        pred = (scores.view(x.size(0), -1, num_classes) * w.unsqueeze(-1)).sum(1).argmax(1)
        correct += (pred == y).sum().item()
        total += y.size(0)
    encoder.train()
    return 100.0 * correct / total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=256, help="total over all GPUs")
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--moco-k", type=int, default=16384)
    ap.add_argument("--moco-t", type=float, default=0.2)
    ap.add_argument("--num-classes", type=int, default=100)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="ckpt/moco_v2")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    per_gpu = args.batch_size // world

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    aug = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.2, 1.0)),
        transforms.RandomApply([transforms.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        transforms.RandomGrayscale(p=0.2),
        transforms.RandomApply([GaussianBlur()], p=0.5),
        transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize])
    plain = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize])

    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), TwoCrops(aug))
    memory_ds = datasets.ImageFolder(os.path.join(args.data, "train"), plain)
    test_ds = datasets.ImageFolder(os.path.join(args.data, "val"), plain)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=per_gpu, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    memory_loader = DataLoader(memory_ds, batch_size=per_gpu, sampler=DistributedSampler(memory_ds, shuffle=False),
                               num_workers=args.workers, pin_memory=True)
    test_loader = DataLoader(test_ds, batch_size=per_gpu, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    model = MoCo(models.__dict__[args.arch], K=args.moco_k, T=args.moco_t).to(device)
    model = DDP(model, device_ids=[local_rank])
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=args.wd)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        lr = args.lr * 0.5 * (1.0 + math.cos(math.pi * epoch / args.epochs))
        for g in optimizer.param_groups:
            g["lr"] = lr
        model.train()
        meter = torch.zeros(3, device=device)
        for i, (images, _) in enumerate(train_loader):
            im_q = images[0].to(device, non_blocking=True)
            im_k = images[1].to(device, non_blocking=True)
            output, target = model(im_q, im_k)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            meter[0] += loss.detach() * im_q.size(0)
            meter[1] += (output.argmax(1) == target).sum()
            meter[2] += im_q.size(0)

        dist.all_reduce(meter)
        knn_acc = knn_monitor(model.module.encoder_q, memory_loader, test_loader, device,
                              num_classes=args.num_classes)
        if rank == 0:
            print(f"epoch {epoch} lr {lr:.4f} loss {(meter[0] / meter[2]).item():.4f} "
                  f"inst-acc {(100 * meter[1] / meter[2]).item():.2f} knn@200 {knn_acc:.2f}", flush=True)
            torch.save({"epoch": epoch + 1, "arch": args.arch, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, os.path.join(args.out, "checkpoint.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
