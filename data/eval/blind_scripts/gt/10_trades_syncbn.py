"""TRADES on CIFAR-10/100 with ResNet-18 / WRN, multi-GPU.

Natural and adversarial logits come from two separate forward passes as in the
reference implementation. BatchNorm is synchronised across GPUs, and DDP's
per-forward buffer broadcast is turned off because the first forward's
BatchNorm buffers are still needed by the backward pass.

    torchrun --nproc_per_node=8 10_trades_syncbn.py --dataset cifar100 --arch wrn28_10 \
        --run-name trades_c100_wrn28 --wandb
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from models import build_model


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="cifar10", choices=["cifar10", "cifar100"])
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--data-root", default="/datasets")
    p.add_argument("--ckpt-root", default="./checkpoints")
    p.add_argument("--run-name", default="trades")
    p.add_argument("--epochs", type=int, default=110)
    p.add_argument("--batch-size", type=int, default=512, help="global batch")
    p.add_argument("--base-lr", type=float, default=0.1, help="lr for global batch 128")
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--eps", type=float, default=8 / 255)
    p.add_argument("--alpha", type=float, default=2 / 255)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--beta", type=float, default=6.0)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--wandb", action="store_true")
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def trades_adv(model, x, eps, alpha, steps):
    kl = nn.KLDivLoss(reduction="sum")
    with torch.no_grad():
        p_nat = F.softmax(model(x), dim=1)
    x_adv = x + 0.001 * torch.randn_like(x)
    for _ in range(steps):
        x_adv.requires_grad_(True)
        loss = kl(F.log_softmax(model(x_adv), dim=1), p_nat)
        g, = torch.autograd.grad(loss, [x_adv])
        x_adv = x_adv.detach() + alpha * g.sign()
        x_adv = torch.min(torch.max(x_adv, x - eps), x + eps).clamp(0.0, 1.0)
    return x_adv.detach()


def pgd(model, x, y, eps, alpha, steps):
    x_adv = (x + torch.empty_like(x).uniform_(-eps, eps)).clamp(0, 1)
    for _ in range(steps):
        x_adv.requires_grad_(True)
        g, = torch.autograd.grad(F.cross_entropy(model(x_adv), y), [x_adv])
        x_adv = x_adv.detach() + alpha * g.sign()
        x_adv = torch.min(torch.max(x_adv, x - eps), x + eps).clamp(0, 1)
    return x_adv.detach()


@torch.no_grad()
def _acc(model, x, y):
    return (model(x).argmax(1) == y).sum()


def evaluate(net, test_set, args, rank, world, device):
    # strided shard without padding, so every test image is counted exactly once
    shard = Subset(test_set, range(rank, len(test_set), world))
    loader = DataLoader(shard, batch_size=256, num_workers=2, pin_memory=True)
    net.eval()
    c = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        c[0] += _acc(net, x, y)
        c[1] += _acc(net, pgd(net, x, y, args.eps, args.alpha, 20), y)
        c[2] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[2]).item(), (c[1] / c[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    ckpt_dir = os.path.join(args.ckpt_root, args.run_name)
    ckpt_path = os.path.join(ckpt_dir, "last.pt")
    run = None
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        if args.wandb:
            import wandb
            run = wandb.init(project="robust-training", name=args.run_name, config=vars(args),
                             resume="allow")

    ds_cls = datasets.CIFAR10 if args.dataset == "cifar10" else datasets.CIFAR100
    num_classes = 10 if args.dataset == "cifar10" else 100
    root = os.path.join(args.data_root, args.dataset)
    train_set = ds_cls(root, train=True, transform=transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor()]))
    test_set = ds_cls(root, train=False, transform=transforms.ToTensor())
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)

    net = build_model(args.arch, num_classes=num_classes)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank], broadcast_buffers=False)

    lr = args.base_lr * args.batch_size / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    iters_per_epoch = len(loader)
    milestones = [int(args.epochs * 0.75) * iters_per_epoch, int(args.epochs * 0.9) * iters_per_epoch]
    warmup = args.warmup_epochs * iters_per_epoch

    def lr_lambda(it):
        if it < warmup:
            return (it + 1) / warmup
        return 0.1 ** sum(it >= m for m in milestones)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    start_epoch, best = 0, 0.0
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch, best = ck["epoch"], ck["best"]
        if rank == 0:
            print(f"resumed from epoch {start_epoch}")

    kl = nn.KLDivLoss(reduction="batchmean")
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        tot = torch.zeros(3, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            model.eval()
            x_adv = trades_adv(model, x, args.eps, args.alpha, args.steps)
            model.train()
            logits_nat = model(x)
            logits_adv = model(x_adv)
            loss_nat = F.cross_entropy(logits_nat, y)
            loss_rob = kl(F.log_softmax(logits_adv, dim=1), F.softmax(logits_nat, dim=1))
            loss = loss_nat + args.beta * loss_rob
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            tot += torch.stack([loss_nat.detach(), loss_rob.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        nat, rob = evaluate(net, test_set, args, rank, world, device)

        if rank == 0:
            msg = dict(epoch=epoch, loss_nat=(tot[0] / tot[2]).item(), loss_rob=(tot[1] / tot[2]).item(),
                       test_nat=nat, test_pgd20=rob, lr=scheduler.get_last_lr()[0],
                       epoch_time=time.time() - tic)
            print(msg, flush=True)
            if run is not None:
                run.log(msg, step=epoch)
            best = max(best, rob)
            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch + 1, "best": best}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if rob >= best:
                torch.save(net.state_dict(), os.path.join(ckpt_dir, "best.pt"))

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
