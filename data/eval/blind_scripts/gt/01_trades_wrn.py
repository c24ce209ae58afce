"""TRADES adversarial training of WideResNet-34-10 on CIFAR-10 (DDP).

Follows Zhang et al., "Theoretically Principled Trade-off between Robustness
and Accuracy" (ICML 2019): beta=6, eps=8/255, 10 PGD steps of 2/255,
lr 0.1 decayed at epochs 75 and 90.

    torchrun --nproc_per_node=4 01_trades_wrn.py --data /datasets/cifar10
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


# ---------------------------------------------------------------------------
# WideResNet
# ---------------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, in_planes, out_planes, stride, drop_rate=0.0):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(in_planes, out_planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_planes)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_planes, out_planes, 3, 1, 1, bias=False)
        self.drop_rate = drop_rate
        self.equal_in_out = in_planes == out_planes
        self.shortcut = None
        if not self.equal_in_out:
            self.shortcut = nn.Conv2d(in_planes, out_planes, 1, stride, 0, bias=False)

    def forward(self, x):
        if not self.equal_in_out:
            x = self.relu1(self.bn1(x))
            out = x
        else:
            out = self.relu1(self.bn1(x))
        out = self.relu2(self.bn2(self.conv1(out)))
        if self.drop_rate > 0:
            out = F.dropout(out, p=self.drop_rate, training=self.training)
        out = self.conv2(out)
        return out + (x if self.equal_in_out else self.shortcut(x))


class WideResNet(nn.Module):
    def __init__(self, depth=34, widen_factor=10, num_classes=10, drop_rate=0.0):
        super().__init__()
        assert (depth - 4) % 6 == 0
        n = (depth - 4) // 6
        widths = [16, 16 * widen_factor, 32 * widen_factor, 64 * widen_factor]
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.block1 = self._group(widths[0], widths[1], n, 1, drop_rate)
        self.block2 = self._group(widths[1], widths[2], n, 2, drop_rate)
        self.block3 = self._group(widths[2], widths[3], n, 2, drop_rate)
        self.bn = nn.BatchNorm2d(widths[3])
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(widths[3], num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.data.fill_(1)
                m.bias.data.zero_()
            elif isinstance(m, nn.Linear):
                m.bias.data.zero_()

    @staticmethod
    def _group(in_planes, out_planes, n, stride, drop_rate):
        return nn.Sequential(*[
            BasicBlock(in_planes if i == 0 else out_planes, out_planes,
                       stride if i == 0 else 1, drop_rate)
            for i in range(n)
        ])

    def forward(self, x):
        out = self.conv1(x)
        out = self.block3(self.block2(self.block1(out)))
        out = self.relu(self.bn(out))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)


# ---------------------------------------------------------------------------
# TRADES loss / PGD evaluation
# ---------------------------------------------------------------------------
def trades_loss(model, x_natural, y, optimizer, step_size, epsilon, perturb_steps, beta):
    criterion_kl = nn.KLDivLoss(reduction="sum")
    model.eval()
    batch_size = x_natural.size(0)
    x_adv = x_natural.detach() + 0.001 * torch.randn_like(x_natural)
    with torch.no_grad():
        p_natural = F.softmax(model(x_natural), dim=1)
    for _ in range(perturb_steps):
        x_adv.requires_grad_()
        loss_kl = criterion_kl(F.log_softmax(model(x_adv), dim=1), p_natural)
        grad = torch.autograd.grad(loss_kl, [x_adv])[0]
        x_adv = x_adv.detach() + step_size * torch.sign(grad.detach())
        x_adv = torch.min(torch.max(x_adv, x_natural - epsilon), x_natural + epsilon)
        x_adv = torch.clamp(x_adv, 0.0, 1.0)
    model.train()
    x_adv = x_adv.detach()

    optimizer.zero_grad(set_to_none=True)
    logits = model(x_natural)
    logits_adv = model(x_adv)
    loss_natural = F.cross_entropy(logits, y)
    loss_robust = (1.0 / batch_size) * criterion_kl(
        F.log_softmax(logits_adv, dim=1), F.softmax(logits, dim=1))
    return loss_natural + beta * loss_robust


def pgd_attack(model, x, y, eps, alpha, steps):
    delta = torch.empty_like(x).uniform_(-eps, eps)
    delta = (x + delta).clamp(0, 1) - x
    for _ in range(steps):
        delta.requires_grad_(True)
        loss = F.cross_entropy(model(x + delta), y)
        grad, = torch.autograd.grad(loss, [delta])
        delta = (delta.detach() + alpha * grad.sign()).clamp(-eps, eps)
        delta = (x + delta).clamp(0, 1) - x
    return (x + delta).detach()


def evaluate(model, loader, args, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.no_grad():
            stats[0] += (model(x).argmax(1) == y).sum()
        x_adv = pgd_attack(model, x, y, args.epsilon, args.step_size, 20)
        with torch.no_grad():
            stats[1] += (model(x_adv).argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def adjust_learning_rate(optimizer, epoch, args):
    lr = args.lr
    if epoch >= 75:
        lr *= 0.1
    if epoch >= 90:
        lr *= 0.1
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def parse_args():
    p = argparse.ArgumentParser(description="TRADES adversarial training (DDP)")
    p.add_argument("--data", default="./data")
    p.add_argument("--out-dir", default="./checkpoints/trades_wrn34")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=128, help="global batch size")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=2e-4)
    p.add_argument("--epsilon", type=float, default=8 / 255)
    p.add_argument("--step-size", type=float, default=2 / 255)
    p.add_argument("--num-steps", type=int, default=10)
    p.add_argument("--beta", type=float, default=6.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.benchmark = True

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
    ])
    test_tf = transforms.ToTensor()
    train_set = datasets.CIFAR10(args.data, train=True, download=False, transform=train_tf)
    test_set = datasets.CIFAR10(args.data, train=False, download=False, transform=test_tf)

    per_gpu_batch = args.batch_size // world_size
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=per_gpu_batch, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=200, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True)

    model = WideResNet(depth=34, widen_factor=10).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.weight_decay)

    best_rob = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        lr = adjust_learning_rate(optimizer, epoch, args)
        model.train()
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = trades_loss(model, x, y, optimizer, args.step_size, args.epsilon,
                               args.num_steps, args.beta)
            loss.backward()
            optimizer.step()
            meter[0] += loss.detach() * x.size(0)
            meter[1] += x.size(0)
            if rank == 0 and i % 50 == 0:
                print(f"epoch {epoch} iter {i}/{len(train_loader)} loss {loss.item():.4f}",
                      flush=True)
        dist.all_reduce(meter)
        if rank == 0:
            print(f"[epoch {epoch}] lr {lr:.4f} train loss {(meter[0] / meter[1]).item():.4f} "
                  f"time {time.time() - t0:.1f}s", flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            nat_acc, rob_acc = evaluate(model, test_loader, args, device)
            if rank == 0:
                print(f"[epoch {epoch}] natural {nat_acc:.4f} PGD-20 {rob_acc:.4f}", flush=True)
                state = {
                    "epoch": epoch + 1,
                    "state_dict": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "nat_acc": nat_acc,
                    "rob_acc": rob_acc,
                }
                torch.save(state, os.path.join(args.out_dir, "last.pt"))
                if rob_acc > best_rob:
                    best_rob = rob_acc
                    torch.save(state, os.path.join(args.out_dir, "best.pt"))

    if rank == 0:
        print(f"done, best PGD-20 accuracy {best_rob:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
