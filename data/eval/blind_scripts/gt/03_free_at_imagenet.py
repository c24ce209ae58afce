"""'Adversarial Training for Free!' (Shafahi et al., 2019) on ImageNet, DDP version.

Each minibatch is replayed `--n-repeats` times; the perturbation is carried
over between replays and between minibatches. The number of epochs is divided
by the number of replays so the total number of gradient steps matches natural
training.

    torchrun --nnodes=1 --nproc_per_node=8 03_free_at_imagenet.py \
        --data /datasets/imagenet --out-dir runs/free_m4_eps4
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
import torchvision.models as models
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)

logger = logging.getLogger("free_at")


class Normalized(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1))

    def forward(self, x):
        return self.net((x - self.mean) / self.std)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--epochs", type=int, default=92, help="natural-training epochs (divided by m)")
    p.add_argument("--n-repeats", type=int, default=4)
    p.add_argument("--eps", type=float, default=4.0, help="in pixel units /255")
    p.add_argument("--batch-size", type=int, default=256, help="global batch size")
    p.add_argument("--lr", type=float, default=0.1, help="lr for a global batch of 256")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--resume", default="")
    p.add_argument("--print-freq", type=int, default=100)
    return p.parse_args()


def lr_at(epoch_float, base_lr, total_epochs):
    # step schedule of the original code, expressed in "free" epochs
    if epoch_float < total_epochs * 30 / 90:
        return base_lr
    if epoch_float < total_epochs * 60 / 90:
        return base_lr * 0.1
    return base_lr * 0.01


def pgd_eval(model, x, y, eps, steps):
    alpha = 2.5 * eps / steps
    delta = torch.zeros_like(x).uniform_(-eps, eps)
    delta = (x + delta).clamp(0, 1) - x
    for _ in range(steps):
        delta.requires_grad_(True)
        loss = F.cross_entropy(model(x + delta), y)
        g, = torch.autograd.grad(loss, delta)
        delta = (delta.detach() + alpha * g.sign()).clamp(-eps, eps)
        delta = (x + delta).clamp(0, 1) - x
    return (x + delta).detach()


def validate(net, val_set, rank, world_size, eps, device, workers):
    # unpadded shard per rank; counts are summed afterwards
    shard = Subset(val_set, list(range(rank, len(val_set), world_size)))
    loader = DataLoader(shard, batch_size=100, shuffle=False, num_workers=workers, pin_memory=True)
    net.eval()
    counts = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.no_grad():
            counts[0] += (net(x).argmax(1) == y).sum()
        x_adv = pgd_eval(net, x, y, eps, steps=10)
        with torch.no_grad():
            counts[1] += (net(x_adv).argmax(1) == y).sum()
        counts[2] += y.numel()
    dist.all_reduce(counts)
    return (counts[0] / counts[2]).item(), (counts[1] / counts[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)

    eps = args.eps / 255.0
    per_gpu_batch = args.batch_size // world_size
    lr = args.lr * args.batch_size / 256
    free_epochs = int(math.ceil(args.epochs / args.n_repeats))

    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
    ])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor()])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=per_gpu_batch, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)

    net = Normalized(models.__dict__[args.arch]()).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                weight_decay=args.wd)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"]
        logger.info("resumed from %s at epoch %d", args.resume, start_epoch)

    # the perturbation persists across minibatches ("free" warm start)
    global_noise = torch.zeros(per_gpu_batch, 3, 224, 224, device=device)
    steps_per_epoch = len(train_loader)

    for epoch in range(start_epoch, free_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t_epoch = time.time()
        stats = torch.zeros(3, device=device)
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            cur_lr = lr_at(epoch + i / steps_per_epoch, lr, free_epochs)
            for g in optimizer.param_groups:
                g["lr"] = cur_lr
            for _ in range(args.n_repeats):
                noise = global_noise[: x.size(0)].clone().requires_grad_(True)
                x_adv = (x + noise).clamp(0, 1)
                out = model(x_adv)
                loss = F.cross_entropy(out, y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                # ascend on the input, descend on the weights, same backward pass
                pert = eps * noise.grad.sign()
                global_noise[: x.size(0)] = (global_noise[: x.size(0)] + pert).clamp(-eps, eps)
                optimizer.step()
            stats[0] += loss.detach() * y.numel()
            stats[1] += (out.argmax(1) == y).sum()
            stats[2] += y.numel()
            if i % args.print_freq == 0:
                logger.info("epoch %d [%d/%d] loss %.3f lr %.4f", epoch, i, steps_per_epoch,
                            loss.item(), cur_lr)
        dist.all_reduce(stats)
        logger.info("epoch %d done in %.0fs: train loss %.4f, adv-train acc %.4f", epoch,
                    time.time() - t_epoch, (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item())

        clean_acc, pgd_acc = validate(net, val_set, rank, world_size, eps, device, args.workers)
        logger.info("epoch %d: val clean %.4f, PGD-10 %.4f", epoch, clean_acc, pgd_acc)

        if rank == 0:
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch + 1, "clean_acc": clean_acc, "pgd_acc": pgd_acc},
                       os.path.join(args.out_dir, "checkpoint.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
