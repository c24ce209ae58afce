"""DVS128 Gesture classification with a PLIF spiking CNN (SpikingJelly, multi-step mode).

Launch:
    torchrun --standalone --nproc_per_node=8 02_dvsgesture_plif_ddp.py --data-dir /datasets/DVS128Gesture -T 16
"""
import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda import amp
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from spikingjelly.activation_based import functional, layer, neuron, surrogate
from spikingjelly.datasets.dvs128_gesture import DVS128Gesture


def get_args():
    parser = argparse.ArgumentParser(description="PLIF-Net on DVS128 Gesture")
    parser.add_argument("-T", type=int, default=16, help="number of frames / simulation steps")
    parser.add_argument("--data-dir", type=str, required=True)
    parser.add_argument("--out-dir", type=str, default="./logs")
    parser.add_argument("-b", "--batch-size", type=int, default=16, help="per-process batch size")
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--channels", type=int, default=128)
    parser.add_argument("-j", "--workers", type=int, default=4)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--cupy", action="store_true", help="use the cupy backend for the neurons")
    parser.add_argument("--resume", type=str, default="")
    return parser.parse_args()


class PLIFNet(nn.Module):
    def __init__(self, channels=128, num_classes=11, use_cupy=False):
        super().__init__()
        conv = []
        for i in range(5):
            conv.append(layer.SeqToANNContainer(
                nn.Conv2d(2 if i == 0 else channels, channels, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(channels),
            ))
            conv.append(neuron.ParametricLIFNode(init_tau=2.0, surrogate_function=surrogate.ATan(), detach_reset=True))
            conv.append(layer.MaxPool2d(2, 2))
        self.conv_fc = nn.Sequential(
            *conv,
            layer.Flatten(),
            layer.Dropout(0.5),
            layer.Linear(channels * 4 * 4, 512),
            neuron.ParametricLIFNode(init_tau=2.0, surrogate_function=surrogate.ATan(), detach_reset=True),
            layer.Dropout(0.5),
            layer.Linear(512, num_classes * 10),
            neuron.ParametricLIFNode(init_tau=2.0, surrogate_function=surrogate.ATan(), detach_reset=True),
            layer.VotingLayer(10),
        )
        functional.set_step_mode(self, step_mode="m")
        if use_cupy:
            functional.set_backend(self, backend="cupy", instance=neuron.ParametricLIFNode)

    def forward(self, x):
        # x: [T, N, 2, 128, 128] -> firing rate of the voting layer [N, num_classes]
        return self.conv_fc(x).mean(0)


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=30))
    return dist.get_rank(), dist.get_world_size(), local_rank


def reduce_sum(t):
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def main():
    args = get_args()
    rank, world_size, local_rank = setup()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    # frames are integrated once and stored next to the raw data; let rank 0 do it first
    if is_main:
        DVS128Gesture(root=args.data_dir, train=True, data_type="frame", frames_number=args.T, split_by="number")
        DVS128Gesture(root=args.data_dir, train=False, data_type="frame", frames_number=args.T, split_by="number")
    dist.barrier()
    train_set = DVS128Gesture(root=args.data_dir, train=True, data_type="frame", frames_number=args.T, split_by="number")
    test_set = DVS128Gesture(root=args.data_dir, train=False, data_type="frame", frames_number=args.T, split_by="number")

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    test_sampler = DistributedSampler(test_set, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, sampler=test_sampler,
                             num_workers=args.workers, pin_memory=True, drop_last=False)

    net = PLIFNet(channels=args.channels, use_cupy=args.cupy)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    net = nn.parallel.DistributedDataParallel(net, device_ids=[local_rank])

    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    scaler = amp.GradScaler() if args.amp else None

    start_epoch, max_test_acc = 0, -1.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        net.module.load_state_dict(ckpt["net"])
        optimizer.load_state_dict(ckpt["optimizer"])
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        start_epoch = ckpt["epoch"] + 1
        max_test_acc = ckpt["max_test_acc"]

    out_dir = os.path.join(args.out_dir, f"T{args.T}_b{args.batch_size}x{world_size}_lr{args.lr}_c{args.channels}")
    if is_main:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    n_test = len(test_set)
    for epoch in range(start_epoch, args.epochs):
        start_time = time.time()
        net.train()
        train_stats = torch.zeros(3, device=device)  # loss sum, correct, samples
        for frame, label in train_loader:
            optimizer.zero_grad()
            frame = frame.to(device, non_blocking=True).float().transpose(0, 1)  # [N,T,C,H,W] -> [T,N,C,H,W]
            label = label.to(device, non_blocking=True)
            label_onehot = F.one_hot(label, 11).float()

            if scaler is not None:
                with amp.autocast():
                    out_fr = net(frame)
                    loss = F.mse_loss(out_fr, label_onehot)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                out_fr = net(frame)
                loss = F.mse_loss(out_fr, label_onehot)
                loss.backward()
                optimizer.step()

            train_stats[0] += loss.detach() * label.numel()
            train_stats[1] += (out_fr.argmax(1) == label).float().sum()
            train_stats[2] += label.numel()
            functional.reset_net(net)
        lr_scheduler.step()
        train_stats = reduce_sum(train_stats)

        net.eval()
        preds, labels = [], []
        with torch.no_grad():
            for frame, label in test_loader:
                frame = frame.to(device, non_blocking=True).float().transpose(0, 1)
                out_fr = net.module(frame)
                preds.append(out_fr.argmax(1))
                labels.append(label.to(device))
                functional.reset_net(net)
        preds, labels = torch.cat(preds), torch.cat(labels)
        # DistributedSampler pads the test set; gather and drop the duplicates
        all_preds = [torch.empty_like(preds) for _ in range(world_size)]
        all_labels = [torch.empty_like(labels) for _ in range(world_size)]
        dist.all_gather(all_preds, preds)
        dist.all_gather(all_labels, labels)
        # sampler hands out indices rank::world_size, so interleave to restore dataset order
        all_preds = torch.stack(all_preds, dim=1).flatten()[:n_test]
        all_labels = torch.stack(all_labels, dim=1).flatten()[:n_test]
        test_acc = (all_preds == all_labels).float().mean().item()

        if is_main:
            train_loss = (train_stats[0] / train_stats[2]).item()
            train_acc = (train_stats[1] / train_stats[2]).item()
            save_max = test_acc > max_test_acc
            max_test_acc = max(max_test_acc, test_acc)
            checkpoint = {
                "net": net.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": lr_scheduler.state_dict(),
                "epoch": epoch,
                "max_test_acc": max_test_acc,
            }
            torch.save(checkpoint, os.path.join(out_dir, "checkpoint_latest.pth"))
            if save_max:
                torch.save(checkpoint, os.path.join(out_dir, "checkpoint_max.pth"))
            print(f"epoch {epoch}: train_loss={train_loss:.4f} train_acc={train_acc:.4f} "
                  f"test_acc={test_acc:.4f} max_test_acc={max_test_acc:.4f} "
                  f"time={time.time() - start_time:.1f}s", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
