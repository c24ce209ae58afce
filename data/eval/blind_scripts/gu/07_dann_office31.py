"""Domain-adversarial training on Office-31 (A -> W etc.) with DDP.

Feature extractor + classifier live in one DDP module, the domain discriminator
in another.  Source and target batches go through the feature extractor in turn.

    torchrun --standalone --nproc_per_node=4 07_dann_office31.py --data data/office31 -s A -t W
"""
import argparse
import math
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms

DOMAIN_DIRS = {"A": "amazon", "D": "dslr", "W": "webcam"}


class GradientReverseLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return -ctx.alpha * grad, None


class Classifier(nn.Module):
    def __init__(self, num_classes=31, bottleneck_dim=256):
        super().__init__()
        backbone = models.resnet50(weights="IMAGENET1K_V2")
        self.backbone = nn.Sequential(*list(backbone.children())[:-1], nn.Flatten())
        self.bottleneck = nn.Sequential(nn.Linear(2048, bottleneck_dim), nn.BatchNorm1d(bottleneck_dim),
                                        nn.ReLU(inplace=True))
        self.fc = nn.Linear(bottleneck_dim, num_classes)

    def forward(self, x):
        f = self.bottleneck(self.backbone(x))
        return self.fc(f), f


class DomainDiscriminator(nn.Module):
    def __init__(self, in_dim=256, hidden=1024):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, 1),
        )

    def forward(self, f):
        return self.layers(f)


def make_loader(root, train, batch_size, workers, shuffle):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    if train:
        tf = transforms.Compose([transforms.Resize(256), transforms.RandomResizedCrop(224),
                                 transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    else:
        tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    ds = datasets.ImageFolder(os.path.join(root, "images"), transform=tf)
    sampler = DistributedSampler(ds, shuffle=shuffle, drop_last=train)
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=workers,
                        pin_memory=True, drop_last=train)
    return loader, sampler


def forever(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


def validate(model, loader, device):
    model.eval()
    correct = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.cuda(device, non_blocking=True), y.cuda(device, non_blocking=True)
            logits, _ = model(x)
            correct += (logits.argmax(1) == y).sum()
            count += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    model.train()
    return 100.0 * (correct / count).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="data/office31")
    parser.add_argument("-s", "--source", default="A")
    parser.add_argument("-t", "--target", default="W")
    parser.add_argument("-b", "--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--iters-per-epoch", type=int, default=1000)
    parser.add_argument("--trade-off", type=float, default=1.0)
    parser.add_argument("-j", "--workers", type=int, default=4)
    parser.add_argument("--log", default="logs/dann_office31")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    src_loader, src_sampler = make_loader(os.path.join(args.data, DOMAIN_DIRS[args.source]), True,
                                          args.batch_size, args.workers, True)
    tgt_loader, tgt_sampler = make_loader(os.path.join(args.data, DOMAIN_DIRS[args.target]), True,
                                          args.batch_size, args.workers, True)
    val_loader, _ = make_loader(os.path.join(args.data, DOMAIN_DIRS[args.target]), False,
                                2 * args.batch_size, args.workers, False)

    classifier = Classifier().to(device)
    discriminator = DomainDiscriminator().to(device)
    param_groups = [
        {"params": classifier.backbone.parameters(), "lr": 0.1 * args.lr},
        {"params": classifier.bottleneck.parameters(), "lr": args.lr},
        {"params": classifier.fc.parameters(), "lr": args.lr},
        {"params": discriminator.parameters(), "lr": args.lr},
    ]
    for g in param_groups:
        g["initial_lr"] = g["lr"]
    optimizer = torch.optim.SGD(param_groups, momentum=0.9, weight_decay=1e-3, nesterov=True)
    classifier = DDP(classifier, device_ids=[local_rank])
    discriminator = DDP(discriminator, device_ids=[local_rank])

    src_iter = forever(src_loader, src_sampler)
    tgt_iter = forever(tgt_loader, tgt_sampler)
    total = args.epochs * args.iters_per_epoch
    best_acc = 0.0
    if rank == 0:
        os.makedirs(args.log, exist_ok=True)

    for epoch in range(args.epochs):
        classifier.train()
        discriminator.train()
        end = time.time()
        for i in range(args.iters_per_epoch):
            it = epoch * args.iters_per_epoch + i
            p = it / total
            for g in optimizer.param_groups:
                g["lr"] = g["initial_lr"] * (1 + 10 * p) ** (-0.75)
            alpha = 2.0 / (1.0 + math.exp(-10 * p)) - 1.0

            x_s, y_s = next(src_iter)
            x_t, _ = next(tgt_iter)
            x_s, y_s, x_t = x_s.to(device), y_s.to(device), x_t.to(device)

            y_pred_s, f_s = classifier(x_s)
            _, f_t = classifier(x_t)

            cls_loss = F.cross_entropy(y_pred_s, y_s)
            d = discriminator(GradientReverseLayer.apply(torch.cat([f_s, f_t]), alpha))
            d_label = torch.cat([torch.ones(f_s.size(0), 1), torch.zeros(f_t.size(0), 1)]).to(device)
            transfer_loss = F.binary_cross_entropy_with_logits(d, d_label)
            domain_acc = ((d > 0).float() == d_label).float().mean()
            loss = cls_loss + args.trade_off * transfer_loss

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

            if i % 100 == 0:
                m = torch.stack([cls_loss.detach(), transfer_loss.detach(), domain_acc])
                dist.all_reduce(m)
                m /= world_size
                if rank == 0:
                    print(f"Epoch [{epoch}][{i}/{args.iters_per_epoch}] time {time.time() - end:.1f} "
                          f"cls {m[0]:.3f} transfer {m[1]:.3f} domain-acc {100 * m[2]:.1f}", flush=True)

        acc = validate(classifier, val_loader, device)
        if rank == 0:
            print(f" * epoch {epoch} target acc {acc:.3f}", flush=True)
            latest = os.path.join(args.log, "latest.pth")
            torch.save({"classifier": classifier.module.state_dict(),
                        "discriminator": discriminator.module.state_dict(),
                        "epoch": epoch, "acc": acc}, latest)
            if acc > best_acc:
                best_acc = acc
                shutil.copy(latest, os.path.join(args.log, "best.pth"))
        dist.barrier()

    if rank == 0:
        print(f"best_acc1 = {best_acc:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
