"""Memory Aware Synapses (MAS, Aljundi et al., ECCV 2018) on Split CIFAR-10 / CIFAR-100.

Importance of a parameter = mean absolute gradient of the squared L2 norm of
the network output, accumulated over tasks. Task-incremental evaluation with
the logits masked to the classes of the queried task.

    torchrun --nproc_per_node=4 19_mas_split_cifar10.py --dataset cifar10 --reg_lambda 1.0
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms

STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), 10, 5),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), 100, 10),
}


def get_parser():
    parser = argparse.ArgumentParser(description="MAS")
    parser.add_argument("--dataset", choices=list(STATS), default="cifar10")
    parser.add_argument("--data_dir", default="./data")
    parser.add_argument("--ckpt_dir", default="./ckpt/mas")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch_size", type=int, default=128, help="global")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--reg_lambda", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


def build_model(n_classes):
    m = models.resnet18(num_classes=n_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def compute_importance(net, loader, device):
    """Unnormalised sum over this rank's samples of |d ||f(x)||^2 / d theta|."""
    omega = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    net.eval()
    count = 0
    for x, _ in loader:
        x = x.to(device, non_blocking=True)
        net.zero_grad(set_to_none=True)
        out = net(x)
        out.pow(2).sum(dim=1).mean().backward()
        for n, p in net.named_parameters():
            if p.grad is not None:
                omega[n] += p.grad.detach().abs() * x.size(0)
        count += x.size(0)
    net.zero_grad(set_to_none=True)
    return omega, count


def mas_penalty(net, omega, anchor):
    return sum((omega[n] * (p - anchor[n]).pow(2)).sum() for n, p in net.named_parameters())


@torch.no_grad()
def evaluate(net, test_set, y_test, tasks, n_classes, rank, world, device):
    net.eval()
    stats = torch.zeros(len(tasks), 2, device=device)
    for k, classes in enumerate(tasks):
        mask = torch.full((n_classes,), float("-inf"), device=device)
        mask[classes] = 0
        idx = np.where(np.isin(y_test, classes))[0][rank::world].tolist()
        for x, y in DataLoader(Subset(test_set, idx), batch_size=500, num_workers=2):
            x, y = x.to(device), y.to(device)
            stats[k, 0] += ((net(x) + mask).argmax(1) == y).sum()
            stats[k, 1] += y.numel()
    dist.all_reduce(stats)
    return (100 * stats[:, 0] / stats[:, 1]).cpu().numpy()


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed)

    mean, std, n_classes, n_tasks = STATS[args.dataset]
    ds_cls = datasets.CIFAR10 if args.dataset == "cifar10" else datasets.CIFAR100
    train_set = ds_cls(args.data_dir, train=True, transform=transforms.Compose(
        [transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
         transforms.Normalize(mean, std)]))
    test_set = ds_cls(args.data_dir, train=False, transform=transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize(mean, std)]))
    y_train, y_test = np.asarray(train_set.targets), np.asarray(test_set.targets)
    cpt = n_classes // n_tasks
    tasks = [list(range(k * cpt, (k + 1) * cpt)) for k in range(n_tasks)]

    net = build_model(n_classes).to(device)
    model = DDP(net, device_ids=[args.local_rank], output_device=args.local_rank)
    omega, anchor = None, None
    acc = np.zeros((n_tasks, n_tasks))
    per_gpu = args.batch_size // world

    for t, classes in enumerate(tasks):
        mask = torch.full((n_classes,), float("-inf"), device=device)
        mask[classes] = 0
        data = Subset(train_set, np.where(np.isin(y_train, classes))[0].tolist())
        sampler = DistributedSampler(data, shuffle=True, seed=args.seed)
        loader = DataLoader(data, batch_size=per_gpu, sampler=sampler, num_workers=4, pin_memory=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=max(1, args.epochs // 3), gamma=0.1)
        start = time.time()
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            run = torch.zeros(2, device=device)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = F.cross_entropy(model(x) + mask, y)
                if omega is not None:
                    loss = loss + args.reg_lambda * mas_penalty(net, omega, anchor)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                run += torch.stack([loss.detach() * y.numel(), torch.tensor(float(y.numel()), device=device)])
            sched.step()
            dist.all_reduce(run)
            if rank == 0:
                print(f"[task {t}] epoch {epoch + 1}/{args.epochs} loss {(run[0] / run[1]).item():.4f} "
                      f"({time.time() - start:.0f}s)", flush=True)

        # importance on this task's data, summed over ranks, then averaged; accumulated over tasks
        imp_loader = DataLoader(data, batch_size=per_gpu, sampler=sampler, num_workers=4)
        new_omega, n_local = compute_importance(net, imp_loader, device)
        n_all = torch.tensor(float(n_local), device=device)
        dist.all_reduce(n_all)
        for n in new_omega:
            dist.all_reduce(new_omega[n])
            new_omega[n] /= n_all
        omega = new_omega if omega is None else {n: omega[n] + new_omega[n] for n in omega}
        anchor = {n: p.detach().clone() for n, p in net.named_parameters()}

        acc[t, :t + 1] = evaluate(net, test_set, y_test, tasks[:t + 1], n_classes, rank, world, device)
        if rank == 0:
            print(f"== task {t}: avg acc {acc[t, :t + 1].mean():.2f} | {np.round(acc[t, :t + 1], 1).tolist()}")
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"model": net.state_dict(), "omega": omega, "anchor": anchor, "acc": acc},
                       os.path.join(args.ckpt_dir, f"{args.dataset}_task{t}.pt"))
        dist.barrier()

    if rank == 0:
        print("accuracy matrix:\n", np.round(acc, 1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
