"""Single Path One-Shot (SPOS) supernet training on ImageNet.

Every step a single path (one choice block per layer) is sampled uniformly
and trained. The same path is used on every rank, so the step RNG is seeded
from the global step.

    torchrun --nproc_per_node=8 01_spos_supernet.py --data /datasets/imagenet
"""
import argparse
import logging
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

logger = logging.getLogger("spos")

STAGE_REPEATS = [4, 4, 8, 4]
STAGE_CHANNELS = [64, 160, 320, 640]
NUM_CHOICES = 4


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.5, help="for a global batch of 1024")
    p.add_argument("--wd", type=float, default=4e-5)
    p.add_argument("--label-smooth", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="./output/spos")
    p.add_argument("--print-freq", type=int, default=100)
    return p.parse_args()


class ShuffleUnit(nn.Module):
    def __init__(self, inp, oup, ksize, stride):
        super().__init__()
        self.stride = stride
        mid = oup // 2
        branch_in = inp if stride == 2 else inp // 2
        branch_out = oup - inp if stride == 2 else oup // 2
        pad = ksize // 2
        self.branch = nn.Sequential(
            nn.Conv2d(branch_in, mid, 1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, mid, ksize, stride, pad, groups=mid, bias=False),
            nn.BatchNorm2d(mid),
            nn.Conv2d(mid, branch_out, 1, bias=False),
            nn.BatchNorm2d(branch_out),
            nn.ReLU(inplace=True),
        )
        if stride == 2:
            self.proj = nn.Sequential(
                nn.Conv2d(inp, inp, ksize, stride, pad, groups=inp, bias=False),
                nn.BatchNorm2d(inp),
                nn.Conv2d(inp, inp, 1, bias=False),
                nn.BatchNorm2d(inp),
                nn.ReLU(inplace=True),
            )

    def forward(self, x):
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat([x1, self.branch(x2)], dim=1)
        else:
            out = torch.cat([self.proj(x), self.branch(x)], dim=1)
        n, c, h, w = out.shape
        return out.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)


class ChoiceLayer(nn.Module):
    def __init__(self, inp, oup, stride):
        super().__init__()
        self.choices = nn.ModuleList([ShuffleUnit(inp, oup, k, stride) for k in (3, 5, 7)])
        self.choices.append(
            nn.Sequential(ShuffleUnit(inp, oup, 3, stride), ShuffleUnit(oup, oup, 3, 1))
        )

    def forward(self, x, idx):
        return self.choices[idx](x)


class SPOSSuperNet(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True)
        )
        layers, inp = [], 16
        for repeat, oup in zip(STAGE_REPEATS, STAGE_CHANNELS):
            for i in range(repeat):
                layers.append(ChoiceLayer(inp, oup, 2 if i == 0 else 1))
                inp = oup
        self.layers = nn.ModuleList(layers)
        self.head = nn.Sequential(
            nn.Conv2d(inp, 1024, 1, bias=False), nn.BatchNorm2d(1024), nn.ReLU(inplace=True)
        )
        self.classifier = nn.Linear(1024, num_classes, bias=False)

    def forward(self, x, arch):
        x = self.stem(x)
        for layer, idx in zip(self.layers, arch):
            x = layer(x, idx)
        x = self.head(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.classifier(x)


def build_loaders(args, world_size, rank):
    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_set = datasets.ImageFolder(
        os.path.join(args.data, "train"),
        transforms.Compose([
            transforms.RandomResizedCrop(224),
            transforms.ColorJitter(0.4, 0.4, 0.4),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            normalize,
        ]),
    )
    val_set = datasets.ImageFolder(
        os.path.join(args.data, "val"),
        transforms.Compose([
            transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize
        ]),
    )
    # contiguous, unpadded shard of the validation set for each rank
    val_idx = list(range(rank, len(val_set), world_size))
    val_set = torch.utils.data.Subset(val_set, val_idx)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=200, shuffle=False,
                            num_workers=args.workers, pin_memory=True)
    return train_loader, train_sampler, val_loader


def sample_arch(step, seed):
    rng = random.Random(seed * 100003 + step)
    return [rng.randrange(NUM_CHOICES) for _ in range(sum(STAGE_REPEATS))]


@torch.no_grad()
def validate(model, loader, arch, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for images, target in loader:
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        logits = model(images, arch)
        stats[0] += F.cross_entropy(logits, target, reduction="sum")
        stats[1] += (logits.argmax(1) == target).sum()
        stats[2] += target.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (100.0 * stats[1] / stats[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    train_loader, train_sampler, val_loader = build_loaders(args, world_size, rank)

    model = SPOSSuperNet().to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world_size / 1024
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.SGD(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, momentum=0.9, nesterov=True,
    )
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / total_steps)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smooth)

    os.makedirs(args.out, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (images, target) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            arch = sample_arch(step, args.seed)
            logits = model(images, arch)
            loss = criterion(logits, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if i % args.print_freq == 0:
                logger.info("epoch %d iter %d/%d loss %.4f lr %.4f %.1fs", epoch, i,
                            len(train_loader), loss.item(), scheduler.get_last_lr()[0],
                            time.time() - t0)

        # quick sanity check of a few random paths
        for j in range(3):
            arch = sample_arch(10 ** 9 + epoch * 10 + j, args.seed)
            val_loss, top1 = validate(model, val_loader, arch, device)
            logger.info("epoch %d path %d val loss %.3f top1 %.2f", epoch, j, val_loss, top1)

        if rank == 0:
            torch.save({"epoch": epoch, "step": step,
                        "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()},
                       os.path.join(args.out, "supernet_last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
