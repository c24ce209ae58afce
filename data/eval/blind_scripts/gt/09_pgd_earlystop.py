"""PGD-10 adversarial training with validation-based early stopping
(Rice, Wong & Kolter, "Overfitting in adversarially robust deep learning").

1,000 training images are held out; the checkpoint with the best PGD accuracy
on the held-out set is kept. DDP over the GPUs of one node.

    torchrun --standalone --nproc_per_node=4 09_pgd_earlystop.py --fname experiments/preact_val
"""
import argparse
import json
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from preactresnet import PreActResNet18

logger = logging.getLogger(__name__)

mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
std = torch.tensor([0.2471, 0.2435, 0.2616]).view(1, 3, 1, 1)


class Normalized(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.register_buffer("mu", mean.clone())
        self.register_buffer("sigma", std.clone())

    def forward(self, x):
        return self.net((x - self.mu) / self.sigma)


def attack_pgd(model, X, y, epsilon, alpha, attack_iters, restarts=1):
    max_loss = torch.zeros(y.shape[0], device=X.device)
    max_delta = torch.zeros_like(X)
    for _ in range(restarts):
        delta = torch.empty_like(X).uniform_(-epsilon, epsilon)
        delta = (X + delta).clamp(0, 1) - X
        for _ in range(attack_iters):
            delta.requires_grad_(True)
            loss = F.cross_entropy(model(X + delta), y)
            grad, = torch.autograd.grad(loss, delta)
            delta = (delta.detach() + alpha * grad.sign()).clamp(-epsilon, epsilon)
            delta = (X + delta).clamp(0, 1) - X
        with torch.no_grad():
            all_loss = F.cross_entropy(model(X + delta), y, reduction="none")
        better = all_loss >= max_loss
        max_delta[better] = delta[better]
        max_loss = torch.max(max_loss, all_loss)
    return max_delta


def robust_eval(model, loader, epsilon, alpha, iters, device):
    model.eval()
    acc = torch.zeros(4, device=device)
    for X, y in loader:
        X, y = X.to(device), y.to(device)
        delta = attack_pgd(model, X, y, epsilon, alpha, iters)
        with torch.no_grad():
            out_adv = model(X + delta)
            out_nat = model(X)
        acc[0] += F.cross_entropy(out_adv, y, reduction="sum")
        acc[1] += (out_adv.argmax(1) == y).sum()
        acc[2] += (out_nat.argmax(1) == y).sum()
        acc[3] += y.size(0)
    dist.all_reduce(acc)
    return (acc[0] / acc[3]).item(), (acc[1] / acc[3]).item(), (acc[2] / acc[3]).item()


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default="../cifar-data")
    parser.add_argument("--fname", default="experiments/preact_val")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=128, help="global")
    parser.add_argument("--lr-max", type=float, default=0.1)
    parser.add_argument("--epsilon", type=int, default=8)
    parser.add_argument("--pgd-alpha", type=float, default=2)
    parser.add_argument("--attack-iters", type=int, default=10)
    parser.add_argument("--val-size", type=int, default=1000)
    parser.add_argument("--chkpt-iters", type=int, default=10)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different augmentation streams on each GPU
    seed = args.seed + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    if rank == 0:
        os.makedirs(args.fname, exist_ok=True)
        logging.basicConfig(format="[%(asctime)s] - %(message)s", level=logging.INFO,
                            handlers=[logging.FileHandler(os.path.join(args.fname, "output.log")),
                                      logging.StreamHandler()])
        with open(os.path.join(args.fname, "args.json"), "w") as f:
            json.dump(vars(args), f)

    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor()])
    full_train = datasets.CIFAR10(args.data_dir, train=True, transform=train_tf)
    full_train_noaug = datasets.CIFAR10(args.data_dir, train=True, transform=transforms.ToTensor())
    test_set = datasets.CIFAR10(args.data_dir, train=False, transform=transforms.ToTensor())

    perm = np.random.permutation(len(full_train))
    val_idx, train_idx = perm[: args.val_size], perm[args.val_size:]
    train_set = Subset(full_train, train_idx.tolist())
    val_set = Subset(full_train_noaug, val_idx.tolist())

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=125, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=2, pin_memory=True)
    test_loader = DataLoader(test_set, batch_size=250, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    model = Normalized(PreActResNet18()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr_max, momentum=0.9, weight_decay=5e-4)

    epsilon = args.epsilon / 255.0
    alpha = args.pgd_alpha / 255.0

    def lr_schedule(t):
        if t / args.epochs < 0.5:
            return args.lr_max
        elif t / args.epochs < 0.75:
            return args.lr_max / 10.0
        return args.lr_max / 100.0

    best_val_robust_acc = 0.0
    logger.info("Epoch \t Train Loss \t Train Robust Acc \t Val Robust Loss \t Val Robust Acc \t Val Acc")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        stats = torch.zeros(3, device=device)
        for i, (X, y) in enumerate(train_loader):
            X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
            lr = lr_schedule(epoch + (i + 1) / len(train_loader))
            opt.param_groups[0].update(lr=lr)
            delta = attack_pgd(model, X, y, epsilon, alpha, args.attack_iters)
            robust_output = model((X + delta).clamp(0, 1))
            robust_loss = F.cross_entropy(robust_output, y)
            opt.zero_grad()
            robust_loss.backward()
            opt.step()
            stats[0] += robust_loss.detach() * y.size(0)
            stats[1] += (robust_output.argmax(1) == y).sum()
            stats[2] += y.size(0)
        dist.all_reduce(stats)

        val_rloss, val_racc, val_acc = robust_eval(model, val_loader, epsilon, alpha, 10, device)
        logger.info("%d \t %.4f \t %.4f \t %.4f \t %.4f \t %.4f (%.0fs)", epoch,
                    (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item(),
                    val_rloss, val_racc, val_acc, time.time() - t0)

        if rank == 0:
            if (epoch + 1) % args.chkpt_iters == 0 or epoch + 1 == args.epochs:
                torch.save(model.module.state_dict(), os.path.join(args.fname, f"model_{epoch}.pth"))
                torch.save(opt.state_dict(), os.path.join(args.fname, f"opt_{epoch}.pth"))
            if val_racc > best_val_robust_acc:
                best_val_robust_acc = val_racc
                torch.save(model.module.state_dict(), os.path.join(args.fname, "model_best.pth"))

    # final test of the early-stopped model
    dist.barrier()
    best = torch.load(os.path.join(args.fname, "model_best.pth"), map_location=device)
    model.module.load_state_dict(best)
    _, test_racc, test_acc = robust_eval(model, test_loader, epsilon, alpha, 20, device)
    logger.info("best-val checkpoint: test acc %.4f, PGD-20 acc %.4f", test_acc, test_racc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
