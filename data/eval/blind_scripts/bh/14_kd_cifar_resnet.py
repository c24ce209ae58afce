"""Vanilla KD (Hinton et al.) on CIFAR-100: ResNet-56 teacher -> ResNet-20 student.

torchrun --nproc_per_node=4 14_kd_cifar_resnet.py --teacher ckpt/resnet56_cifar100.pth --save-dir save/kd_r56_r20
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

CIFAR_MEAN = (0.5071, 0.4867, 0.4408)
CIFAR_STD = (0.2675, 0.2565, 0.2761)


def parse_option():
    parser = argparse.ArgumentParser("KD on CIFAR-100")
    parser.add_argument("--data-root", default="./data")
    parser.add_argument("--teacher", required=True, help="path to the teacher checkpoint")
    parser.add_argument("--save-dir", default="./save/kd")
    parser.add_argument("--epochs", type=int, default=240)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.1, help="lr for the global batch")
    parser.add_argument("--lr-decay-epochs", type=int, nargs="+", default=[150, 180, 210])
    parser.add_argument("--lr-decay-rate", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--kd-T", type=float, default=4.0)
    parser.add_argument("-r", "--gamma", type=float, default=0.1, help="weight for CE")
    parser.add_argument("-a", "--alpha", type=float, default=0.9, help="weight for KD")
    parser.add_argument("--num-workers", type=int, default=4)
    return parser.parse_args()


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


class CifarResNet(nn.Module):
    def __init__(self, depth, num_classes=100):
        super().__init__()
        assert (depth - 2) % 6 == 0
        n = (depth - 2) // 6
        self.in_planes = 16
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = self._make_layer(16, n, 1)
        self.layer2 = self._make_layer(32, n, 2)
        self.layer3 = self._make_layer(64, n, 2)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, planes, blocks, stride):
        layers = []
        for s in [stride] + [1] * (blocks - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)


class DistillKL(nn.Module):
    def __init__(self, T):
        super().__init__()
        self.T = T

    def forward(self, y_s, y_t):
        p_s = F.log_softmax(y_s / self.T, dim=1)
        p_t = F.softmax(y_t / self.T, dim=1)
        return F.kl_div(p_s, p_t, reduction="batchmean") * (self.T ** 2)


def adjust_learning_rate(epoch, opt, optimizer):
    steps = sum(epoch >= e for e in opt.lr_decay_epochs)
    lr = opt.lr * (opt.lr_decay_rate ** steps)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    return lr


def train_one_epoch(epoch, loader, student, teacher, criterion_cls, criterion_kd, optimizer, opt, device):
    student.train()
    teacher.eval()
    meter = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logit_s = student(x)
        with torch.no_grad():
            logit_t = teacher(x)
        loss = opt.gamma * criterion_cls(logit_s, y) + opt.alpha * criterion_kd(logit_s, logit_t)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        meter += torch.stack([loss.detach() * y.size(0), (logit_s.argmax(1) == y).sum().float(),
                              torch.tensor(float(y.size(0)), device=device)])
    dist.all_reduce(meter)
    return (meter[0] / meter[2]).item(), (100.0 * meter[1] / meter[2]).item()


@torch.no_grad()
def validate(loader, model, device):
    model.eval()
    meter = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        meter += torch.stack([F.cross_entropy(out, y, reduction="sum"), (out.argmax(1) == y).sum().float(),
                              torch.tensor(float(y.size(0)), device=device)])
    dist.all_reduce(meter)
    return (meter[0] / meter[2]).item(), (100.0 * meter[1] / meter[2]).item()


def main():
    opt = parse_option()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    if rank == 0:
        datasets.CIFAR100(opt.data_root, train=True, download=True)
        datasets.CIFAR100(opt.data_root, train=False, download=True)
    dist.barrier()
    train_set = datasets.CIFAR100(opt.data_root, train=True, transform=train_tf)
    test_set = datasets.CIFAR100(opt.data_root, train=False, transform=test_tf)

    assert opt.batch_size % world_size == 0
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=opt.batch_size // world_size, sampler=train_sampler,
                              num_workers=opt.num_workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=256,
                             shuffle=False, num_workers=opt.num_workers, pin_memory=True)

    teacher = CifarResNet(56)
    state = torch.load(opt.teacher, map_location="cpu")
    teacher.load_state_dict(state["model"] if "model" in state else state)
    teacher = teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    student = CifarResNet(20).to(device)
    student = nn.SyncBatchNorm.convert_sync_batchnorm(student)
    student = DDP(student, device_ids=[local_rank])

    criterion_cls = nn.CrossEntropyLoss()
    criterion_kd = DistillKL(opt.kd_T)
    optimizer = torch.optim.SGD(student.parameters(), lr=opt.lr, momentum=opt.momentum,
                                weight_decay=opt.weight_decay)

    _, teacher_acc = validate(test_loader, teacher, device)
    if rank == 0:
        os.makedirs(opt.save_dir, exist_ok=True)
        print(f"teacher accuracy: {teacher_acc:.2f}")

    best_acc = 0.0
    for epoch in range(1, opt.epochs + 1):
        lr = adjust_learning_rate(epoch, opt, optimizer)
        t0 = time.time()
        train_loss, train_acc = train_one_epoch(epoch, train_loader, student, teacher, criterion_cls,
                                                criterion_kd, optimizer, opt, device)
        test_loss, test_acc = validate(test_loader, student.module, device)
        if rank == 0:
            print(f"epoch {epoch} lr {lr:.4f} train loss {train_loss:.3f} acc {train_acc:.2f} | "
                  f"test loss {test_loss:.3f} acc {test_acc:.2f} | {time.time() - t0:.1f}s", flush=True)
            state = {"epoch": epoch, "model": student.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "accuracy": test_acc}
            torch.save(state, os.path.join(opt.save_dir, "resnet20_last.pth"))
            if test_acc > best_acc:
                best_acc = test_acc
                torch.save(state, os.path.join(opt.save_dir, "resnet20_best.pth"))

    if rank == 0:
        print(f"best accuracy: {best_acc:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
