"""L2 PGD adversarial training on ImageNet (eps=3.0, 3 steps), ResNet-50,
multi-node; one process per GPU started with torch.multiprocessing.spawn.

Same command on each node, with --node-rank set per node:

    python 19_spawn_pgd_imagenet.py --data /shared/imagenet --out /shared/ckpt/l2_eps3 \
        --nodes 2 --node-rank 0 --dist-url tcp://node001:29400
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True, help="checkpoint folder on the shared filesystem")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=512, help="total over all processes")
    p.add_argument("--lr", type=float, default=0.1, help="for batch 256; scaled linearly")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--eps", type=float, default=3.0)
    p.add_argument("--attack-steps", type=int, default=3)
    p.add_argument("--workers", type=int, default=8, help="per process")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-url", default="tcp://127.0.0.1:29400")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class Normalized(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.register_buffer("m", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("s", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, x):
        return self.net((x - self.m) / self.s)


def _l2_normalize(g):
    n = g.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, 1, 1, 1)
    return g / n


def l2_pgd(model, x, y, eps, steps):
    step_size = 2.5 * eps / steps
    delta = torch.zeros_like(x)
    for _ in range(steps):
        delta.requires_grad_(True)
        with autocast():
            loss = F.cross_entropy(model(x + delta), y)
        g, = torch.autograd.grad(loss, delta)
        delta = delta.detach() + step_size * _l2_normalize(g.float())
        norms = delta.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        delta = delta * torch.clamp(eps / (norms + 1e-12), max=1.0)
        delta = (x + delta).clamp(0, 1) - x
    return (x + delta).detach()


def main_worker(gpu, ngpus_per_node, args):
    rank = args.node_rank * ngpus_per_node + gpu
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=args.dist_url, world_size=args.world_size, rank=rank)
    is_main = rank == 0
    torch.backends.cudnn.benchmark = True

    per_proc_batch = args.batch_size // args.world_size
    lr = args.lr * args.batch_size / 256

    model = Normalized(torchvision.models.__dict__[args.arch]()).cuda()
    model = DDP(model, device_ids=[gpu])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[30, 60, 80], gamma=0.1)
    scaler = GradScaler()

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    if args.resume and os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=f"cuda:{gpu}")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"]

    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.1, 0.1, 0.1), transforms.ToTensor()]))
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor()]))
    train_sampler = DistributedSampler(train_set, num_replicas=args.world_size, rank=rank)
    val_sampler = DistributedSampler(val_set, num_replicas=args.world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=per_proc_batch, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        s = torch.zeros(3).cuda()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            x_adv = l2_pgd(model, x, y, args.eps, args.attack_steps)
            with autocast():
                out = model(x_adv)
                loss = F.cross_entropy(out, y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            s[0] += loss.detach().float() * y.size(0)
            s[1] += (out.argmax(1) == y).sum()
            s[2] += y.size(0)
            if is_main and i % 200 == 0:
                print(f"epoch {epoch} [{i}/{len(train_loader)}] loss {loss.item():.3f}", flush=True)
        scheduler.step()
        dist.all_reduce(s)

        model.eval()
        v = torch.zeros(3).cuda()
        for x, y in val_loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            x_adv = l2_pgd(model, x, y, args.eps, 10)
            with torch.no_grad(), autocast():
                v[0] += (model(x).argmax(1) == y).sum()
                v[1] += (model(x_adv).argmax(1) == y).sum()
            v[2] += y.size(0)
        dist.all_reduce(v)

        if is_main:
            print(f"== epoch {epoch} ({time.time() - tic:.0f}s): train loss {(s[0] / s[2]).item():.4f} "
                  f"adv acc {(s[1] / s[2]).item():.4f} | val clean {(v[0] / v[2]).item():.4f} "
                  f"L2-PGD10 {(v[1] / v[2]).item():.4f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch + 1}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)

    dist.destroy_process_group()


def main():
    args = get_args()
    ngpus_per_node = torch.cuda.device_count()
    args.world_size = ngpus_per_node * args.nodes
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))


if __name__ == "__main__":
    main()
