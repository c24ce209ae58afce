"""Eager-mode QAT of a ResNet-20 (CIFAR-10) for int8 deployment on ARM (qnnpack).

The fp32 model is defined quantization-ready (QuantStub/DeQuantStub, FloatFunctional
for the residual add), fused Conv+BN(+ReLU), prepared for QAT and fine-tuned with DDP.

    torchrun --nproc_per_node=4 16_qat_resnet20_cifar.py --fp32-ckpt ckpt/resnet20_fp32.pth
"""
import argparse
import copy
import os
import time

import torch
import torch.ao.nn.intrinsic.qat as nniqat
import torch.ao.quantization as tq
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU()
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        self.add = nn.quantized.FloatFunctional()

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(self.add.add(out, identity))

    def fuse(self, is_qat):
        fuse = tq.fuse_modules_qat if is_qat else tq.fuse_modules
        fuse(self, [["conv1", "bn1", "relu1"], ["conv2", "bn2"]], inplace=True)
        if self.down is not None:
            fuse(self.down, [["0", "1"]], inplace=True)


class ResNet20(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.quant = tq.QuantStub()
        self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        blocks, cin = [], 16
        for cout, stride in [(16, 1), (32, 2), (64, 2)]:
            for i in range(3):
                blocks.append(Block(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        x = self.relu(self.bn(self.conv(self.quant(x))))
        x = self.pool(self.layers(x)).flatten(1)
        return self.dequant(self.fc(x))

    def fuse_model(self, is_qat=True):
        fuse = tq.fuse_modules_qat if is_qat else tq.fuse_modules
        fuse(self, [["conv", "bn", "relu"]], inplace=True)
        for b in self.layers:
            b.fuse(is_qat)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="./data")
    p.add_argument("--fp32-ckpt", required=True)
    p.add_argument("--out-dir", default="ckpt/qat_resnet20")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.01, help="for a global batch of 256")
    p.add_argument("--freeze-bn-epoch", type=int, default=8)
    p.add_argument("--freeze-observer-epoch", type=int, default=10)
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        c[0] += (model(x).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return 100.0 * (c[0] / c[1]).item()


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    tf_train = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                          T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))])
    tf_test = T.Compose([T.ToTensor(), T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))])
    train_set = torchvision.datasets.CIFAR10(args.data, train=True, transform=tf_train)
    test_set = torchvision.datasets.CIFAR10(args.data, train=False, transform=tf_test)
    sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=500, num_workers=4)

    model = ResNet20()
    model.load_state_dict(torch.load(args.fp32_ckpt, map_location="cpu"))
    model.train()
    model.fuse_model(is_qat=True)
    torch.backends.quantized.engine = "qnnpack"
    model.qconfig = tq.get_default_qat_qconfig("qnnpack")
    tq.prepare_qat(model, inplace=True)
    model = model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"QAT fine-tune on {world} GPUs, global batch {args.batch_size * world}, lr {lr:.4f}")

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        if epoch >= args.freeze_bn_epoch:
            model.apply(nniqat.freeze_bn_stats)
        if epoch >= args.freeze_observer_epoch:
            model.apply(tq.disable_observer)
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()

        acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}  fake-quant acc {acc:.2f}  {time.time() - t0:.1f}s")
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.out_dir, "qat_best.pth"))

    if rank == 0:
        qmodel = copy.deepcopy(model.module).cpu().eval()
        qmodel.load_state_dict(torch.load(os.path.join(args.out_dir, "qat_best.pth"), map_location="cpu"))
        int8 = tq.convert(qmodel, inplace=False)
        torch.jit.save(torch.jit.script(int8), os.path.join(args.out_dir, "resnet20_int8_qnnpack.pt"))
        print(f"best fake-quant acc {best:.2f}, int8 model saved")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
