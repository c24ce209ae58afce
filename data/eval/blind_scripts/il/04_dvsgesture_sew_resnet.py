"""SEW-ResNet (ADD connect) on DVS128 Gesture, SpikingJelly multi-step mode.

torchrun --nnodes=1 --nproc_per_node=4 04_dvsgesture_sew_resnet.py \
    --data /datasets/DVS128Gesture --T 16 --accum 2 --amp
"""
import argparse
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from spikingjelly.activation_based import functional, layer, neuron, surrogate
from spikingjelly.datasets.dvs128_gesture import DVS128Gesture


def lif():
    return neuron.LIFNode(tau=2.0, detach_reset=True, surrogate_function=surrogate.ATan())


def conv_bn(cin, cout, stride=1):
    # [T, N, ...] is flattened to [T*N, ...] so BN sees every time step of the batch
    return layer.SeqToANNContainer(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
    )


class SEWBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Sequential(conv_bn(cin, cout, stride), lif())
        self.conv2 = nn.Sequential(conv_bn(cout, cout), lif())
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                layer.SeqToANNContainer(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)),
                lif())

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        return self.conv2(self.conv1(x)) + identity  # ADD element-wise function


class SEWResNet(nn.Module):
    def __init__(self, widths=(32, 64, 128, 256), num_classes=11):
        super().__init__()
        self.stem = nn.Sequential(conv_bn(2, widths[0]), lif(), layer.MaxPool2d(2))
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(SEWBlock(cin, w, stride=1 if i == 0 else 2))
            blocks.append(SEWBlock(w, w))
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.pool = layer.AdaptiveAvgPool2d(1)
        self.fc = layer.Linear(widths[-1], num_classes)
        functional.set_step_mode(self, "m")

    def forward(self, x):  # x [T, N, 2, H, W]
        x = self.pool(self.blocks(self.stem(x))).flatten(2)
        return self.fc(x).mean(0)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="./runs/sew_gesture")
    ap.add_argument("--T", type=int, default=16)
    ap.add_argument("--bs", type=int, default=8, help="micro-batch per GPU")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=192)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--wd", type=float, default=0.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--amp", action="store_true")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    correct = total = 0
    for frame, label in loader:
        frame = frame.to(device).float().transpose(0, 1)
        label = label.to(device)
        correct += (net(frame).argmax(1) == label).sum().item()
        total += label.numel()
        functional.reset_net(net)
    return correct / total


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    if rank == 0:
        for train in (True, False):  # integrate the frames once
            DVS128Gesture(args.data, train=train, data_type="frame", frames_number=args.T, split_by="number")
    dist.barrier()
    train_set = DVS128Gesture(args.data, train=True, data_type="frame", frames_number=args.T, split_by="number")
    test_set = DVS128Gesture(args.data, train=False, data_type="frame", frames_number=args.T, split_by="number")

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    # the test set is small (288 samples); rank 0 evaluates all of it
    test_loader = DataLoader(test_set, batch_size=32, shuffle=False, num_workers=args.workers)

    net = SEWResNet()
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net.to(device)
    net = DistributedDataParallel(net, device_ids=[local_rank])

    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start_epoch, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location={"cuda:0": f"cuda:{local_rank}"})
        net.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]

    writer = SummaryWriter(args.out) if rank == 0 else None
    steps_per_epoch = len(train_loader)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        net.train()
        t0 = time.time()
        run_loss = torch.zeros(2, device=device)
        optimizer.zero_grad(set_to_none=True)
        for i, (frame, label) in enumerate(train_loader):
            frame = frame.to(device, non_blocking=True).float().transpose(0, 1)
            label = label.to(device, non_blocking=True)
            boundary = (i + 1) % args.accum == 0 or (i + 1) == steps_per_epoch
            # skip the gradient all-reduce on accumulation micro-steps
            ctx = nullcontext() if boundary else net.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                    out = net(frame)
                    loss = F.cross_entropy(out, label)
                scaler.scale(loss / args.accum).backward()
            functional.reset_net(net)
            run_loss[0] += loss.detach() * label.numel()
            run_loss[1] += label.numel()
            if boundary:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        dist.all_reduce(run_loss)

        if rank == 0:
            acc = evaluate(net.module, test_loader, device)
            train_loss = (run_loss[0] / run_loss[1]).item()
            writer.add_scalar("loss/train", train_loss, epoch)
            writer.add_scalar("acc/test", acc, epoch)
            print(f"[{epoch}] loss {train_loss:.4f} test acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            ckpt = {"model": net.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                    "epoch": epoch, "best": max(best, acc)}
            tmp = os.path.join(args.out, "last.pt.tmp")
            torch.save(ckpt, tmp)
            os.replace(tmp, os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        # keep the other ranks from racing ahead while rank 0 evaluates and writes
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
