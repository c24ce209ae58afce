"""PGD-AT sweep runner (CIFAR-100, PreAct/WRN), DDP, results logged to W&B.

    torchrun --nproc_per_node=4 16_pgd_wandb.py --arch preact18 --eps 8 --group eps_sweep
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from models import get_model

CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="preact18")
    p.add_argument("--data", default="/scratch/datasets/cifar100")
    p.add_argument("--out", default="/scratch/robust/ckpt")
    p.add_argument("--group", default="default")
    p.add_argument("--epochs", type=int, default=110)
    p.add_argument("--batch-size", type=int, default=128, help="global")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--eps", type=float, default=8.0)
    p.add_argument("--alpha", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--workers", type=int, default=4)
    return p.parse_args()


def pgd_linf(model, x, y, eps, alpha, steps, mean, std):
    delta = torch.empty_like(x).uniform_(-eps, eps)
    delta = (x + delta).clamp(0, 1) - x
    for _ in range(steps):
        delta.requires_grad_(True)
        logits = model(((x + delta) - mean) / std)
        g, = torch.autograd.grad(F.cross_entropy(logits, y), delta)
        delta = (delta.detach() + alpha * g.sign()).clamp(-eps, eps)
        delta = (x + delta).clamp(0, 1) - x
    return (x + delta).detach()


def run_eval(model, loader, args, mean, std, device):
    model.eval()
    sums = torch.zeros(4, device=device)
    eps, alpha = args.eps / 255, args.alpha / 255
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        x_adv = pgd_linf(model, x, y, eps, alpha, 20, mean, std)
        with torch.no_grad():
            out_nat = model((x - mean) / std)
            out_adv = model((x_adv - mean) / std)
        sums[0] += (out_nat.argmax(1) == y).sum()
        sums[1] += (out_adv.argmax(1) == y).sum()
        sums[2] += F.cross_entropy(out_adv, y, reduction="sum")
        sums[3] += y.numel()
    dist.all_reduce(sums)
    return {"test/clean_acc": (sums[0] / sums[3]).item(),
            "test/pgd20_acc": (sums[1] / sums[3]).item(),
            "test/pgd20_loss": (sums[2] / sums[3]).item()}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    run_name = f"{args.arch}_eps{args.eps:g}_ls{args.label_smoothing:g}"
    wandb.init(project="adv-training", group=args.group, name=run_name, config=vars(args))
    ckpt_dir = os.path.join(args.out, args.group, run_name)
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    mean = torch.tensor(CIFAR100_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR100_STD, device=device).view(1, 3, 1, 1)

    train_set = datasets.CIFAR100(args.data, train=True, transform=transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor()]))
    test_set = datasets.CIFAR100(args.data, train=False, transform=transforms.ToTensor())
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=250, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    model = DDP(get_model(args.arch, num_classes=100).to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[100, 105], gamma=0.1)
    eps, alpha = args.eps / 255, args.alpha / 255

    step = 0
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x_adv = pgd_linf(model, x, y, eps, alpha, args.steps, mean, std)
            out = model((x_adv - mean) / std)
            loss = F.cross_entropy(out, y, label_smoothing=args.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            agg[0] += loss.detach() * y.numel()
            agg[1] += (out.argmax(1) == y).sum()
            agg[2] += y.numel()
        scheduler.step()
        dist.all_reduce(agg)
        metrics = {"train/loss": (agg[0] / agg[2]).item(), "train/adv_acc": (agg[1] / agg[2]).item(),
                   "lr": scheduler.get_last_lr()[0], "epoch_time": time.time() - t0, "epoch": epoch}
        metrics.update(run_eval(model, test_loader, args, mean, std, device))
        wandb.log(metrics, step=step)

        if rank == 0:
            print(f"epoch {epoch}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
            torch.save({"epoch": epoch + 1, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, os.path.join(ckpt_dir, "last.pt"))
            if metrics["test/pgd20_acc"] > best:
                best = metrics["test/pgd20_acc"]
                torch.save(model.module.state_dict(), os.path.join(ckpt_dir, "best.pt"))
                wandb.run.summary["best_pgd20_acc"] = best

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
