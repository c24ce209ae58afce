"""Weight-sharing supernet with elastic kernel size and expand ratio,
trained with the sandwich rule and in-place distillation.

All children share depth, so every parameter receives a gradient each step
(weights are sliced, never skipped).

    torchrun --nproc_per_node=8 08_attentive_inplace_kd.py --data /data/imagenet --out ckpt/elastic
"""
import argparse
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

KERNELS = (3, 5, 7)
EXPANDS = (3, 4, 6)
WIDTHS = (24, 40, 80, 112, 160)
BLOCKS_PER_STAGE = 3


@dataclass
class TrainCfg:
    epochs: int = 360
    batch_size: int = 64            # per GPU
    base_lr: float = 0.1            # per 256 images
    warmup_epochs: int = 5
    weight_decay: float = 1e-5
    num_random: int = 2
    workers: int = 8
    seed: int = 0


class DynamicBN(nn.BatchNorm2d):
    def forward(self, x):
        c = x.size(1)
        return F.batch_norm(x, self.running_mean[:c], self.running_var[:c], self.weight[:c], self.bias[:c],
                            self.training, self.momentum, self.eps)


class DynamicMBConv(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        hidden = cin * max(EXPANDS)
        self.stride, self.cin, self.cout = stride, cin, cout
        self.pw = nn.Conv2d(cin, hidden, 1, bias=False)
        self.bn1 = DynamicBN(hidden)
        self.dw = nn.Parameter(torch.empty(hidden, 1, max(KERNELS), max(KERNELS)))
        nn.init.kaiming_normal_(self.dw, mode="fan_out")
        self.bn2 = DynamicBN(hidden)
        self.pwl = nn.Conv2d(hidden, cout, 1, bias=False)
        self.bn3 = DynamicBN(cout)
        self.active_kernel, self.active_expand = max(KERNELS), max(EXPANDS)

    def forward(self, x):
        h = self.cin * self.active_expand
        k = self.active_kernel
        off = (max(KERNELS) - k) // 2
        y = F.silu(self.bn1(F.conv2d(x, self.pw.weight[:h])))
        w = self.dw[:h, :, off:off + k, off:off + k]
        y = F.silu(self.bn2(F.conv2d(y, w, stride=self.stride, padding=k // 2, groups=h)))
        y = self.bn3(F.conv2d(y, self.pwl.weight[:, :h]))
        if self.stride == 1 and self.cin == self.cout:
            y = y + x
        return y


class ElasticNet(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.SiLU())
        blocks, cin = [], 16
        for w in WIDTHS:
            for i in range(BLOCKS_PER_STAGE):
                blocks.append(DynamicMBConv(cin, w, 2 if i == 0 else 1))
                cin = w
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Sequential(nn.Conv2d(cin, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.SiLU())
        self.fc = nn.Linear(1280, num_classes)

    def set_subnet(self, kernels, expands):
        for b, k, e in zip(self.blocks, kernels, expands):
            b.active_kernel, b.active_expand = k, e

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        x = self.head(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def sample_subnet(rng, n, mode):
    if mode == "max":
        return [max(KERNELS)] * n, [max(EXPANDS)] * n
    if mode == "min":
        return [min(KERNELS)] * n, [min(EXPANDS)] * n
    return [rng.choice(KERNELS) for _ in range(n)], [rng.choice(EXPANDS) for _ in range(n)]


def get_loaders(root, cfg, rank, world):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train = datasets.ImageFolder(os.path.join(root, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    val = datasets.ImageFolder(os.path.join(root, "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train, cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val, range(rank, len(val), world)), 256,
                            num_workers=cfg.workers, pin_memory=True)
    return train_loader, sampler, val_loader


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        t[0] += (model(x).argmax(-1) == y).sum()
        t[1] += y.numel()
    dist.all_reduce(t)
    return (100 * t[0] / t[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", default="ckpt/elastic")
    parser.add_argument("--epochs", type=int, default=TrainCfg.epochs)
    args = parser.parse_args()
    cfg = TrainCfg(epochs=args.epochs)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    train_loader, sampler, val_loader = get_loaders(args.data, cfg, rank, world)
    net = ElasticNet().to(device)
    n_blocks = len(net.blocks)
    model = DDP(net, device_ids=[local_rank])

    lr = cfg.base_lr * cfg.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=cfg.weight_decay,
                                nesterov=True)
    iters = len(train_loader)
    warm = cfg.warmup_epochs * iters
    sched = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, 0.01, 1.0, total_iters=warm),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cfg.epochs * iters - warm)], milestones=[warm])

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            rng = random.Random(cfg.seed + epoch * iters + it)   # identical on all ranks

            net.set_subnet(*sample_subnet(rng, n_blocks, "max"))
            teacher_logits = model(x)
            loss = F.cross_entropy(teacher_logits, y, label_smoothing=0.1)
            soft = F.softmax(teacher_logits.detach(), dim=1)
            for mode in ["min"] + ["random"] * cfg.num_random:
                net.set_subnet(*sample_subnet(rng, n_blocks, mode))
                student = model(x)
                loss = loss + F.kl_div(F.log_softmax(student, dim=1), soft, reduction="batchmean")

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            sched.step()

            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} iter {it}/{iters} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.4f} {time.time() - tic:.0f}s", flush=True)

        if epoch % 10 == 9 or epoch == cfg.epochs - 1:
            for mode in ("min", "max"):
                net.set_subnet(*sample_subnet(None, n_blocks, mode))
                top1 = evaluate(model, val_loader, device)
                if rank == 0:
                    print(f"epoch {epoch} {mode} top1 {top1:.2f}", flush=True)
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "sched": sched.state_dict()}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
