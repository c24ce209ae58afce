"""SAM (sharpness-aware minimization) for WideResNet-28-10 on CIFAR-10/100.

Two forward/backward passes per step. The ascent step uses each worker's own
minibatch gradient (m-sharpness with m = per-GPU batch, as in Foret et al.),
the descent gradient is all-reduced as usual.

torchrun --nproc_per_node=4 02_sam_wrn_cifar.py --config configs/sam_c100.yaml
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
import torchvision
import torchvision.transforms as T
import wandb


DEFAULTS = dict(
    dataset="cifar100", data_root="./data", depth=28, width=10, dropout=0.0,
    epochs=200, batch_size=128, lr=0.1, momentum=0.9, weight_decay=5e-4,
    rho=0.05, adaptive=False, label_smoothing=0.1, workers=4,
    out_dir="checkpoints/sam", project="sam-cifar",
)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride, dropout):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        o = F.relu(self.bn1(x))
        y = self.conv1(o)
        y = self.conv2(self.dropout(F.relu(self.bn2(y))))
        return y + (self.shortcut(o) if self.shortcut is not None else x)


class WideResNet(nn.Module):
    def __init__(self, depth, width, num_classes, dropout=0.0):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16, 16 * width, 32 * width, 64 * width]
        self.stem = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        layers, cin = [], widths[0]
        for i, stride in enumerate([1, 2, 2]):
            for j in range(n):
                layers.append(BasicBlock(cin, widths[i + 1], stride if j == 0 else 1, dropout))
                cin = widths[i + 1]
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        x = F.adaptive_avg_pool2d(F.relu(self.bn(x)), 1).flatten(1)
        return self.fc(x)


class SAM(torch.optim.Optimizer):
    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, **kwargs):
        defaults = dict(rho=rho, adaptive=adaptive, **kwargs)
        super().__init__(params, defaults)
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                e_w = (torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale
                p.add_(e_w)
        if zero_grad:
            self.zero_grad(set_to_none=True)

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad(set_to_none=True)

    def _grad_norm(self):
        dev = self.param_groups[0]["params"][0].device
        return torch.norm(torch.stack([
            ((torch.abs(p) if g["adaptive"] else 1.0) * p.grad).norm(p=2).to(dev)
            for g in self.param_groups for p in g["params"] if p.grad is not None
        ]), p=2)


def disable_running_stats(model):
    def _disable(m):
        if isinstance(m, _BatchNorm):
            m.backup_momentum = m.momentum
            m.momentum = 0
    model.apply(_disable)


def enable_running_stats(model):
    def _enable(m):
        if isinstance(m, _BatchNorm) and hasattr(m, "backup_momentum"):
            m.momentum = m.backup_momentum
    model.apply(_enable)


def get_data(cfg, rank, world):
    mean, std = (0.507, 0.487, 0.441), (0.267, 0.256, 0.276)
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(),
                          T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    ds_cls = torchvision.datasets.CIFAR100 if cfg["dataset"] == "cifar100" else torchvision.datasets.CIFAR10
    if rank == 0:
        ds_cls(cfg["data_root"], train=True, download=True)
        ds_cls(cfg["data_root"], train=False, download=True)
    dist.barrier()
    train = ds_cls(cfg["data_root"], train=True, transform=train_tf)
    test = ds_cls(cfg["data_root"], train=False, transform=test_tf)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    train_loader = DataLoader(train, batch_size=cfg["batch_size"], sampler=sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test, range(rank, len(test), world)), batch_size=256,
                             num_workers=cfg["workers"], pin_memory=True)
    return train_loader, test_loader, sampler, len(train.classes)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    correct = torch.zeros((), device=device)
    total = torch.zeros((), device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        correct += (net(x).argmax(1) == y).sum()
        total += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return (correct / total).item() * 100


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--rho", type=float, default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    if args.rho is not None:
        cfg["rho"] = args.rho

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    train_loader, test_loader, sampler, num_classes = get_data(cfg, rank, world)
    net = WideResNet(cfg["depth"], cfg["width"], num_classes, cfg["dropout"]).to(device)
    model = DDP(net, device_ids=[local_rank])

    # lr in the config is for a global batch of 128
    lr = cfg["lr"] * cfg["batch_size"] * world / 128
    optimizer = SAM(model.parameters(), torch.optim.SGD, rho=cfg["rho"], adaptive=cfg["adaptive"],
                    lr=lr, momentum=cfg["momentum"], weight_decay=cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer.base_optimizer, T_max=cfg["epochs"])
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg["label_smoothing"])

    if rank == 0:
        wandb.init(project=cfg["project"], config=cfg)
        os.makedirs(cfg["out_dir"], exist_ok=True)

    best = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros((), device=device)
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)

            # ascent: local gradient only, no all-reduce
            enable_running_stats(model)
            with model.no_sync():
                loss = criterion(model(x), y)
                loss.backward()
            optimizer.first_step(zero_grad=True)

            # descent: gradient at the perturbed point, synchronised across workers
            disable_running_stats(model)
            criterion(model(x), y).backward()
            optimizer.second_step(zero_grad=True)

            loss_sum += loss.detach()
        enable_running_stats(model)
        scheduler.step()

        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        acc = evaluate(net, test_loader, device)
        if rank == 0:
            train_loss = loss_sum.item() / len(train_loader)
            wandb.log({"train/loss": train_loss, "test/acc": acc,
                       "lr": scheduler.get_last_lr()[0]}, step=epoch)
            print(f"[{epoch:03d}] loss {train_loss:.4f} acc {acc:.2f}")
            ckpt = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch, "cfg": cfg}
            torch.save(ckpt, os.path.join(cfg["out_dir"], "last.pt"))
            if acc > best:
                best = acc
                torch.save(ckpt, os.path.join(cfg["out_dir"], "best.pt"))

    if rank == 0:
        wandb.summary["best_acc"] = best
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
