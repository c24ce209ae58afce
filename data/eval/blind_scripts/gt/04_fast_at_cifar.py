"""FGSM with random start ("Fast is better than free", Wong et al. 2020) on CIFAR-10.

Multi-GPU port of our single-GPU fast_adversarial fork. Cyclic learning rate,
mixed precision, early stopping on a PGD check of the first training batch to
catch catastrophic overfitting.

    torchrun --nproc_per_node=4 04_fast_at_cifar.py --epochs 15 --out-dir runs/fgsm_rs
"""
import argparse
import copy
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from preact_resnet import PreActResNet18

cifar10_mean = (0.4914, 0.4822, 0.4465)
cifar10_std = (0.2471, 0.2435, 0.2616)

mu = torch.tensor(cifar10_mean).view(3, 1, 1).cuda()
std = torch.tensor(cifar10_std).view(3, 1, 1).cuda()

upper_limit = ((1 - mu) / std)
lower_limit = ((0 - mu) / std)

logger = logging.getLogger(__name__)


def clamp(X, lower, upper):
    return torch.max(torch.min(X, upper), lower)


def attack_pgd(model, X, y, epsilon, alpha, attack_iters, restarts):
    max_loss = torch.zeros(y.shape[0], device=X.device)
    max_delta = torch.zeros_like(X)
    for _ in range(restarts):
        delta = torch.zeros_like(X)
        for j in range(len(epsilon)):
            delta[:, j, :, :].uniform_(-epsilon[j][0][0].item(), epsilon[j][0][0].item())
        delta.data = clamp(delta, lower_limit - X, upper_limit - X)
        for _ in range(attack_iters):
            delta.requires_grad = True
            loss = F.cross_entropy(model(X + delta), y)
            grad, = torch.autograd.grad(loss, delta)
            d = clamp(delta + alpha * torch.sign(grad), -epsilon, epsilon)
            delta = clamp(d, lower_limit - X, upper_limit - X).detach()
        with torch.no_grad():
            all_loss = F.cross_entropy(model(X + delta), y, reduction="none")
        max_delta[all_loss >= max_loss] = delta[all_loss >= max_loss]
        max_loss = torch.max(max_loss, all_loss)
    return max_delta


def evaluate_pgd(model, loader, epsilon, alpha, iters, restarts, device):
    totals = torch.zeros(3, device=device)
    model.eval()
    for X, y in loader:
        X, y = X.to(device), y.to(device)
        delta = attack_pgd(model, X, y, epsilon, alpha, iters, restarts)
        with torch.no_grad():
            totals[0] += (model(X).argmax(1) == y).sum()
            totals[1] += (model(X + delta).argmax(1) == y).sum()
            totals[2] += y.size(0)
    dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", default=128, type=int, help="per-GPU batch size")
    parser.add_argument("--data-dir", default="../cifar-data", type=str)
    parser.add_argument("--epochs", default=15, type=int)
    parser.add_argument("--lr-max", default=0.2, type=float,
                        help="peak lr for the reference global batch of 128")
    parser.add_argument("--epsilon", default=8, type=int)
    parser.add_argument("--alpha", default=10, type=float, help="step size")
    parser.add_argument("--delta-init", default="random", choices=["zero", "random"])
    parser.add_argument("--out-dir", default="train_fgsm_output", type=str)
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--early-stop", action="store_true")
    parser.add_argument("--workers", default=4, type=int)
    return parser.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        logging.basicConfig(
            format="[%(asctime)s] - %(message)s", datefmt="%Y/%m/%d %H:%M:%S",
            level=logging.INFO,
            handlers=[logging.FileHandler(os.path.join(args.out_dir, "output.log")),
                      logging.StreamHandler()])
    logger.info(args)

    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.cuda.manual_seed(args.seed)

    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(cifar10_mean, cifar10_std),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(cifar10_mean, cifar10_std)])
    train_ds = datasets.CIFAR10(args.data_dir, train=True, transform=train_tf, download=False)
    test_ds = datasets.CIFAR10(args.data_dir, train=False, transform=test_tf, download=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=args.batch_size,
                             sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    epsilon = (args.epsilon / 255.) / std
    alpha = (args.alpha / 255.) / std
    pgd_alpha = (2 / 255.) / std

    model = PreActResNet18().to(device)
    model = DDP(model, device_ids=[local_rank])
    model.train()

    # linear scaling of the cyclic schedule's peak with the global batch
    lr_max = args.lr_max * args.batch_size * world_size / 128
    opt = torch.optim.SGD(model.parameters(), lr=lr_max, momentum=0.9, weight_decay=5e-4)
    scaler = torch.cuda.amp.GradScaler()

    lr_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.CyclicLR(
        opt, base_lr=0.0, max_lr=lr_max, step_size_up=lr_steps / 2, step_size_down=lr_steps / 2)

    prev_robust_acc = 0.0
    best_state = None
    start_train_time = time.time()
    logger.info("Epoch \t Seconds \t LR \t \t Train Loss \t Train Acc")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        start_epoch_time = time.time()
        meters = torch.zeros(3, device=device)
        for i, (X, y) in enumerate(train_loader):
            X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if i == 0:
                first_batch = (X, y)
            delta = torch.zeros_like(X)
            if args.delta_init == "random":
                for j in range(len(epsilon)):
                    delta[:, j, :, :].uniform_(-epsilon[j][0][0].item(), epsilon[j][0][0].item())
                delta.data = clamp(delta, lower_limit - X, upper_limit - X)
            delta.requires_grad = True
            with torch.cuda.amp.autocast():
                loss = F.cross_entropy(model(X + delta[: X.size(0)]), y)
            grad, = torch.autograd.grad(scaler.scale(loss), delta)
            grad = grad.detach()
            delta.data = clamp(delta + alpha * torch.sign(grad), -epsilon, epsilon)
            delta.data[: X.size(0)] = clamp(delta[: X.size(0)], lower_limit - X, upper_limit - X)
            delta = delta.detach()
            with torch.cuda.amp.autocast():
                output = model(X + delta[: X.size(0)])
                loss = F.cross_entropy(output, y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scheduler.step()
            meters[0] += loss.detach().float() * y.size(0)
            meters[1] += (output.argmax(1) == y).sum()
            meters[2] += y.size(0)

        if args.early_stop:
            # check for catastrophic overfitting on the first batch
            X, y = first_batch
            pgd_delta = attack_pgd(model.module, X, y, epsilon, pgd_alpha, 5, 1)
            with torch.no_grad():
                acc = (model.module(clamp(X + pgd_delta, lower_limit, upper_limit)).argmax(1) == y)
            robust = torch.tensor([acc.float().sum(), acc.numel()], device=device)
            dist.all_reduce(robust)
            robust_acc = (robust[0] / robust[1]).item()
            if robust_acc - prev_robust_acc < -0.2:
                logger.info("catastrophic overfitting detected, stopping")
                break
            prev_robust_acc = robust_acc
            best_state = copy.deepcopy(model.module.state_dict())
            model.train()

        dist.all_reduce(meters)
        epoch_time = time.time() - start_epoch_time
        lr = scheduler.get_last_lr()[0]
        logger.info("%d \t %.1f \t \t %.4f \t %.4f \t %.4f", epoch, epoch_time, lr,
                    (meters[0] / meters[2]).item(), (meters[1] / meters[2]).item())

    train_time = time.time() - start_train_time
    if not args.early_stop:
        best_state = model.module.state_dict()
    if rank == 0:
        torch.save(best_state, os.path.join(args.out_dir, "model.pth"))
    logger.info("Total train time: %.4f minutes", train_time / 60)

    # final evaluation
    model_test = PreActResNet18().to(device)
    model_test.load_state_dict(best_state)
    model_test.float()
    model_test.eval()
    clean_acc, pgd_acc = evaluate_pgd(model_test, test_loader, epsilon, pgd_alpha, 50, 10, device)
    logger.info("Test clean acc %.4f, PGD-50-10 acc %.4f", clean_acc, pgd_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
