"""Visual-Decathlon style multi-domain classification.

One ResNet-50 backbone shared by all domains, one linear classifier per domain.
Domains are visited round-robin, one batch per step.

    torchrun --nproc_per_node=4 02_decathlon_multidomain.py --data_root /data/decathlon
"""
import argparse
import json
import os
import time
from itertools import cycle

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

DOMAINS = ["aircraft", "cifar100", "daimlerpedcls", "dtd", "gtsrb",
           "omniglot", "svhn", "ucf101", "vgg-flowers"]

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def get_args():
    parser = argparse.ArgumentParser(description="multi-domain training")
    parser.add_argument("--data_root", required=True)
    parser.add_argument("--domains", nargs="+", default=DOMAINS)
    parser.add_argument("--img_size", type=int, default=72)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--steps_per_epoch", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--wd", type=float, default=5e-4)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--out", default="checkpoints/decathlon")
    return parser.parse_args()


def make_transforms(size, train):
    if train:
        return T.Compose([T.RandomResizedCrop(size, scale=(0.6, 1.0)),
                          T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    return T.Compose([T.Resize(size), T.CenterCrop(size), T.ToTensor(), T.Normalize(MEAN, STD)])


class MultiDomainNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        backbone = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.classifiers = nn.ModuleDict({d: nn.Linear(2048, n) for d, n in num_classes.items()})

    def forward(self, x, domain):
        feats = self.backbone(x)
        return self.classifiers[domain](feats)


def build_loaders(args, rank, world):
    train_loaders, val_loaders, samplers, num_classes = {}, {}, {}, {}
    for d in args.domains:
        tr = torchvision.datasets.ImageFolder(os.path.join(args.data_root, d, "train"),
                                              make_transforms(args.img_size, True))
        va = torchvision.datasets.ImageFolder(os.path.join(args.data_root, d, "val"),
                                              make_transforms(args.img_size, False))
        num_classes[d] = len(tr.classes)
        samplers[d] = DistributedSampler(tr, num_replicas=world, rank=rank, shuffle=True)
        train_loaders[d] = DataLoader(tr, batch_size=args.batch_size, sampler=samplers[d],
                                      num_workers=args.workers, pin_memory=True,
                                      drop_last=True, persistent_workers=True)
        val_loaders[d] = DataLoader(va, batch_size=256, num_workers=args.workers,
                                    pin_memory=True)
    return train_loaders, val_loaders, samplers, num_classes


class DomainStream:
    """Endless iterator over one domain; reshuffles every time the domain is exhausted."""

    def __init__(self, loader, sampler):
        self.loader, self.sampler = loader, sampler
        self.passes = 0
        self._start()

    def _start(self):
        self.sampler.set_epoch(self.passes)
        self.it = iter(self.loader)

    def next(self):
        try:
            return next(self.it)
        except StopIteration:
            self.passes += 1
            self._start()
            return next(self.it)


@torch.no_grad()
def validate(net, val_loaders, device):
    net.eval()
    acc = {}
    for d, loader in val_loaders.items():
        correct = total = 0
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            correct += (net(x, d).argmax(1) == y).sum().item()
            total += y.numel()
        acc[d] = 100.0 * correct / total
    net.train()
    return acc


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.backends.cudnn.benchmark = True

    train_loaders, val_loaders, samplers, num_classes = build_loaders(args, rank, world)

    net = MultiDomainNet(num_classes)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                                weight_decay=args.wd, nesterov=True)
    total_steps = args.epochs * args.steps_per_epoch
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                    total_steps=total_steps, pct_start=0.05)

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    streams = {d: DomainStream(train_loaders[d], samplers[d]) for d in args.domains}
    order = cycle(args.domains)
    best_mean = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        loss_sum = {d: 0.0 for d in args.domains}
        loss_cnt = {d: 0 for d in args.domains}
        for step in range(args.steps_per_epoch):
            domain = next(order)
            x, y = streams[domain].next()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)

            logits = model(x, domain)
            loss = F.cross_entropy(logits, y, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()

            loss_sum[domain] += loss.item()
            loss_cnt[domain] += 1

        if rank == 0:
            g = epoch * args.steps_per_epoch
            for d in args.domains:
                writer.add_scalar(f"train_loss/{d}", loss_sum[d] / max(loss_cnt[d], 1), g)
            writer.add_scalar("lr", scheduler.get_last_lr()[0], g)
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s", flush=True)

            if (epoch + 1) % 5 == 0 or epoch + 1 == args.epochs:
                acc = validate(model.module, val_loaders, device)
                mean_acc = sum(acc.values()) / len(acc)
                for d, a in acc.items():
                    writer.add_scalar(f"val_acc/{d}", a, g)
                print(json.dumps({"epoch": epoch, "mean": mean_acc, **acc}), flush=True)
                state = {"epoch": epoch, "model": model.module.state_dict(),
                         "optimizer": optimizer.state_dict(), "num_classes": num_classes}
                torch.save(state, os.path.join(args.out, "last.pth"))
                if mean_acc > best_mean:
                    best_mean = mean_acc
                    torch.save(state, os.path.join(args.out, "best.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
