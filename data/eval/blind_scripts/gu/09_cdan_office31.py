"""CDAN+E (Long et al., NeurIPS'18) on Office-31 with DistributedDataParallel.

    torchrun --nproc_per_node=2 09_cdan_office31.py data/office31 -s A -t W --epochs 20
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models
from torchvision import transforms as T

DOMAINS = {"A": "amazon", "D": "dslr", "W": "webcam"}


class GradientReverseFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, coeff=1.0):
        ctx.coeff = coeff
        return x * 1.0

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.neg() * ctx.coeff, None


class WarmStartGRL(nn.Module):
    def __init__(self, alpha=1.0, lo=0.0, hi=1.0, max_iters=1000):
        super().__init__()
        self.alpha, self.lo, self.hi, self.max_iters = alpha, lo, hi, max_iters
        self.iter_num = 0

    def forward(self, x):
        coeff = (2.0 * (self.hi - self.lo) / (1.0 + math.exp(-self.alpha * self.iter_num / self.max_iters))
                 - (self.hi - self.lo) + self.lo)
        return GradientReverseFunction.apply(x, coeff)

    def step(self):
        self.iter_num += 1


class ImageClassifier(nn.Module):
    def __init__(self, num_classes, bottleneck_dim=256):
        super().__init__()
        resnet = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V1)
        resnet.fc = nn.Identity()
        self.backbone = resnet
        self.bottleneck = nn.Sequential(nn.Linear(2048, bottleneck_dim), nn.BatchNorm1d(bottleneck_dim), nn.ReLU())
        self.head = nn.Linear(bottleneck_dim, num_classes)
        self.features_dim = bottleneck_dim

    def forward(self, x):
        f = self.bottleneck(self.backbone(x))
        return self.head(f), f

    def get_parameters(self, base_lr=1.0):
        return [
            {"params": self.backbone.parameters(), "lr": 0.1 * base_lr},
            {"params": self.bottleneck.parameters(), "lr": base_lr},
            {"params": self.head.parameters(), "lr": base_lr},
        ]


class DomainDiscriminator(nn.Module):
    def __init__(self, in_feature, hidden_size=1024):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_feature, hidden_size), nn.BatchNorm1d(hidden_size), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(hidden_size, hidden_size), nn.BatchNorm1d(hidden_size), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(hidden_size, 1),
        )

    def forward(self, x):
        return self.net(x)

    def get_parameters(self, base_lr=1.0):
        return [{"params": self.parameters(), "lr": base_lr}]


def entropy_weight(p):
    ent = -(p * torch.log(p + 1e-5)).sum(1)
    return 1.0 + torch.exp(-ent)


def cdan_loss(discriminator, grl, g, f, n_source):
    h = torch.bmm(g.unsqueeze(2), f.unsqueeze(1)).flatten(1)
    d = discriminator(grl(h))
    d_label = torch.cat([torch.ones(n_source, 1), torch.zeros(g.size(0) - n_source, 1)]).to(d.device)
    w = entropy_weight(g)
    w = torch.cat([w[:n_source] / w[:n_source].sum(), w[n_source:] / w[n_source:].sum()]) * g.size(0) / 2
    return F.binary_cross_entropy_with_logits(d, d_label, weight=w.view(-1, 1).detach())


def build_loader(root, domain, train, batch_size, workers):
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tf = (T.Compose([T.Resize(256), T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm])
          if train else T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    ds = datasets.ImageFolder(os.path.join(root, DOMAINS[domain], "images"), tf)
    sampler = DistributedSampler(ds, shuffle=train, drop_last=train)
    return DataLoader(ds, batch_size, sampler=sampler, num_workers=workers, pin_memory=True, drop_last=train)


class ForeverDataIterator:
    def __init__(self, loader):
        self.loader, self.epoch = loader, 0
        self.loader.sampler.set_epoch(self.epoch)
        self.it = iter(loader)

    def __next__(self):
        try:
            return next(self.it)
        except StopIteration:
            self.epoch += 1
            self.loader.sampler.set_epoch(self.epoch)
            self.it = iter(self.loader)
            return next(self.it)


def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, y in loader:
            out, _ = model(x.to(device))
            acc[0] += (out.argmax(1).cpu() == y).sum().item()
            acc[1] += y.size(0)
    dist.all_reduce(acc)
    model.train()
    return 100.0 * acc[0].item() / acc[1].item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("-s", "--source", default="A")
    parser.add_argument("-t", "--target", default="W")
    parser.add_argument("-b", "--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--lr-gamma", type=float, default=0.001)
    parser.add_argument("--lr-decay", type=float, default=0.75)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("-i", "--iters-per-epoch", type=int, default=1000)
    parser.add_argument("--trade-off", type=float, default=1.0)
    parser.add_argument("-j", "--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--log", default="logs/cdan")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_source = build_loader(args.root, args.source, True, args.batch_size, args.workers)
    train_target = build_loader(args.root, args.target, True, args.batch_size, args.workers)
    val_loader = build_loader(args.root, args.target, False, 2 * args.batch_size, args.workers)
    num_classes = len(train_source.dataset.classes)

    classifier = ImageClassifier(num_classes).to(device)
    domain_discri = DomainDiscriminator(classifier.features_dim * num_classes).to(device)
    classifier = DistributedDataParallel(classifier, device_ids=[local_rank])
    domain_discri = DistributedDataParallel(domain_discri, device_ids=[local_rank])
    grl = WarmStartGRL(alpha=1.0, lo=0.0, hi=1.0, max_iters=1000)

    optimizer = torch.optim.SGD(classifier.get_parameters() + domain_discri.get_parameters(),
                                lr=args.lr, momentum=0.9, weight_decay=1e-3, nesterov=True)
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    src_iter, tgt_iter = ForeverDataIterator(train_source), ForeverDataIterator(train_target)

    if rank == 0:
        os.makedirs(args.log, exist_ok=True)
    best_acc, it = 0.0, 0
    for epoch in range(args.epochs):
        classifier.train()
        domain_discri.train()
        tic = time.time()
        for i in range(args.iters_per_epoch):
            for g, base in zip(optimizer.param_groups, base_lrs):
                g["lr"] = base * (1 + args.lr_gamma * it) ** (-args.lr_decay)
            x_s, labels_s = next(src_iter)
            x_t, _ = next(tgt_iter)
            x = torch.cat([x_s, x_t]).to(device, non_blocking=True)
            labels_s = labels_s.to(device, non_blocking=True)

            y, f = classifier(x)
            y_s = y[: x_s.size(0)]
            cls_loss = F.cross_entropy(y_s, labels_s)
            transfer_loss = cdan_loss(domain_discri, grl, F.softmax(y, 1).detach(), f, x_s.size(0))
            loss = cls_loss + args.trade_off * transfer_loss

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            grl.step()
            it += 1

            if i % 100 == 0:
                vals = torch.stack([cls_loss.detach(), transfer_loss.detach()])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"Epoch: [{epoch}][{i}/{args.iters_per_epoch}] Cls Loss {vals[0]:.3f} "
                          f"Transfer Loss {vals[1]:.3f} ({time.time() - tic:.0f}s)", flush=True)

        acc1 = validate(classifier, val_loader, device)
        if rank == 0:
            print(f" * Acc@1 {acc1:.3f}", flush=True)
            torch.save(classifier.module.state_dict(), os.path.join(args.log, "latest.pth"))
            if acc1 > best_acc:
                best_acc = acc1
                torch.save(classifier.module.state_dict(), os.path.join(args.log, "best.pth"))
        dist.barrier()

    if rank == 0:
        print(f"best_acc1 = {best_acc:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
