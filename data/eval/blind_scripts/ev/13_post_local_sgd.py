"""Post-local SGD (Lin et al., 2020) with PyTorch's built-in pieces.

Synchronous DDP for the first --switch-iter iterations, then the post_localSGD
comm hook only all-reduces inside each node's subgroup and the
PeriodicModelAverager averages the full model across all ranks every --period
steps.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        post_local_sgd.py --period 8 --switch-iter 2000 --out /nfs/exp/plsgd_p8
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.averagers as averagers
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/nfs/datasets/cifar100")
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="per 128 samples, scaled linearly with the global batch")
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--period", type=int, default=8)
    p.add_argument("--switch-iter", type=int, default=2000)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


def build_model():
    # GroupNorm: the model has no buffers, so local models differ only in parameters between averaging rounds
    m = torchvision.models.resnet50(num_classes=100, norm_layer=lambda c: nn.GroupNorm(32, c))
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


@torch.no_grad()
def global_average(module, world):
    for p in module.parameters():
        dist.all_reduce(p.data)
        p.data.div_(world)


@torch.no_grad()
def evaluate(module, loader, device):
    module.eval()
    s = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = module(x)
        s[0] += F.cross_entropy(out, y, reduction="sum").double()
        s[1] += (out.argmax(1) == y).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    module.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_set = datasets.CIFAR100(args.data, train=True, download=False, transform=transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(mean, std)]))
    test_set = datasets.CIFAR100(args.data, train=False, download=False, transform=transforms.Compose([
        transforms.ToTensor(), transforms.Normalize(mean, std)]))
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=500,
                             num_workers=args.workers, pin_memory=True)

    net = build_model().to(device)
    model = DDP(net, device_ids=[local_rank])

    # subgroup=None: one intra-node subgroup per machine is created for the local phase
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=args.switch_iter)
    model.register_comm_hook(state, post_localSGD_hook)
    averager = averagers.PeriodicModelAverager(period=args.period, warmup_steps=args.switch_iter)

    global_batch = args.batch_size * world
    peak_lr = args.lr * global_batch / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    steps_per_epoch = len(train_loader)
    warmup = args.warmup_epochs * steps_per_epoch
    total = args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total - warmup),
    ], milestones=[warmup])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}, global batch {global_batch}, peak lr {peak_lr:.3f}, "
              f"period {args.period}, switch at {args.switch_iter}", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_meter = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            # no-op before warmup_steps, then averages across all ranks every `period` calls
            averager.average_parameters(model.parameters())
            scheduler.step()
            loss_meter += torch.stack([loss.detach(), torch.ones((), device=device)])

        # the local models can be a few steps apart here; evaluate and save the global average
        global_average(net, world)
        dist.all_reduce(loss_meter)
        test_loss, test_acc = evaluate(net, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch} train_loss {(loss_meter[0] / loss_meter[1]).item():.4f} "
                  f"test_loss {test_loss:.4f} test_acc {test_acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "checkpoint.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
