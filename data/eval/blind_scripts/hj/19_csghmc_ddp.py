"""Cyclical SG-MCMC (cSGHMC, Zhang et al. ICLR 2020) for ResNet-18 on CIFAR-10 with DDP.

Cyclical cosine step size; in the last `sample_epochs` epochs of each cycle
Gaussian noise is injected into the momentum update and one posterior sample
is stored at the end of each of those epochs. Gradients are averaged by DDP,
so for the replicas to stay identical the injected noise has to be the same
on every rank: it is drawn from a dedicated CUDA generator that is seeded
identically everywhere and advanced in lock-step.

    torchrun --nproc_per_node=4 19_csghmc_ddp.py --cycles 4 --epochs-per-cycle 50
"""
import argparse
import glob
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import transforms as T


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/cifar10")
    p.add_argument("--out", default="runs/csghmc")
    p.add_argument("--cycles", type=int, default=4)
    p.add_argument("--epochs-per-cycle", type=int, default=50)
    p.add_argument("--sample-epochs", type=int, default=3)
    p.add_argument("--noise-epochs", type=int, default=5, help="noise is on in the last N epochs of a cycle")
    p.add_argument("--batch-size", type=int, default=32, help="per GPU; global 128 on 4 GPUs")
    p.add_argument("--lr0", type=float, default=0.5)
    p.add_argument("--alpha", type=float, default=0.9, help="1 - momentum")
    p.add_argument("--temperature", type=float, default=1.0 / 50000)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def cifar_resnet18():
    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def cyclic_lr(it, total, cycles, lr0):
    per = math.ceil(total / cycles)
    return 0.5 * lr0 * (math.cos(math.pi * (it % per) / per) + 1)


class SGHMC:
    """Momentum-form SGHMC exactly as in the reference cSGMCMC code."""

    def __init__(self, params, alpha, wd, datasize, noise_gen):
        self.params = [p for p in params if p.requires_grad]
        self.bufs = [torch.zeros_like(p) for p in self.params]
        self.alpha, self.wd, self.N = alpha, wd, datasize
        self.gen = noise_gen

    @torch.no_grad()
    def step(self, lr, temperature, add_noise):
        for p, buf in zip(self.params, self.bufs):
            d_p = p.grad.add(p, alpha=self.wd)
            buf.mul_(1 - self.alpha).add_(d_p, alpha=-lr)
            if add_noise:
                std = math.sqrt(2.0 * lr * self.alpha * temperature / self.N)
                buf.add_(torch.randn(p.shape, generator=self.gen, device=p.device, dtype=p.dtype), alpha=std)
            p.add_(buf)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


@torch.no_grad()
def bma_evaluate(model, sample_paths, loader, n_local, device):
    """Average the predictive over all stored samples on this rank's shard."""
    probs = None
    for path in sample_paths:
        model.load_state_dict(torch.load(path, map_location=device))
        model.eval()
        out = torch.cat([F.softmax(model(x.to(device)), -1) for x, _ in loader])
        probs = out if probs is None else probs + out
    probs = probs / len(sample_paths)
    y = torch.cat([y for _, y in loader]).to(device)
    assert y.numel() == n_local
    s = torch.stack([
        torch.tensor(float(y.numel()), device=device),
        probs.argmax(1).eq(y).sum().float(),
        F.nll_loss(probs.clamp_min(1e-12).log(), y, reduction="sum"),
    ])
    dist.all_reduce(s)
    return (s[1] / s[0]).item(), (s[2] / s[0]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_set = torchvision.datasets.CIFAR10(args.data, True, T.Compose(
        [T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    test_set = torchvision.datasets.CIFAR10(args.data, False, T.Compose([T.ToTensor(), norm]))
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    test_shard = Subset(test_set, range(rank, len(test_set), world))
    test_loader = DataLoader(test_shard, 500, shuffle=False, num_workers=4)

    net = cifar_resnet18().to(device)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    model = DDP(net, device_ids=[local_rank])

    noise_gen = torch.Generator(device=device)
    noise_gen.manual_seed(args.seed + 12345)  # same on every rank on purpose
    opt = SGHMC(model.parameters(), args.alpha, args.wd, len(train_set), noise_gen)

    epochs = args.cycles * args.epochs_per_cycle
    total_iters = epochs * len(loader)
    sample_dir = os.path.join(args.out, "samples")
    if rank == 0:
        os.makedirs(sample_dir, exist_ok=True)
    it, n_samples = 0, 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        pos = epoch % args.epochs_per_cycle
        noisy = pos >= args.epochs_per_cycle - args.noise_epochs
        run = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            lr = cyclic_lr(it, total_iters, args.cycles, args.lr0)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step(lr, args.temperature, add_noise=noisy)
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
            it += 1
        dist.all_reduce(run)

        if pos >= args.epochs_per_cycle - args.sample_epochs:
            if rank == 0:
                torch.save(net.state_dict(), os.path.join(sample_dir, f"sample_{n_samples:03d}.pt"))
            n_samples += 1
        if rank == 0:
            print(f"epoch {epoch} (cycle pos {pos}) lr {lr:.4f} noise {noisy} "
                  f"loss {(run[0] / run[1]).item():.4f} samples {n_samples}", flush=True)

    # all samples must be on disk before the other ranks read them
    dist.barrier()
    paths = sorted(glob.glob(os.path.join(sample_dir, "sample_*.pt")))[-n_samples:]
    acc, nll = bma_evaluate(net, paths, test_loader, len(test_shard), device)
    if rank == 0:
        print(f"cSGHMC BMA over {len(paths)} samples: acc {acc:.4f} nll {nll:.4f}", flush=True)
        with open(os.path.join(args.out, "bma.txt"), "w") as f:
            f.write(f"samples {len(paths)} acc {acc:.6f} nll {nll:.6f}\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
