#!/usr/bin/env python
"""MoCo v2 pre-training (ResNet-50, ImageNet) launched with torchrun.

    torchrun --nproc_per_node=8 01_moco_v2_torchrun.py --data /datasets/imagenet \
        --output runs/moco_v2_r50 --batch-size 256 --lr 0.03
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as T
from PIL import ImageFilter
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser("MoCo v2 pre-training")
    p.add_argument("--data", required=True)
    p.add_argument("--output", default="runs/moco_v2")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=256, help="total batch size over all GPUs")
    p.add_argument("--lr", type=float, default=0.03, help="lr for the total batch size")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=8, help="loader workers per process")
    p.add_argument("--moco-dim", type=int, default=128)
    p.add_argument("--moco-k", type=int, default=65536)
    p.add_argument("--moco-m", type=float, default=0.999)
    p.add_argument("--moco-t", type=float, default=0.2)
    p.add_argument("--resume", default="")
    p.add_argument("--print-freq", type=int, default=100)
    p.add_argument("--save-freq", type=int, default=10)
    return p.parse_args()


@torch.no_grad()
def concat_all_gather(tensor):
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return torch.cat(out, dim=0)


class GaussianBlur:
    def __init__(self, sigma=(0.1, 2.0)):
        self.sigma = sigma

    def __call__(self, img):
        return img.filter(ImageFilter.GaussianBlur(radius=random.uniform(*self.sigma)))


class TwoCropsTransform:
    def __init__(self, base_transform):
        self.base_transform = base_transform

    def __call__(self, x):
        return [self.base_transform(x), self.base_transform(x)]


class MoCo(nn.Module):
    def __init__(self, base_encoder, dim=128, K=65536, m=0.999, T=0.2):
        super().__init__()
        self.K, self.m, self.T = K, m, T
        self.encoder_q = base_encoder(num_classes=dim)
        self.encoder_k = base_encoder(num_classes=dim)
        hidden = self.encoder_q.fc.weight.shape[1]
        self.encoder_q.fc = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(inplace=True), self.encoder_q.fc)
        self.encoder_k.fc = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(inplace=True), self.encoder_k.fc)
        for p_q, p_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            p_k.data.copy_(p_q.data)
            p_k.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, K), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        for p_q, p_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            p_k.data.mul_(self.m).add_(p_q.data, alpha=1.0 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        keys = concat_all_gather(keys)
        n = keys.shape[0]
        ptr = int(self.queue_ptr)
        assert self.K % n == 0
        self.queue[:, ptr:ptr + n] = keys.T
        self.queue_ptr[0] = (ptr + n) % self.K

    @torch.no_grad()
    def _batch_shuffle_ddp(self, x):
        n_this = x.shape[0]
        x_all = concat_all_gather(x)
        n_all = x_all.shape[0]
        idx_shuffle = torch.randperm(n_all, device=x.device)
        dist.broadcast(idx_shuffle, src=0)
        idx_unshuffle = torch.argsort(idx_shuffle)
        idx_this = idx_shuffle.view(n_all // n_this, -1)[dist.get_rank()]
        return x_all[idx_this], idx_unshuffle

    @torch.no_grad()
    def _batch_unshuffle_ddp(self, x, idx_unshuffle):
        n_this = x.shape[0]
        x_all = concat_all_gather(x)
        n_all = x_all.shape[0]
        idx_this = idx_unshuffle.view(n_all // n_this, -1)[dist.get_rank()]
        return x_all[idx_this]

    def forward(self, im_q, im_k):
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            im_k, idx_unshuffle = self._batch_shuffle_ddp(im_k)
            k = F.normalize(self.encoder_k(im_k), dim=1)
            k = self._batch_unshuffle_ddp(k, idx_unshuffle)
        l_pos = torch.einsum("nc,nc->n", q, k).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", q, self.queue.clone().detach())
        logits = torch.cat([l_pos, l_neg], dim=1) / self.T
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        self._dequeue_and_enqueue(k)
        return logits, labels


def build_loader(args, world_size):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    aug = T.Compose([
        T.RandomResizedCrop(224, scale=(0.2, 1.0)),
        T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
        T.RandomGrayscale(p=0.2),
        T.RandomApply([GaussianBlur([0.1, 2.0])], p=0.5),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        normalize,
    ])
    dataset = datasets.ImageFolder(os.path.join(args.data, "train"), TwoCropsTransform(aug))
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size // world_size,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=True,
        drop_last=True,
        persistent_workers=True,
    )
    return loader, sampler


def adjust_learning_rate(optimizer, epoch, args):
    lr = args.lr * 0.5 * (1.0 + math.cos(math.pi * epoch / args.epochs))
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def train_one_epoch(model, loader, optimizer, criterion, epoch, args, device, rank, writer):
    model.train()
    loss_sum = torch.zeros(1, device=device)
    correct = torch.zeros(1, device=device)
    seen = torch.zeros(1, device=device)
    t0 = time.time()
    for it, (images, _) in enumerate(loader):
        im_q = images[0].to(device, non_blocking=True)
        im_k = images[1].to(device, non_blocking=True)
        logits, labels = model(im_q, im_k)
        loss = criterion(logits, labels)

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        bs = labels.shape[0]
        loss_sum += loss.detach() * bs
        correct += (logits.argmax(dim=1) == labels).sum()
        seen += bs
        if rank == 0 and it % args.print_freq == 0:
            print(f"epoch {epoch} it {it}/{len(loader)} loss {loss.item():.4f} "
                  f"{(time.time() - t0) / (it + 1):.3f}s/it", flush=True)
            if writer is not None:
                writer.add_scalar("train/loss_iter", loss.item(), epoch * len(loader) + it)

    stats = torch.cat([loss_sum, correct, seen])
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (100.0 * stats[1] / stats[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    model = MoCo(models.__dict__[args.arch], args.moco_dim, args.moco_k, args.moco_m, args.moco_t).to(device)
    model = DDP(model, device_ids=[local_rank])
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.wd)

    start_epoch = 0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location=device)
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"]
        if rank == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}")

    train_loader, train_sampler = build_loader(args, world_size)

    writer = None
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output, "tb"))

    for epoch in range(start_epoch, args.epochs):
        lr = adjust_learning_rate(optimizer, epoch, args)
        loss, acc = train_one_epoch(model, train_loader, optimizer, criterion, epoch, args, device, rank, writer)
        if rank == 0:
            print(f"== epoch {epoch} lr {lr:.4f} loss {loss:.4f} inst-acc@1 {acc:.2f}", flush=True)
            writer.add_scalar("train/loss", loss, epoch)
            writer.add_scalar("train/inst_acc1", acc, epoch)
            writer.add_scalar("train/lr", lr, epoch)
            if (epoch + 1) % args.save_freq == 0 or epoch + 1 == args.epochs:
                state = {
                    "epoch": epoch + 1,
                    "arch": args.arch,
                    "state_dict": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                }
                torch.save(state, os.path.join(args.output, "checkpoint_last.pth.tar"))
                if (epoch + 1) % 50 == 0:
                    torch.save(state, os.path.join(args.output, f"checkpoint_{epoch + 1:04d}.pth.tar"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
