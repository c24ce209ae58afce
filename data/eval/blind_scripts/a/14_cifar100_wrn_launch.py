"""WideResNet-28-10 on CIFAR-100.

Launch (works with both the old launcher and torchrun):
    python -m torch.distributed.launch --nproc_per_node=4 --use_env train_wrn.py --data ./data
    torchrun --nproc_per_node=4 train_wrn.py --data ./data
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


class WideBasic(nn.Module):
    def __init__(self, cin, cout, stride, drop):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.drop = nn.Dropout(drop)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=stride, padding=1, bias=False)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Conv2d(cin, cout, 1, stride=stride, bias=False)

    def forward(self, x):
        o = F.relu(self.bn1(x))
        y = self.conv1(o)
        y = self.conv2(F.relu(self.bn2(self.drop(y))))
        return y + (self.shortcut(o) if self.shortcut is not None else x)


class WideResNet(nn.Module):
    def __init__(self, depth=28, widen=10, num_classes=100, drop=0.3):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        self.conv1 = nn.Conv2d(3, widths[0], 3, padding=1, bias=False)
        blocks, cin = [], widths[0]
        for i, (w, s) in enumerate(zip(widths[1:], [1, 2, 2])):
            for j in range(n):
                blocks.append(WideBasic(cin, w, s if j == 0 else 1, drop))
                cin = w
        self.blocks = nn.Sequential(*blocks)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = F.relu(self.bn(self.blocks(self.conv1(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--save-path", default="./wrn28_10_c100")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.1, help="for a global batch of 128")
    parser.add_argument("--workers", type=int, default=4)
    # torch.distributed.launch passes --local-rank (>=2.0) or --local_rank (<2.0) unless --use_env is given
    parser.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int,
                        default=int(os.environ.get("LOCAL_RANK", 0)))
    return parser.parse_args()


def accuracy_counts(model, loader, device, flip_tta=False):
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x)
            if flip_tta:
                logits = logits + model(torch.flip(x, dims=[3]))
            correct += (logits.argmax(1) == y).sum()
            total += y.size(0)
    return correct, total


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = T.Compose([T.RandomCrop(32, 4, padding_mode="reflect"), T.RandomHorizontalFlip(),
                          T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    if rank == 0:
        torchvision.datasets.CIFAR100(args.data, train=True, download=True)
        torchvision.datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    train_set = torchvision.datasets.CIFAR100(args.data, train=True, transform=train_tf)
    test_set = torchvision.datasets.CIFAR100(args.data, train=False, transform=test_tf)
    test_shard = Subset(test_set, range(rank, len(test_set), world))

    sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_shard, batch_size=200, num_workers=args.workers)

    model = WideResNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)

    lr = args.lr * args.batch_size * world / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[60, 120, 160], gamma=0.2)

    best_acc = 0.0
    best_file = os.path.join(args.save_path, "best.pth")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        loss_sum = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += torch.stack([loss.detach() * y.size(0), torch.tensor(float(y.size(0)), device=device)])
        scheduler.step()
        dist.all_reduce(loss_sum)

        correct, total = accuracy_counts(model, test_loader, device)
        dist.all_reduce(correct)
        dist.all_reduce(total)
        acc = (correct / total).item()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} train loss {(loss_sum[0] / loss_sum[1]).item():.3f} "
                  f"test acc {acc * 100:.2f} {time.time() - start:.0f}s")
            if acc > best_acc:
                best_acc = acc
                os.makedirs(args.save_path, exist_ok=True)
                torch.save({"state_dict": model.state_dict(), "epoch": epoch, "acc": acc}, best_file)
        dist.barrier()

    # final evaluation of the best checkpoint with horizontal-flip TTA, on one GPU
    if rank == 0:
        net = WideResNet().to(device)
        ckpt = torch.load(best_file, map_location=device)
        net.load_state_dict(ckpt["state_dict"])
        full_loader = DataLoader(test_set, batch_size=200, num_workers=args.workers)
        c, t = accuracy_counts(net, full_loader, device, flip_tta=True)
        print(f"best epoch {ckpt['epoch'] + 1}: acc {ckpt['acc'] * 100:.2f}, with flip TTA {(c / t).item() * 100:.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
