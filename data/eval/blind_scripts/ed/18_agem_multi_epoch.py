"""A-GEM (Chaudhry et al., ICLR 2019), multi-epoch variant, Split CIFAR-100 (20 tasks).

The reference gradient is computed on a memory batch without DDP's gradient
sync and averaged over ranks by hand, then the (DDP-averaged) gradient of the
current batch is projected if it conflicts with it. Every rank does the same
projection on the same two averaged vectors, so the replicas stay identical.

    torchrun --nproc_per_node=4 18_agem_multi_epoch.py --epochs 5 --mem_per_task 250
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="./data")
    ap.add_argument("--save", default="./checkpoints/agem")
    ap.add_argument("--tasks", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch_size", type=int, default=64, help="global")
    ap.add_argument("--mem_batch_size", type=int, default=256, help="global")
    ap.add_argument("--mem_per_task", type=int, default=250)
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--seed", type=int, default=5)
    return ap.parse_args()


def net_for_cifar(num_classes):
    m = torchvision.models.resnet18(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def grads_to_vector(params):
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def vector_to_grads(vec, params):
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.copy_(vec[offset:offset + n].view_as(p))
        offset += n


@torch.no_grad()
def eval_seen_tasks(net, test_set, y_test, tasks, seen_mask, rank, world, device):
    net.eval()
    stats = torch.zeros(len(tasks), 2, device=device)
    for k, classes in enumerate(tasks):
        idx = np.flatnonzero(np.isin(y_test, classes))[rank::world]
        for x, y in DataLoader(Subset(test_set, idx.tolist()), batch_size=500, num_workers=2):
            x, y = x.to(device), y.to(device)
            stats[k, 0] += ((net(x) + seen_mask).argmax(1) == y).sum()
            stats[k, 1] += y.numel()
    dist.all_reduce(stats)
    return (100.0 * stats[:, 0] / stats[:, 1]).cpu().numpy()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    normalize = transforms.Normalize((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
    train_set = torchvision.datasets.CIFAR100(args.data, train=True, transform=transforms.Compose(
        [transforms.RandomCrop(32, 4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]))
    test_set = torchvision.datasets.CIFAR100(args.data, train=False,
                                             transform=transforms.Compose([transforms.ToTensor(), normalize]))
    y_train, y_test = np.asarray(train_set.targets), np.asarray(test_set.targets)
    rs = np.random.RandomState(args.seed)
    order = rs.permutation(100)
    cpt = 100 // args.tasks
    tasks = [order[i * cpt:(i + 1) * cpt].tolist() for i in range(args.tasks)]

    net = net_for_cifar(100).to(device)
    model = DDP(net, device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=args.lr)
    episodic = []  # indices into train_set, identical on all ranks
    acc = np.zeros((args.tasks, args.tasks))
    bs, mbs = args.batch_size // world, args.mem_batch_size // world
    n_proj = torch.zeros(1, device=device)

    for t, classes in enumerate(tasks):
        seen_mask = torch.full((100,), -1e9, device=device)
        seen_mask[[c for cl in tasks[:t + 1] for c in cl]] = 0.0
        task_data = Subset(train_set, np.flatnonzero(np.isin(y_train, classes)).tolist())
        sampler = DistributedSampler(task_data, shuffle=True, seed=args.seed)
        loader = DataLoader(task_data, batch_size=bs, sampler=sampler, num_workers=4, pin_memory=True,
                            drop_last=True)
        mem_loader = None
        if episodic:
            mem_data = Subset(train_set, episodic)
            mem_loader = DataLoader(mem_data, batch_size=mbs, sampler=torch.utils.data.RandomSampler(
                mem_data, replacement=True, num_samples=10 ** 8), num_workers=2, pin_memory=True)
            mem_iter = iter(mem_loader)

        tic = time.time()
        for epoch in range(args.epochs):
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                g_ref = None
                if mem_loader is not None:
                    mx, my = next(mem_iter)
                    mx, my = mx.to(device, non_blocking=True), my.to(device, non_blocking=True)
                    opt.zero_grad(set_to_none=True)
                    with model.no_sync():
                        F.cross_entropy(model(mx) + seen_mask, my).backward()
                    g_ref = grads_to_vector(params)
                    dist.all_reduce(g_ref)
                    g_ref /= world
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x) + seen_mask, y)
                loss.backward()
                if g_ref is not None:
                    g = grads_to_vector(params)
                    dot = torch.dot(g, g_ref)
                    if dot < 0:
                        g = g - dot / torch.dot(g_ref, g_ref) * g_ref
                        vector_to_grads(g, params)
                        n_proj += 1
                opt.step()
            if rank == 0:
                print(f"task {t:2d} epoch {epoch} loss {loss.item():.4f} projections {int(n_proj.item())} "
                      f"({time.time() - tic:.0f}s)", flush=True)

        # episodic memory: mem_per_task random samples of this task (seeded, same on every rank)
        episodic += rs.choice(np.flatnonzero(np.isin(y_train, classes)), args.mem_per_task, replace=False).tolist()

        acc[t, :t + 1] = eval_seen_tasks(net, test_set, y_test, tasks[:t + 1], seen_mask, rank, world, device)
        if rank == 0:
            print(f">> after task {t}: avg {acc[t, :t + 1].mean():.2f}  first task {acc[t, 0]:.2f}", flush=True)
            os.makedirs(args.save, exist_ok=True)
            torch.save({"model": net.state_dict(), "episodic": episodic, "acc": acc, "task": t},
                       os.path.join(args.save, "agem_latest.pt"))
        dist.barrier()

    if rank == 0:
        bwt = np.mean([acc[-1, j] - acc[j, j] for j in range(args.tasks - 1)])
        print(f"A_T = {acc[-1].mean():.2f}, BWT = {bwt:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
