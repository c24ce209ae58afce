"""ASL-DVS (24 hand-shape letters) with a spiking CNN, snnTorch neurons, DDP.

Usage:
    torchrun --nproc_per_node=4 12_asldvs_snn_ddp.py --data-root /data/tonic --frames 8
"""
import argparse
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, random_split
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

import snntorch as snn
from snntorch import surrogate
import tonic
import tonic.transforms as tt


def parse_args():
    parser = argparse.ArgumentParser(description="ASL-DVS SNN")
    parser.add_argument("--data-root", default="/data/tonic")
    parser.add_argument("--log-dir", default="runs/asldvs")
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=2023)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class ConvLIF(nn.Module):
    def __init__(self, cin, cout, beta, grad):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.lif = snn.Leaky(beta=beta, spike_grad=grad, learn_beta=True, learn_threshold=True)

    def forward(self, x, mem):
        return self.lif(self.bn(self.conv(x)), mem)


class ASLNet(nn.Module):
    def __init__(self, num_classes=24, beta=0.8):
        super().__init__()
        grad = surrogate.fast_sigmoid(slope=25)
        self.blocks = nn.ModuleList([ConvLIF(2, 32, beta, grad), ConvLIF(32, 64, beta, grad),
                                     ConvLIF(64, 128, beta, grad), ConvLIF(128, 256, beta, grad)])
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(256, num_classes)

    def forward(self, x):
        # x: [B, T, 2, H, W]
        mems = [blk.lif.init_leaky() for blk in self.blocks]
        logits = 0
        for t in range(x.size(1)):
            h = x[:, t]
            for i, blk in enumerate(self.blocks):
                h, mems[i] = blk(h, mems[i])
                h = self.pool(h)
            logits = logits + self.head(h.mean(dim=(2, 3)))
        return logits / x.size(1)


def frame_collate(batch):
    frames = torch.stack([torch.from_numpy(f).float() for f, _ in batch])
    frames = F.interpolate(frames.flatten(0, 1), size=(96, 128), mode="area").view(len(batch), -1, 2, 96, 128)
    return frames.clamp(max=10.0) / 10.0, torch.as_tensor([y for _, y in batch])


def main():
    args = parse_args()

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format=f"%(asctime)s [rank {rank}] %(message)s")
    log = logging.getLogger("asldvs")
    seed_all(args.seed)

    transform = tt.Compose([
        tt.Denoise(filter_time=5000),
        tt.ToFrame(sensor_size=tonic.datasets.ASLDVS.sensor_size, n_time_bins=args.frames),
    ])
    if rank == 0:
        tonic.datasets.ASLDVS(save_to=args.data_root)  # download + extract
    dist.barrier()
    full = tonic.datasets.ASLDVS(save_to=args.data_root, transform=transform)
    n_val = len(full) // 10
    train_set, val_set = random_split(full, [len(full) - n_val, n_val],
                                      generator=torch.Generator().manual_seed(args.seed))
    log.info("train %d, val %d, world size %d", len(train_set), len(val_set), world_size)

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=frame_collate, num_workers=args.num_workers, pin_memory=True,
                              drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            collate_fn=frame_collate, num_workers=args.num_workers, pin_memory=True)

    model = ASLNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank],
                                                output_device=args.local_rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)

    writer = SummaryWriter(args.log_dir) if rank == 0 else None
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        agg = torch.zeros(3, device=device)
        for frames, labels in train_loader:
            frames = frames.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            logits = model(frames)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            agg += torch.stack([loss.detach() * labels.numel(), (logits.argmax(1) == labels).sum().float(),
                                torch.tensor(float(labels.numel()), device=device)])
        scheduler.step()
        dist.all_reduce(agg)

        model.eval()
        vagg = torch.zeros(2, device=device)
        with torch.no_grad():
            for frames, labels in val_loader:
                frames, labels = frames.to(device), labels.to(device)
                vagg[0] += (model(frames).argmax(1) == labels).sum()
                vagg[1] += labels.numel()
        dist.all_reduce(vagg)
        val_acc = (vagg[0] / vagg[1]).item()

        if rank == 0:
            train_loss, train_acc = (agg[0] / agg[2]).item(), (agg[1] / agg[2]).item()
            log.info("epoch %d loss %.4f train acc %.4f val acc %.4f", epoch, train_loss, train_acc, val_acc)
            writer.add_scalars("acc", {"train": train_acc, "val": val_acc}, epoch)
            writer.add_scalar("loss/train", train_loss, epoch)
            if val_acc > best:
                best = val_acc
                torch.save(model.module.state_dict(), os.path.join(args.log_dir, "best.pt"))

    if rank == 0:
        writer.close()
        log.info("best val acc %.4f", best)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
