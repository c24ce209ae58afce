"""Top-k gradient sparsification with error feedback (no DDP wrapper).

Every rank keeps a residual of the gradient mass it did not send. Each step it
adds the residual to the fresh gradient, picks the k largest entries of the
flattened gradient, all-gathers (values, indices) from all ranks and rebuilds a
dense averaged gradient locally.

Launch:
    torchrun --nproc_per_node=4 02_topk_ef_resnet.py --data /datasets/cifar100 --ratio 0.01
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=str, default="./data")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=128, help="per process")
    parser.add_argument("--lr", type=float, default=0.1, help="lr for a global batch of 128")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=5e-4)
    parser.add_argument("--ratio", type=float, default=0.01, help="fraction of entries sent")
    parser.add_argument("--dense-epochs", type=int, default=1, help="dense all-reduce warmup")
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--save", type=str, default="checkpoints/topk_r18.pt")
    return parser.parse_args()


class TopKCompressor:
    def __init__(self, params, ratio, device):
        self.params = [p for p in params if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.k = max(1, int(math.ceil(self.numel * ratio)))
        self.residual = torch.zeros(self.numel, device=device)
        self.world_size = dist.get_world_size()

    def _flat_grad(self):
        return torch.cat([p.grad.reshape(-1) for p in self.params])

    def _unflatten_into_grads(self, flat):
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    @torch.no_grad()
    def dense_allreduce(self):
        flat = self._flat_grad()
        dist.all_reduce(flat)
        flat.div_(self.world_size)
        self._unflatten_into_grads(flat)

    @torch.no_grad()
    def sparse_allreduce(self):
        acc = self._flat_grad().add_(self.residual)
        _, idx = torch.topk(acc.abs(), self.k, sorted=False)
        vals = acc[idx]
        # what we did not send stays in the residual
        self.residual.copy_(acc)
        self.residual[idx] = 0.0

        all_vals = torch.empty(self.world_size * self.k, device=acc.device, dtype=vals.dtype)
        all_idx = torch.empty(self.world_size * self.k, device=acc.device, dtype=idx.dtype)
        dist.all_gather_into_tensor(all_vals, vals.contiguous())
        dist.all_gather_into_tensor(all_idx, idx.contiguous())

        dense = torch.zeros_like(acc)
        dense.index_add_(0, all_idx, all_vals)
        dense.div_(self.world_size)
        self._unflatten_into_grads(dense)


@torch.no_grad()
def sync_bn_buffers(model, world_size):
    for name, buf in model.named_buffers():
        if buf.dtype.is_floating_point:
            dist.all_reduce(buf)
            buf.div_(world_size)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, correct, count
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        stats[0] += F.cross_entropy(out, y, reduction="sum")
        stats[1] += (out.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    if rank == 0:
        torchvision.datasets.CIFAR100(args.data, train=True, download=True)
        torchvision.datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    train_set = torchvision.datasets.CIFAR100(args.data, train=True, transform=train_tf)
    test_set = torchvision.datasets.CIFAR100(args.data, train=False, transform=test_tf)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)

    model = torchvision.models.resnet18(num_classes=100)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    model.to(device)
    # no DDP here, so start every rank from rank 0's weights
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t, src=0)

    global_bs = args.batch_size * world_size
    lr = args.lr * global_bs / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                weight_decay=args.wd, nesterov=True)
    steps_per_epoch = len(train_loader)
    total = args.epochs * steps_per_epoch
    warmup = 5 * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))
    compressor = TopKCompressor(model.parameters(), args.ratio, device)
    if rank == 0:
        print(f"global batch {global_bs}, lr {lr:.3f}, sending k={compressor.k} of {compressor.numel}")

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        skipped = 0
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(x), y)
            loss.backward()

            # all ranks agree on skipping a step with a non-finite loss
            bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=device)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.item() > 0:
                skipped += 1
                continue

            if epoch < args.dense_epochs:
                compressor.dense_allreduce()
            else:
                compressor.sparse_allreduce()
            optimizer.step()
            scheduler.step()

        sync_bn_buffers(model, world_size)
        val_loss, val_acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch:3d} | loss {loss.item():.3f} | val {val_loss:.3f} / {val_acc * 100:.2f}% "
                  f"| skipped {skipped} | {time.time() - t0:.0f}s")
            if val_acc > best_acc:
                best_acc = val_acc
                os.makedirs(os.path.dirname(args.save) or ".", exist_ok=True)
                torch.save({"model": model.state_dict(), "epoch": epoch, "acc": val_acc}, args.save)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
