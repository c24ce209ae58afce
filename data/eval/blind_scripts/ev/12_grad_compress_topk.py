"""Top-k gradient sparsification as a DDP communication hook, with error feedback.

Each bucket keeps its k largest-magnitude entries (k = ratio * numel); values and
indices are all-gathered and scattered back into a dense tensor. The residual
is carried over to the next step (error feedback, Stich et al. 2018).

    torchrun --nproc_per_node=4 grad_compress_topk.py --ratio 0.01
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class TopKState:
    def __init__(self, process_group, ratio, error_feedback=True, dense_iters=200):
        self.process_group = process_group
        self.ratio = ratio
        self.error_feedback = error_feedback
        self.dense_iters = dense_iters
        self.residuals = {}
        self.iter = 0
        self.bytes_sent = 0

    def maybe_increase_iter(self, bucket):
        if bucket.is_last():
            self.iter += 1


def topk_hook(state: TopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = group.size()
    buf = bucket.buffer()

    # dense all-reduce during warm-up, as in the PowerSGD hook
    if state.iter < state.dense_iters:
        state.maybe_increase_iter(bucket)
        buf.div_(world)
        state.bytes_sent += buf.numel() * buf.element_size()
        return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda f: f.value()[0])

    idx = bucket.index()
    if state.error_feedback:
        res = state.residuals.get(idx)
        if res is not None and res.shape == buf.shape:
            buf.add_(res)
    k = max(1, int(buf.numel() * state.ratio))
    _, indices = torch.topk(buf.abs(), k, sorted=False)
    values = buf[indices].contiguous()
    if state.error_feedback:
        res = buf.clone()
        res[indices] = 0
        state.residuals[idx] = res

    all_values = torch.empty(world * k, dtype=values.dtype, device=values.device)
    all_indices = torch.empty(world * k, dtype=indices.dtype, device=indices.device)
    fut_v = dist.all_gather_into_tensor(all_values, values, group=group, async_op=True).get_future()
    fut_i = dist.all_gather_into_tensor(all_indices, indices, group=group, async_op=True).get_future()
    state.bytes_sent += k * (values.element_size() + indices.element_size())
    state.maybe_increase_iter(bucket)

    def decompress(_):
        dense = torch.zeros_like(buf)
        dense.index_add_(0, all_indices, all_values)
        dense.div_(world)
        buf.copy_(dense)
        return buf

    return torch.futures.collect_all([fut_v, fut_i]).then(decompress)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--data", default="/data/cifar10")
    ap.add_argument("--out", default="runs/topk")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--no-ef", action="store_true")
    ap.add_argument("--dense-iters", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--wd", type=float, default=5e-4)
    return ap.parse_args()


def cifar_resnet18():
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return nn.SyncBatchNorm.convert_sync_batchnorm(m)


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    train_set = datasets.CIFAR10(args.data, train=True, download=False, transform=transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize(mean, std)]))
    test_set = datasets.CIFAR10(args.data, train=False, download=False, transform=transforms.Compose([
        transforms.ToTensor(), transforms.Normalize(mean, std)]))
    sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=500, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=4, pin_memory=True)

    model = DDP(cifar_resnet18().to(device), device_ids=[args.local_rank])
    state = TopKState(None, args.ratio, error_feedback=not args.no_ef, dense_iters=args.dense_iters)
    model.register_comm_hook(state, topk_hook)

    lr = args.lr * args.batch_size * world / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[45, 68], gamma=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world} ratio {args.ratio} ef {not args.no_ef} lr {lr}", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        scheduler.step()

        model.eval()
        c = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                c[0] += (model(x).argmax(1) == y).sum()
                c[1] += y.numel()
        dist.all_reduce(c)
        if rank == 0:
            mb = state.bytes_sent / 2 ** 20
            print(f"epoch {epoch} loss {loss.item():.4f} acc {(c[0] / c[1]).item():.4f} "
                  f"sent {mb:.1f} MiB/rank time {time.time() - t0:.1f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, f"topk_{args.ratio}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
