"""SEW-ResNet (ADD) on DVS128 Gesture at full 128x128 resolution, spikingjelly + cupy LIF.

At 128x128 and T=16 only 4 samples fit per GPU, so the run uses 8 GPUs for a
global batch of 32.

    torchrun --nproc_per_node=8 18_sew_resnet_gesture.py --data-dir /data/DVS128Gesture --amp
"""
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from spikingjelly.activation_based import functional, layer, neuron, surrogate
from spikingjelly.datasets.dvs128_gesture import DVS128Gesture
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


def sn():
    return neuron.LIFNode(tau=2.0, surrogate_function=surrogate.ATan(), detach_reset=True,
                          step_mode="m", backend="cupy")


class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride=1):
        super().__init__()
        self.conv1 = layer.SeqToANNContainer(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out))
        self.sn1 = sn()
        self.conv2 = layer.SeqToANNContainer(nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out))
        self.sn2 = sn()
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(
                layer.SeqToANNContainer(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)),
                sn(),
            )

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.sn2(self.conv2(self.sn1(self.conv1(x))))
        return out + identity  # SEW ADD


class SEWResNet(nn.Module):
    def __init__(self, layers=(2, 2, 2, 2), widths=(32, 64, 128, 256), num_classes=11):
        super().__init__()
        self.stem = nn.Sequential(
            layer.SeqToANNContainer(nn.Conv2d(2, widths[0], 7, 2, 3, bias=False), nn.BatchNorm2d(widths[0])),
            sn(),
            layer.SeqToANNContainer(nn.MaxPool2d(3, 2, 1)),
        )
        blocks, c_in = [], widths[0]
        for i, (n, w) in enumerate(zip(layers, widths)):
            for j in range(n):
                blocks.append(BasicBlock(c_in, w, stride=2 if (j == 0 and i > 0) else 1))
                c_in = w
        self.blocks = nn.Sequential(*blocks)
        self.pool = layer.SeqToANNContainer(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = layer.SeqToANNContainer(nn.Linear(c_in, num_classes))

    def forward(self, x):  # [N, T, 2, 128, 128]
        x = x.transpose(0, 1).contiguous()
        return self.fc(self.pool(self.blocks(self.stem(x)))).mean(0)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", required=True)
    p.add_argument("--T", type=int, default=16)
    p.add_argument("--epochs", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=4, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="SGD lr for global batch 32")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--wd", type=float, default=0.0)
    p.add_argument("--amp", action="store_true")
    p.add_argument("--output-dir", default="./logs/sew_gesture")
    p.add_argument("--resume", default="")
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=45))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    kw = dict(data_type="frame", frames_number=args.T, split_by="number")
    if rank == 0:
        DVS128Gesture(args.data_dir, train=True, **kw)
        DVS128Gesture(args.data_dir, train=False, **kw)
    dist.barrier()
    train_set = DVS128Gesture(args.data_dir, train=True, **kw)
    test_set = DVS128Gesture(args.data_dir, train=False, **kw)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=args.batch_size,
                             num_workers=4, pin_memory=True)

    model = SEWResNet().to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 32
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, weight_decay=args.wd)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    start_epoch, max_acc = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        lr_scheduler.load_state_dict(ck["lr_scheduler"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, max_acc = ck["epoch"] + 1, ck["max_acc"]
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        meter = torch.zeros(3, device=device)
        for frame, label in train_loader:
            frame = frame.to(device, non_blocking=True).float()
            label = label.to(device, non_blocking=True)
            with torch.cuda.amp.autocast(enabled=args.amp):
                out = model(frame)
                loss = F.cross_entropy(out, label)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            functional.reset_net(model)
            meter += torch.stack([loss.detach().float() * label.numel(), (out.argmax(1) == label).sum().float(),
                                  torch.tensor(float(label.numel()), device=device)])
        lr_scheduler.step()
        dist.all_reduce(meter)

        net = model.module
        net.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for frame, label in test_loader:
                frame, label = frame.to(device).float(), label.to(device)
                with torch.cuda.amp.autocast(enabled=args.amp):
                    out = net(frame)
                functional.reset_net(net)
                hits += torch.stack([(out.argmax(1) == label).sum().float(),
                                     torch.tensor(float(label.numel()), device=device)])
        dist.all_reduce(hits)
        test_acc = (hits[0] / hits[1]).item()

        if rank == 0:
            saved_best = test_acc > max_acc
            max_acc = max(max_acc, test_acc)
            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                     "lr_scheduler": lr_scheduler.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "max_acc": max_acc}
            torch.save(state, os.path.join(args.output_dir, "checkpoint_latest.pth"))
            if saved_best:
                torch.save(state, os.path.join(args.output_dir, "checkpoint_max.pth"))
            print(f"epoch {epoch} loss {meter[0] / meter[2]:.4f} train_acc {meter[1] / meter[2]:.4f} "
                  f"test_acc {test_acc:.4f} max {max_acc:.4f} lr {lr_scheduler.get_last_lr()[0]:.4f} "
                  f"{time.time() - tic:.0f}s", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
