"""MIMO: multi-input multi-output ensembles in a single network (Havasi et al., ICLR 2021).

M independent subnetworks share one WRN-28-10 backbone. During training each
of the M input slots gets a different (independently shuffled) image and
each output head must predict its own slot; at test time the same image is
fed to every slot and the M predictions are averaged.

    torchrun --nproc_per_node=4 18_mimo_ensemble.py --ensemble-size 3 --epochs 250
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms


def parse_args():
    parser = argparse.ArgumentParser(description="MIMO ensemble training")
    parser.add_argument("--data", default="/data/cifar10")
    parser.add_argument("--out", default="runs/mimo")
    parser.add_argument("--ensemble-size", type=int, default=3)
    parser.add_argument("--input-repetition", type=float, default=0.6)
    parser.add_argument("--batch-repetition", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=250)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--wd", type=float, default=3e-4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class WideBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.proj = nn.Conv2d(cin, cout, 1, stride, bias=False) if stride != 1 or cin != cout else None

    def forward(self, x):
        o = F.relu(self.bn1(x))
        sc = self.proj(o) if self.proj is not None else x
        o = self.conv2(F.relu(self.bn2(self.conv1(o))))
        return o + sc


class MIMOWideResNet(nn.Module):
    def __init__(self, ensemble_size, num_classes=10, depth=28, width=10):
        super().__init__()
        self.M, self.K = ensemble_size, num_classes
        n = (depth - 4) // 6
        ch = [16, 16 * width, 32 * width, 64 * width]
        # the M images are stacked along the channel axis
        self.stem = nn.Conv2d(3 * ensemble_size, ch[0], 3, 1, 1, bias=False)
        blocks, cin = [], ch[0]
        for i, s in enumerate((1, 2, 2)):
            for j in range(n):
                blocks.append(WideBlock(cin, ch[i + 1], s if j == 0 else 1))
                cin = ch[i + 1]
        self.blocks = nn.Sequential(*blocks)
        self.bn = nn.BatchNorm2d(cin)
        self.head = nn.Linear(cin, ensemble_size * num_classes)

    def forward(self, x):  # x: [B, M, 3, H, W]
        b = x.size(0)
        h = self.blocks(self.stem(x.flatten(1, 2)))
        h = F.adaptive_avg_pool2d(F.relu(self.bn(h)), 1).flatten(1)
        return self.head(h).view(b, self.M, self.K)


def mimo_batch(x, y, M, input_rep, batch_rep):
    """Builds [B*batch_rep, M, 3, H, W] inputs; a fraction input_rep shares the same permutation."""
    x = x.repeat(batch_rep, 1, 1, 1)
    y = y.repeat(batch_rep)
    n = x.size(0)
    n_shared = int(n * input_rep)
    idx = []
    for _ in range(M):
        perm = torch.randperm(n, device=x.device)
        shared = torch.arange(n_shared, device=x.device)
        idx.append(torch.cat([shared, perm[n_shared:]]) if n_shared else perm)
    idx = torch.stack(idx, 1)  # [n, M]
    return x[idx], y[idx]


@torch.no_grad()
def evaluate(model, loader, device, M):
    model.eval()
    s = torch.zeros(4, device=device, dtype=torch.float64)  # n, correct ens, nll ens, mean member acc
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        probs = model(x[:, None].expand(-1, M, -1, -1, -1)).softmax(-1)  # [B, M, K]
        ens = probs.mean(1)
        s[0] += y.numel()
        s[1] += ens.argmax(1).eq(y).sum()
        s[2] += F.nll_loss(ens.clamp_min(1e-12).log(), y, reduction="sum")
        s[3] += probs.argmax(-1).eq(y[:, None]).double().mean(1).sum()
    dist.all_reduce(s)
    return {"acc": (s[1] / s[0]).item(), "nll": (s[2] / s[0]).item(), "member_acc": (s[3] / s[0]).item()}


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(0)

    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_set = datasets.CIFAR10(args.data, train=True, transform=transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    test_set = datasets.CIFAR10(args.data, train=False, transform=transforms.Compose([transforms.ToTensor(), norm]))
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    # batch repetition multiplies the effective batch, so the loader batch is divided by it
    loader = DataLoader(train_set, batch_size=args.batch_size // args.batch_repetition, sampler=sampler,
                        num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=500,
                             num_workers=args.workers)

    model = MIMOWideResNet(args.ensemble_size).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    lr = args.lr * world * args.batch_size / 128
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    milestones = [int(args.epochs * f) for f in (0.3, 0.6, 0.8)]
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones, gamma=0.2)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            xm, ym = mimo_batch(x, y, args.ensemble_size, args.input_repetition, args.batch_repetition)
            logits = model(xm)  # [n, M, K]
            loss = F.cross_entropy(logits.flatten(0, 1), ym.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(tot)

        if epoch % 10 == 9 or epoch == args.epochs - 1:
            m = evaluate(model, test_loader, device, args.ensemble_size)
            if rank == 0:
                print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} ens acc {m['acc']:.4f} "
                      f"nll {m['nll']:.4f} member acc {m['member_acc']:.4f} ({time.time() - t0:.0f}s)",
                      flush=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                           os.path.join(args.out, "mimo_last.pt"))
        elif rank == 0:
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} ({time.time() - t0:.0f}s)", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
