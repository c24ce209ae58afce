"""PGD-AT with Adversarial Weight Perturbation (Wu et al., NeurIPS 2020), DDP.

PreActResNet-18 on CIFAR-10, eps=8/255, gamma=5e-3, AWP warm-up of 0 epochs.

    torchrun --nproc_per_node=4 07_awp_pgd.py --data-dir ./data --fname runs/awp_preact
"""
import argparse
import logging
import os
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from preactresnet import PreActResNet18

EPS = 1e-20
logger = logging.getLogger(__name__)


def diff_in_weights(model, proxy):
    diff_dict = OrderedDict()
    model_state_dict = model.state_dict()
    proxy_state_dict = proxy.state_dict()
    for (old_k, old_w), (new_k, new_w) in zip(model_state_dict.items(), proxy_state_dict.items()):
        if len(old_w.size()) <= 1:
            continue
        if "weight" in old_k:
            diff_w = new_w - old_w
            diff_dict[old_k] = old_w.norm() / (diff_w.norm() + EPS) * diff_w
    return diff_dict


def add_into_weights(model, diff, coeff=1.0):
    names_in_diff = diff.keys()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in names_in_diff:
                param.add_(coeff * diff[name])


def average_gradients(module, world_size):
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)


class AdvWeightPerturb:
    def __init__(self, model, proxy, proxy_optim, gamma, world_size):
        self.model = model
        self.proxy = proxy
        self.proxy_optim = proxy_optim
        self.gamma = gamma
        self.world_size = world_size

    def calc_awp(self, inputs_adv, targets):
        self.proxy.load_state_dict(self.model.state_dict())
        self.proxy.train()
        loss = -F.cross_entropy(self.proxy(inputs_adv), targets)
        self.proxy_optim.zero_grad()
        loss.backward()
        # every rank must apply the same weight perturbation
        average_gradients(self.proxy, self.world_size)
        self.proxy_optim.step()
        return diff_in_weights(self.model, self.proxy)

    def perturb(self, diff):
        add_into_weights(self.model, diff, coeff=1.0 * self.gamma)

    def restore(self, diff):
        add_into_weights(self.model, diff, coeff=-1.0 * self.gamma)


def attack_pgd(model, X, y, epsilon, alpha, attack_iters):
    delta = torch.empty_like(X).uniform_(-epsilon, epsilon)
    delta = (X + delta).clamp(0, 1) - X
    for _ in range(attack_iters):
        delta.requires_grad_(True)
        loss = F.cross_entropy(model(X + delta), y)
        grad, = torch.autograd.grad(loss, delta)
        delta = (delta.detach() + alpha * grad.sign()).clamp(-epsilon, epsilon)
        delta = (X + delta).clamp(0, 1) - X
    return delta.detach()


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default="./data")
    parser.add_argument("--fname", default="runs/awp_preact")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=128, help="global")
    parser.add_argument("--lr-max", type=float, default=0.1)
    parser.add_argument("--epsilon", type=float, default=8)
    parser.add_argument("--pgd-alpha", type=float, default=2)
    parser.add_argument("--attack-iters", type=int, default=10)
    parser.add_argument("--awp-gamma", type=float, default=5e-3)
    parser.add_argument("--awp-warmup", type=int, default=0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    if rank == 0:
        os.makedirs(args.fname, exist_ok=True)
        logging.basicConfig(format="[%(asctime)s] %(message)s", level=logging.INFO,
                            handlers=[logging.FileHandler(os.path.join(args.fname, "output.log")),
                                      logging.StreamHandler()])
    logger.info(args)

    epsilon = args.epsilon / 255.0
    pgd_alpha = args.pgd_alpha / 255.0

    train_set = datasets.CIFAR10(args.data_dir, train=True, transform=transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor()]))
    test_set = datasets.CIFAR10(args.data_dir, train=False, transform=transforms.ToTensor())
    train_sampler = DistributedSampler(train_set, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=200, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    model = PreActResNet18().to(device)
    model = DDP(model, device_ids=[local_rank])
    proxy = PreActResNet18().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr_max, momentum=0.9, weight_decay=5e-4)
    proxy_opt = torch.optim.SGD(proxy.parameters(), lr=0.01)
    awp_adversary = AdvWeightPerturb(model=model, proxy=proxy, proxy_optim=proxy_opt,
                                     gamma=args.awp_gamma, world_size=world_size)

    def lr_schedule(epoch):
        if epoch < args.epochs * 0.5:
            return args.lr_max
        if epoch < args.epochs * 0.75:
            return args.lr_max * 0.1
        return args.lr_max * 0.01

    best_test_robust_acc = 0.0
    logger.info("Epoch \t Time \t LR \t Train Loss \t Train Robust Acc \t Test Acc \t Test Robust Acc")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        start = time.time()
        lr = lr_schedule(epoch)
        for g in opt.param_groups:
            g["lr"] = lr
        model.train()
        meter = torch.zeros(3, device=device)
        for X, y in train_loader:
            X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
            delta = attack_pgd(model, X, y, epsilon, pgd_alpha, args.attack_iters)
            X_adv = (X + delta).clamp(0, 1)

            if epoch >= args.awp_warmup:
                awp = awp_adversary.calc_awp(inputs_adv=X_adv, targets=y)
                awp_adversary.perturb(awp)

            robust_output = model(X_adv)
            robust_loss = F.cross_entropy(robust_output, y)
            opt.zero_grad()
            robust_loss.backward()
            opt.step()

            if epoch >= args.awp_warmup:
                awp_adversary.restore(awp)

            meter[0] += robust_loss.detach() * y.size(0)
            meter[1] += (robust_output.argmax(1) == y).sum()
            meter[2] += y.size(0)
        dist.all_reduce(meter)

        model.eval()
        ev = torch.zeros(3, device=device)
        for X, y in test_loader:
            X, y = X.to(device), y.to(device)
            delta = attack_pgd(model, X, y, epsilon, pgd_alpha, 20)
            with torch.no_grad():
                ev[0] += (model(X).argmax(1) == y).sum()
                ev[1] += (model((X + delta).clamp(0, 1)).argmax(1) == y).sum()
                ev[2] += y.size(0)
        dist.all_reduce(ev)
        test_acc, test_rob = (ev[0] / ev[2]).item(), (ev[1] / ev[2]).item()
        logger.info("%d \t %.1f \t %.4f \t %.4f \t %.4f \t %.4f \t %.4f", epoch, time.time() - start, lr,
                    (meter[0] / meter[2]).item(), (meter[1] / meter[2]).item(), test_acc, test_rob)

        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.fname, f"model_{epoch}.pth"))
            torch.save(opt.state_dict(), os.path.join(args.fname, f"opt_{epoch}.pth"))
            if test_rob > best_test_robust_acc:
                best_test_robust_acc = test_rob
                torch.save(model.module.state_dict(), os.path.join(args.fname, "model_best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
