#!/usr/bin/env python3
"""DANN + target entropy minimisation on ImageCLEF-DA (i -> p), ResNet-50.

    torchrun --nproc_per_node=4 15_dann_imageclef.py --source i --target p
"""
import argparse
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms
from torchvision.datasets import ImageFolder

logger = logging.getLogger("dann")


class GradientReversal(nn.Module):
    def __init__(self):
        super().__init__()
        self.coeff = 0.0

    def forward(self, x):
        return _RevGrad.apply(x, self.coeff)


class _RevGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, coeff):
        ctx.coeff = coeff
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.coeff * g, None


class AdversarialNet(nn.Module):
    def __init__(self, num_classes, width=1024):
        super().__init__()
        r = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V1)
        self.features = nn.Sequential(*list(r.children())[:-1], nn.Flatten())
        self.bottleneck = nn.Sequential(nn.Linear(2048, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.5))
        self.classifier = nn.Linear(256, num_classes)
        self.grl = GradientReversal()
        self.discriminator = nn.Sequential(nn.Linear(256, width), nn.BatchNorm1d(width), nn.ReLU(),
                                           nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(),
                                           nn.Linear(width, 1))

    def set_grl_coeff(self, coeff):
        self.grl.coeff = coeff

    def forward(self, x):
        z = self.bottleneck(self.features(x))
        return self.classifier(z), self.discriminator(self.grl(z))

    def optim_groups(self, lr):
        return [{"params": self.features.parameters(), "lr": 0.1 * lr},
                {"params": self.bottleneck.parameters(), "lr": lr},
                {"params": self.classifier.parameters(), "lr": lr},
                {"params": self.discriminator.parameters(), "lr": lr}]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/image_CLEF")
    p.add_argument("--source", default="i")
    p.add_argument("--target", default="p")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--iters-per-epoch", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--ent-weight", type=float, default=0.1)
    p.add_argument("--max-coeff", type=float, default=1.0)
    p.add_argument("--save", default="ckpt/dann_imageclef")
    return p.parse_args()


def build_loaders(args, rank, world):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.Resize((256, 256)), transforms.RandomResizedCrop(224),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize((256, 256)), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    src = ImageFolder(os.path.join(args.root, args.source), train_tf)
    tgt = ImageFolder(os.path.join(args.root, args.target), train_tf)
    tgt_eval = ImageFolder(os.path.join(args.root, args.target), test_tf)
    s_sampler = DistributedSampler(src, shuffle=True, drop_last=True)
    t_sampler = DistributedSampler(tgt, shuffle=True, drop_last=True)
    s_loader = DataLoader(src, args.batch_size, sampler=s_sampler, num_workers=4, pin_memory=True, drop_last=True)
    t_loader = DataLoader(tgt, args.batch_size, sampler=t_sampler, num_workers=4, pin_memory=True, drop_last=True)
    e_loader = DataLoader(Subset(tgt_eval, range(rank, len(tgt_eval), world)), 100, num_workers=4)
    return (s_loader, s_sampler), (t_loader, t_sampler), e_loader, len(src.classes)


class Repeat:
    def __init__(self, loader, sampler):
        self.loader, self.sampler, self.ep = loader, sampler, 0
        self._it = iter(loader)

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            self.ep += 1
            self.sampler.set_epoch(self.ep)
            self._it = iter(self.loader)
            return next(self._it)


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    (s_loader, s_sampler), (t_loader, t_sampler), e_loader, num_classes = build_loaders(args, rank, world)
    s_iter, t_iter = Repeat(s_loader, s_sampler), Repeat(t_loader, t_sampler)

    model = AdversarialNet(num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    optimizer = torch.optim.SGD(model.optim_groups(args.lr), lr=args.lr, momentum=0.9, weight_decay=1e-3, nesterov=True)
    init_lrs = [g["lr"] for g in optimizer.param_groups]
    model = DDP(model, device_ids=[local_rank])

    total = args.epochs * args.iters_per_epoch
    best = 0.0
    if rank == 0:
        os.makedirs(args.save, exist_ok=True)
    for epoch in range(args.epochs):
        model.train()
        tic = time.time()
        for i in range(args.iters_per_epoch):
            p = (epoch * args.iters_per_epoch + i) / total
            for g, l0 in zip(optimizer.param_groups, init_lrs):
                g["lr"] = l0 * (1 + 10 * p) ** (-0.75)
            model.set_grl_coeff(args.max_coeff * (2.0 / (1.0 + math.exp(-10 * p)) - 1.0))

            xs, ys = next(s_iter)
            xt, _ = next(t_iter)
            xs, ys, xt = xs.to(device, non_blocking=True), ys.to(device, non_blocking=True), xt.to(device, non_blocking=True)
            logits, dom = model(torch.cat([xs, xt]))
            ns = xs.size(0)
            cls_loss = F.cross_entropy(logits[:ns], ys)
            dom_target = torch.cat([torch.ones(ns, 1, device=device), torch.zeros(xt.size(0), 1, device=device)])
            adv_loss = F.binary_cross_entropy_with_logits(dom, dom_target)
            pt = logits[ns:].softmax(1)
            ent_loss = -(pt * torch.log(pt + 1e-6)).sum(1).mean()
            loss = cls_loss + adv_loss + args.ent_weight * ent_loss

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if i % 100 == 0:
                logger.info("ep %d it %d cls %.3f adv %.3f ent %.3f", epoch, i, cls_loss.item(), adv_loss.item(),
                            ent_loss.item())

        model.eval()
        res = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in e_loader:
                out, _ = model(x.to(device))
                res[0] += (out.argmax(1).cpu() == y).sum().to(device)
                res[1] += y.numel()
        dist.all_reduce(res)
        acc = 100.0 * (res[0] / res[1]).item()
        logger.info("epoch %d %s->%s acc %.2f (%.0fs)", epoch, args.source, args.target, acc, time.time() - tic)
        if rank == 0 and acc > best:
            best = acc
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "acc": acc},
                       os.path.join(args.save, "best.pth"))

    logger.info("best %.2f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
