"""Interpolation Consistency Training (ICT) with a mean-teacher, CIFAR-10 / WRN-28-2.

    torchrun --standalone --nproc_per_node=4 06_ict_meanteacher.py --labels 4000 --wandb
"""
import argparse
import math
import os
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from lib.networks import WideResNet

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--save-dir", default="ckpt/ict")
    p.add_argument("--labels", type=int, default=4000)
    p.add_argument("--lbs", type=int, default=25, help="labelled per GPU")
    p.add_argument("--ubs", type=int, default=75, help="unlabelled per GPU")
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--alpha", type=float, default=1.0, help="mixup Beta parameter")
    p.add_argument("--mixup-consistency", type=float, default=100.0)
    p.add_argument("--rampup", type=int, default=100, help="consistency ramp-up epochs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--wandb", action="store_true")
    p.add_argument("--wandb-project", default="ssl-ict")
    return p.parse_args()


def rampup(epoch, length):
    if length == 0:
        return 1.0
    p = np.clip(epoch / length, 0.0, 1.0)
    return float(np.exp(-5.0 * (1 - p) ** 2))


def mixup(x, y, alpha):
    lam = np.random.beta(alpha, alpha) if alpha > 0 else 1.0
    perm = torch.randperm(x.size(0), device=x.device)
    return lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm], lam


@torch.no_grad()
def ema_update(ema_model, model, decay, step):
    decay = min(1 - 1 / (step + 1), decay)
    for e, p in zip(ema_model.parameters(), model.parameters()):
        e.mul_(decay).add_(p, alpha=1 - decay)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        correct += (model(x).argmax(1) == y).sum().item()
        total += y.numel()
    return correct / total * 100.0


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    if args.wandb:
        wandb.init(project=args.wandb_project, config=vars(args),
                   name=f"ict_c10_{args.labels}_s{args.seed}")

    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=2, padding_mode="reflect"),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                   transforms.Normalize(MEAN, STD)])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    if rank == 0:
        datasets.CIFAR10(args.data, train=True, download=True)
        datasets.CIFAR10(args.data, train=False, download=True)
    dist.barrier()
    train_set = datasets.CIFAR10(args.data, train=True, transform=train_tf)
    test_set = datasets.CIFAR10(args.data, train=False, transform=test_tf)

    rng = np.random.RandomState(args.seed)
    targets = np.array(train_set.targets)
    lab_idx = np.concatenate([rng.permutation(np.where(targets == c)[0])[: args.labels // 10]
                              for c in range(10)])
    unl_idx = np.setdiff1d(np.arange(len(targets)), lab_idx)

    lab_set, unl_set = Subset(train_set, lab_idx), Subset(train_set, unl_idx)
    lab_sampler = DistributedSampler(lab_set, drop_last=True)
    unl_sampler = DistributedSampler(unl_set, drop_last=True)
    lab_loader = DataLoader(lab_set, batch_size=args.lbs, sampler=lab_sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True)
    unl_loader = DataLoader(unl_set, batch_size=args.ubs, sampler=unl_sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=500, num_workers=args.workers)

    model = WideResNet(depth=28, widen_factor=2, num_classes=10).to(device)
    ema_model = deepcopy(model)
    for p in ema_model.parameters():
        p.detach_()
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                weight_decay=args.wd)
    steps_per_epoch = len(unl_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, pct_start=0.02,
                                                    total_steps=args.epochs * steps_per_epoch)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best, step, lab_round = 0.0, 0, 0
    lab_iter = iter(lab_loader)
    for epoch in range(args.epochs):
        unl_sampler.set_epoch(epoch)
        model.train()
        ema_model.train()
        w = args.mixup_consistency * rampup(epoch, args.rampup)
        t0 = time.time()
        for i, (xu, _) in enumerate(unl_loader):
            try:
                xl, yl = next(lab_iter)
            except StopIteration:
                lab_round += 1
                lab_sampler.set_epoch(lab_round)
                lab_iter = iter(lab_loader)
                xl, yl = next(lab_iter)
            xl, yl = xl.to(device, non_blocking=True), yl.to(device, non_blocking=True)
            xu = xu.to(device, non_blocking=True)

            # supervised mixup
            yl_1h = F.one_hot(yl, 10).float()
            xl_mix, yl_mix, _ = mixup(xl, yl_1h, args.alpha)
            # interpolation consistency on unlabelled data: teacher targets are mixed
            with torch.no_grad():
                pu = torch.softmax(ema_model(xu), dim=1)
            xu_mix, pu_mix, _ = mixup(xu, pu, args.alpha)

            logits = model(torch.cat([xl_mix, xu_mix]))
            logits_l, logits_u = logits[: xl.size(0)], logits[xl.size(0):]
            loss_sup = -(yl_mix * F.log_softmax(logits_l, 1)).sum(1).mean()
            loss_cons = F.mse_loss(torch.softmax(logits_u, 1), pu_mix)
            loss = loss_sup + w * loss_cons

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            ema_update(ema_model, model.module, args.ema, step)

            if args.wandb and step % 20 == 0:
                wandb.log({"train/loss": loss.item(), "train/sup": loss_sup.item(),
                           "train/cons": loss_cons.item(), "train/w": w,
                           "train/lr": scheduler.get_last_lr()[0]}, step=step)

        if rank == 0:
            acc = evaluate(model.module, test_loader, device)
            acc_ema = evaluate(ema_model, test_loader, device)
            print(f"epoch {epoch} | acc {acc:.2f} ema {acc_ema:.2f} | {time.time() - t0:.0f}s", flush=True)
            if args.wandb:
                wandb.log({"test/acc": acc, "test/acc_ema": acc_ema, "epoch": epoch}, step=step)
            ckpt = {"model": model.module.state_dict(), "ema": ema_model.state_dict(),
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "epoch": epoch + 1, "step": step}
            torch.save(ckpt, os.path.join(args.save_dir, "last.pth"))
            if acc_ema > best:
                best = acc_ema
                torch.save(ckpt, os.path.join(args.save_dir, "best.pth"))
        dist.barrier()

    if args.wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
