"""Interpolation Consistency Training (Verma et al., IJCAI'19) on CIFAR-100, 10k labels.

Built on the mean-teacher code base (create_model / update_ema_variables).

    torchrun --nproc_per_node=4 20_ict_mean_teacher_cifar100.py --exp ict_c100_10k
"""
import argparse
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

LOG = logging.getLogger("ict")


def build_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/cifar100")
    p.add_argument("--exp", default="ict")
    p.add_argument("--n-labels", type=int, default=10000)
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--labeled-bs", type=int, default=32)
    p.add_argument("--unlabeled-bs", type=int, default=96)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--ema-decay", type=float, default=0.999)
    p.add_argument("--mixup-alpha", type=float, default=1.0)
    p.add_argument("--mixup-consistency", type=float, default=100.0)
    p.add_argument("--consistency-rampup-ends", type=int, default=100)
    return p


class ConvBlock(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.1))


class CNN13(nn.Module):
    def __init__(self, num_classes=100):
        super().__init__()
        self.body = nn.Sequential(
            ConvBlock(3, 128), ConvBlock(128, 128), ConvBlock(128, 128), nn.MaxPool2d(2), nn.Dropout(0.25),
            ConvBlock(128, 256), ConvBlock(256, 256), ConvBlock(256, 256), nn.MaxPool2d(2), nn.Dropout(0.25),
            ConvBlock(256, 512), ConvBlock(512, 256), ConvBlock(256, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x):
        return self.fc(self.body(x))


def create_model(num_classes, ema=False):
    model = CNN13(num_classes)
    model = model.cuda()
    if ema:
        for param in model.parameters():
            param.detach_()
    return model


def update_ema_variables(model, ema_model, alpha, global_step):
    alpha = min(1 - 1 / (global_step + 1), alpha)
    for ema_param, param in zip(ema_model.parameters(), model.parameters()):
        ema_param.data.mul_(alpha).add_(param.data, alpha=1 - alpha)


def mixup_data_sup(x, y, alpha):
    lam = np.random.beta(alpha, alpha) if alpha > 0 else 1.0
    index = torch.randperm(x.size(0), device=x.device)
    return lam * x + (1 - lam) * x[index], y, y[index], lam


def consistency_weight(final, epoch, rampup_ends):
    t = np.clip(epoch / rampup_ends, 0.0, 1.0)
    return final * float(np.exp(-5.0 * (1.0 - t) ** 2))


def cycle(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        for batch in loader:
            yield batch
        ep += 1


def main():
    args = build_parser().parse_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(1)
    np.random.seed(1 + rank)

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = transforms.Compose([transforms.RandomCrop(32, 2), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), transforms.Normalize(mean, std)])
    eval_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    train = datasets.CIFAR100(args.data, train=True, transform=train_tf)
    test = datasets.CIFAR100(args.data, train=False, transform=eval_tf)
    labels = np.asarray(train.targets)
    lab_idx = np.concatenate([np.random.RandomState(c).choice(np.flatnonzero(labels == c), args.n_labels // 100, False)
                              for c in range(100)])
    labeled = Subset(train, lab_idx)
    lab_sampler = DistributedSampler(labeled, shuffle=True, drop_last=True)
    unl_sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    unl_loader = DataLoader(train, args.unlabeled_bs, sampler=unl_sampler, num_workers=6, pin_memory=True, drop_last=True)
    lab_stream = cycle(DataLoader(labeled, args.labeled_bs, sampler=lab_sampler, num_workers=2,
                                  pin_memory=True, drop_last=True), lab_sampler)
    test_loader = DataLoader(test, 500, sampler=DistributedSampler(test, shuffle=False), num_workers=2)

    model = create_model(100).to(device)
    ema_model = create_model(100, ema=True)
    ema_model.load_state_dict(model.state_dict())
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(unl_loader))

    ckpt_dir = os.path.join("experiments", args.exp)
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    global_step, best = 0, 0.0
    for epoch in range(args.epochs):
        unl_sampler.set_epoch(epoch)
        model.train()
        ema_model.train()
        w = consistency_weight(args.mixup_consistency, epoch, args.consistency_rampup_ends)
        t0 = time.time()
        for i, (ux, _) in enumerate(unl_loader):
            lx, ly = next(lab_stream)
            lx, ly, ux = lx.to(device, non_blocking=True), ly.to(device, non_blocking=True), ux.to(device, non_blocking=True)

            # supervised mixup
            mx, ya, yb, lam = mixup_data_sup(lx, ly, args.mixup_alpha)

            # interpolation consistency: student(mix(u1,u2)) ~ mix(teacher(u1), teacher(u2))
            with torch.no_grad():
                ema_logits = ema_model(ux)
            lam_u = float(np.random.beta(args.mixup_alpha, args.mixup_alpha))
            perm = torch.randperm(ux.size(0), device=device)
            mixed_u = lam_u * ux + (1 - lam_u) * ux[perm]
            mixed_target = lam_u * ema_logits.softmax(1) + (1 - lam_u) * ema_logits.softmax(1)[perm]

            # one student forward for both batches
            out_all = model(torch.cat([mx, mixed_u]))
            out, out_u = out_all[: mx.size(0)], out_all[mx.size(0):]
            class_loss = lam * F.cross_entropy(out, ya) + (1 - lam) * F.cross_entropy(out, yb)
            mix_loss = F.mse_loss(out_u.softmax(1), mixed_target, reduction="sum") / (100 * ux.size(0))
            loss = class_loss + w * mix_loss

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            global_step += 1
            update_ema_variables(model.module, ema_model, args.ema_decay, global_step)

            if i % 100 == 0:
                LOG.info("epoch %d it %d class %.4f mix %.4f w %.2f", epoch, i, class_loss.item(), mix_loss.item(), w)

        ema_model.eval()
        tally = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                tally[0] += (ema_model(x.to(device)).argmax(1) == y.to(device)).sum()
                tally[1] += y.numel()
        dist.all_reduce(tally)
        acc = (tally[0] / tally[1]).item()
        LOG.info("epoch %d ema acc %.4f (%.0fs)", epoch, acc, time.time() - t0)
        if rank == 0 and acc > best:
            best = acc
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "ema": ema_model.state_dict(),
                        "optimizer": optimizer.state_dict()}, os.path.join(ckpt_dir, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
