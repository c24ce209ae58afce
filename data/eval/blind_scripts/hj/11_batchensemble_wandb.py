"""BatchEnsemble (Wen et al., 2020) on CIFAR-10 with DDP and Weights & Biases.

Every conv / linear layer has a shared weight W and per-member rank-1 fast
weights r_i, s_i: W_i = W * (s_i r_i^T). During training the mini-batch is
tiled ensemble_size times so that every member sees every example.

    torchrun --nproc_per_node=8 11_batchensemble_wandb.py --ensemble-size 4 --wandb-project bdl-cifar
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms as T


class BEConv2d(nn.Module):
    def __init__(self, cin, cout, k, ens, stride=1, padding=0):
        super().__init__()
        self.ens = ens
        self.conv = nn.Conv2d(cin, cout, k, stride, padding, bias=False)
        self.r = nn.Parameter(torch.empty(ens, cin))
        self.s = nn.Parameter(torch.empty(ens, cout))
        self.bias = nn.Parameter(torch.zeros(ens, cout))
        # random sign init (+-1) as in the paper
        with torch.no_grad():
            self.r.copy_(torch.randint(0, 2, self.r.shape).float() * 2 - 1)
            self.s.copy_(torch.randint(0, 2, self.s.shape).float() * 2 - 1)

    def forward(self, x):
        b = x.size(0) // self.ens
        r = self.r.repeat_interleave(b, 0)[:, :, None, None]
        s = self.s.repeat_interleave(b, 0)[:, :, None, None]
        bias = self.bias.repeat_interleave(b, 0)[:, :, None, None]
        return self.conv(x * r) * s + bias


class BELinear(nn.Module):
    def __init__(self, din, dout, ens):
        super().__init__()
        self.ens = ens
        self.fc = nn.Linear(din, dout, bias=False)
        self.r = nn.Parameter(torch.ones(ens, din))
        self.s = nn.Parameter(torch.ones(ens, dout))
        self.bias = nn.Parameter(torch.zeros(ens, dout))

    def forward(self, x):
        b = x.size(0) // self.ens
        r, s = self.r.repeat_interleave(b, 0), self.s.repeat_interleave(b, 0)
        return self.fc(x * r) * s + self.bias.repeat_interleave(b, 0)


class BEBlock(nn.Module):
    def __init__(self, cin, cout, stride, ens):
        super().__init__()
        self.c1 = BEConv2d(cin, cout, 3, ens, stride, 1)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = BEConv2d(cout, cout, 3, ens, 1, 1)
        self.b2 = nn.BatchNorm2d(cout)
        self.sc = None
        if stride != 1 or cin != cout:
            self.sc = nn.Sequential(BEConv2d(cin, cout, 1, ens, stride), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.b1(self.c1(x)))
        out = self.b2(self.c2(out))
        return F.relu(out + (x if self.sc is None else self.sc(x)))


class BEResNet18(nn.Module):
    def __init__(self, ens, num_classes=10):
        super().__init__()
        self.ens = ens
        self.stem = nn.Sequential(BEConv2d(3, 64, 3, ens, 1, 1), nn.BatchNorm2d(64), nn.ReLU())
        cfg, layers, cin = [(64, 1), (128, 2), (256, 2), (512, 2)], [], 64
        for cout, stride in cfg:
            layers += [BEBlock(cin, cout, stride, ens), BEBlock(cout, cout, 1, ens)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = BELinear(512, num_classes, ens)

    def forward(self, x):
        x = x.repeat(self.ens, 1, 1, 1)  # member-major tiling
        h = F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1).flatten(1)
        return self.fc(h).view(self.ens, -1, self.fc.fc.out_features)  # [ens, B, C]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/cifar10")
    p.add_argument("--out", default="runs/batchensemble")
    p.add_argument("--ensemble-size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=250)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU, before tiling")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--fast-lr-mult", type=float, default=0.5)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--wandb-project", default="bdl-cifar")
    p.add_argument("--run-name", default=None)
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device, n_bins=15):
    model.eval()
    acc = torch.zeros(3 + 2 * n_bins, device=device, dtype=torch.float64)  # n, correct, nll | bins
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        probs = F.softmax(model(x), dim=-1).mean(0)
        conf, pred = probs.max(1)
        hit = pred.eq(y).double()
        b = (conf * n_bins).long().clamp(max=n_bins - 1)
        acc[0] += y.numel()
        acc[1] += hit.sum()
        acc[2] += -probs.gather(1, y[:, None]).clamp_min(1e-12).log().sum()
        acc[3:3 + n_bins].index_add_(0, b, conf.double() - hit)
        acc[3 + n_bins:].index_add_(0, b, torch.ones_like(hit))
    dist.all_reduce(acc)
    n = acc[0]
    return {"acc": (acc[1] / n).item(), "nll": (acc[2] / n).item(),
            "ece": (acc[3:3 + n_bins].abs().sum() / n).item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    run = wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_set = datasets.CIFAR10(args.data, True, T.Compose([T.RandomCrop(32, 4), T.RandomHorizontalFlip(),
                                                             T.ToTensor(), norm]))
    test_set = datasets.CIFAR10(args.data, False, T.Compose([T.ToTensor(), norm]))
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), 500, num_workers=4)

    model = BEResNet18(args.ensemble_size).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])

    fast = [p for n, p in model.named_parameters() if n.endswith((".r", ".s"))]
    slow = [p for n, p in model.named_parameters() if not n.endswith((".r", ".s"))]
    opt = torch.optim.SGD([{"params": slow, "weight_decay": args.wd},
                           {"params": fast, "lr": args.lr * args.fast_lr_mult, "weight_decay": 0.0}],
                          lr=args.lr, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(args.epochs * f) for f in (0.3, 0.6, 0.8)], 0.2)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)  # [ens, B, C]
            loss = F.cross_entropy(logits.flatten(0, 1), y.repeat(args.ensemble_size))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 100 == 0:
                wandb.log({"train/loss": loss.item(), "lr": opt.param_groups[0]["lr"]}, step=step)
        sched.step()

        metrics = evaluate(model, test_loader, device)
        wandb.log({f"test/{k}": v for k, v in metrics.items()} | {"epoch": epoch,
                   "epoch_time": time.time() - t0}, step=step)
        if rank == 0:
            print(f"epoch {epoch} acc {metrics['acc']:.4f} nll {metrics['nll']:.4f} "
                  f"ece {metrics['ece']:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics},
                       os.path.join(args.out, "last.pt"))

    run.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
