"""CIFAR-10 ResNet-18: PowerSGD gradient compression + ZeRO-sharded SGD.

Sweeps over --powersgd-rank in {1, 2, 4, 8} are driven by sweeps/powersgd.sh.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.in_planes = 64
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = self._make_layer(64, 2, 1)
        self.layer2 = self._make_layer(128, 2, 2)
        self.layer3 = self._make_layer(256, 2, 2)
        self.layer4 = self._make_layer(512, 2, 2)
        self.fc = nn.Linear(512, num_classes)

    def _make_layer(self, planes, n, stride):
        layers = []
        for s in [stride] + [1] * (n - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/cifar10")
    p.add_argument("--out", default="runs/powersgd")
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="LR for a global batch of 128, scaled linearly")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--powersgd-rank", type=int, default=2)
    p.add_argument("--start-powersgd-iter", type=int, default=1000)
    p.add_argument("--no-error-feedback", action="store_true")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def get_data(args, rank, world):
    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.ToTensor(), norm])
    # rank 0 fetches / verifies the archive, the others wait and then only read it
    if rank != 0:
        dist.barrier()
    train_set = datasets.CIFAR10(args.data, train=True, download=(rank == 0), transform=train_tf)
    test_set = datasets.CIFAR10(args.data, train=False, download=(rank == 0), transform=test_tf)
    if rank == 0:
        dist.barrier()
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    # exact shard of the test set (no padding), so the summed counts cover each image once
    test_shard = Subset(test_set, list(range(rank, len(test_set), world)))
    test_loader = DataLoader(test_shard, batch_size=256, num_workers=4, pin_memory=True)
    return train_loader, test_loader, sampler


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    correct = torch.zeros((), device=device)
    seen = torch.zeros((), device=device)
    loss_sum = torch.zeros((), device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = net(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum")
        correct += (logits.argmax(1) == y).sum()
        seen += y.numel()
    stats = torch.stack([loss_sum, correct, seen])
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_loader, test_loader, sampler = get_data(args, rank, world)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(ResNet18()).to(device)
    model = DDP(net, device_ids=[local_rank], bucket_cap_mb=25)
    state = powerSGD.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=args.powersgd_rank,
        start_powerSGD_iter=args.start_powersgd_iter,
        use_error_feedback=not args.no_error_feedback,
        warm_start=True,
    )
    model.register_comm_hook(state, powerSGD.powerSGD_hook)

    global_batch = args.batch_size * world
    lr = args.lr * global_batch / 128
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                        lr=lr, momentum=args.momentum, weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))

    ckpt_path = os.path.join(args.out, "last.pt")
    start_epoch = 0
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))
        print(f"world={world} global_batch={global_batch} lr={lr:.4f} powersgd_rank={args.powersgd_rank}")

    step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += torch.stack([loss.detach() * y.size(0), torch.tensor(float(y.size(0)), device=device)])
            step += 1
        dist.all_reduce(running)
        test_loss, test_acc = evaluate(net, test_loader, device)

        # every rank sends its shard of the optimizer state to rank 0
        optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            train_loss = (running[0] / running[1]).item()
            writer.add_scalar("train/loss", train_loss, step)
            writer.add_scalar("test/loss", test_loss, step)
            writer.add_scalar("test/acc", test_acc, step)
            writer.add_scalar("time/epoch_s", time.time() - t0, step)
            print(f"epoch {epoch} train {train_loss:.4f} test {test_loss:.4f} acc {test_acc:.4f} "
                  f"({time.time() - t0:.1f}s)")
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
