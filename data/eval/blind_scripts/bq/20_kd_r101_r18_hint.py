"""ImageNet KD: ResNet-101 teacher -> ResNet-18 student, logit KD with an optional
FitNets-style hint on the last stage (1x1 conv regressor from 512 to 2048 channels).

    torchrun --nproc_per_node=8 20_kd_r101_r18_hint.py --data /datasets/imagenet --out runs/r18_kd
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


class Backbone(nn.Module):
    """torchvision ResNet split into features / head so the last feature map is available."""

    def __init__(self, resnet):
        super().__init__()
        self.stem = nn.Sequential(resnet.conv1, resnet.bn1, resnet.relu, resnet.maxpool)
        self.stages = nn.Sequential(resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4)
        self.fc = resnet.fc

    def forward(self, x):
        feat = self.stages(self.stem(x))
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(feat, 1), 1))
        return logits, feat


class Student(nn.Module):
    def __init__(self, teacher_channels=2048):
        super().__init__()
        self.net = Backbone(torchvision.models.resnet18(weights=None))
        self.regressor = nn.Sequential(
            nn.Conv2d(512, teacher_channels, kernel_size=1, bias=False),
            nn.BatchNorm2d(teacher_channels),
        )

    def forward(self, x, with_hint=False):
        logits, feat = self.net(x)
        if with_hint:
            return logits, self.regressor(feat)
        return logits


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1, help="for a global batch of 256")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--T", type=float, default=4.0)
    p.add_argument("--kd-weight", type=float, default=1.0)
    p.add_argument("--hint-weight", type=float, default=0.0, help="FitNets hint loss weight (0 disables)")
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


def kd_kl(s, t, T):
    return F.kl_div(F.log_softmax(s / T, 1), F.softmax(t / T, 1), reduction="batchmean") * T * T


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        acc[0] += (model(x).argmax(1) == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return (100 * acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"),
                                                 T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(),
                                                            T.ToTensor(), norm]))
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"),
                                               T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=200,
                            num_workers=args.workers, pin_memory=True)

    teacher = Backbone(torchvision.models.resnet101(weights="IMAGENET1K_V2")).to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    student = Student(teacher_channels=2048).to(device)
    student = DDP(student, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(student.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)
    total_iters = args.epochs * len(train_loader)
    warmup = 5 * len(train_loader)
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=warmup),
         torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_iters - warmup)],
        milestones=[warmup],
    )

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad():
                t_logits, t_feat = teacher(x)
            if args.hint_weight > 0:
                s_logits, s_hint = student(x, with_hint=True)
                hint = F.mse_loss(s_hint, t_feat)
            else:
                s_logits = student(x)
                hint = torch.zeros((), device=device)
            loss = F.cross_entropy(s_logits, y) + args.kd_weight * kd_kl(s_logits, t_logits, args.T) \
                + args.hint_weight * hint
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} it {i}/{len(train_loader)} loss {loss.item():.4f} hint {hint.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.4f}")

        top1 = evaluate(student, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: student top1 {top1:.2f} ({time.time() - t0:.0f}s)")
            state = {"student": student.module.net.state_dict(), "regressor": student.module.regressor.state_dict(),
                     "optimizer": optimizer.state_dict(), "epoch": epoch, "top1": top1}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if top1 > best:
                best = top1
                torch.save(student.module.net.state_dict(), os.path.join(args.out, "best_r18.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
