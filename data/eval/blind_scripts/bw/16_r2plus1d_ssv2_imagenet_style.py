"""R(2+1)D-18 on Something-Something V2, adapted from the pytorch/examples ImageNet script.

    torchrun --nproc_per_node=8 16_r2plus1d_ssv2_imagenet_style.py /data/ssv2 \
        --epochs 50 -b 16 --lr 0.02 --out-dir /exp/r2p1d_ssv2
"""
import argparse
import json
import os
import random
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import r2plus1d_18

parser = argparse.ArgumentParser(description="SSv2 training")
parser.add_argument("data", metavar="DIR")
parser.add_argument("--epochs", default=50, type=int)
parser.add_argument("-b", "--batch-size", default=16, type=int, help="per-GPU mini-batch size")
parser.add_argument("--lr", default=0.02, type=float, help="lr for a global batch of 128")
parser.add_argument("--momentum", default=0.9, type=float)
parser.add_argument("--wd", "--weight-decay", default=5e-4, type=float, dest="weight_decay")
parser.add_argument("-j", "--workers", default=8, type=int)
parser.add_argument("-p", "--print-freq", default=50, type=int)
parser.add_argument("--segments", default=16, type=int)
parser.add_argument("--resume", default="", type=str)
parser.add_argument("--out-dir", default="./checkpoints", type=str)

MEAN = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
STD = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)


class AverageMeter:
    def __init__(self, name, fmt=":f"):
        self.name, self.fmt = name, fmt
        self.reset()

    def reset(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self):
        return ("{name} {val" + self.fmt + "} ({avg" + self.fmt + "})").format(**self.__dict__)


class SomethingSomething(Dataset):
    def __init__(self, root, split, segments, train):
        with open(os.path.join(root, "labels", "labels.json")) as f:
            label_map = json.load(f)
        with open(os.path.join(root, "labels", f"{split}.json")) as f:
            entries = json.load(f)
        self.samples = [(os.path.join(root, "videos", e["id"] + ".webm"),
                         int(label_map[e["template"].replace("[", "").replace("]", "")])) for e in entries]
        self.segments, self.train = segments, train

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, target = self.samples[index]
        frames, _, _ = torchvision.io.read_video(path, pts_unit="sec", output_format="TCHW")
        n = frames.shape[0]
        seg = n / self.segments
        if self.train:
            ids = [int(seg * k + random.random() * seg) for k in range(self.segments)]
        else:
            ids = [int(seg * (k + 0.5)) for k in range(self.segments)]
        x = frames[torch.tensor(ids).clamp(max=n - 1)].float() / 255.0
        x = F.interpolate(x, size=(128, 171), mode="bilinear", align_corners=False)
        if self.train:
            i, j = random.randint(0, 16), random.randint(0, 59)
        else:
            i, j = 8, 29
        x = x[..., i:i + 112, j:j + 112].transpose(0, 1)  # no flipping for SSv2
        return (x - MEAN) / STD, target


class NoPadDistSampler(torch.utils.data.Sampler):
    def __init__(self, dataset, num_replicas, rank):
        self.indices = list(range(rank, len(dataset), num_replicas))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def accuracy(output, target, topk=(1,)):
    with torch.no_grad():
        maxk = max(topk)
        _, pred = output.topk(maxk, 1, True, True)
        correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
        return [correct[:k].reshape(-1).float().sum(0) for k in topk]


def train(loader, model, criterion, optimizer, scaler, epoch, device, rank, args):
    losses, batch_time = AverageMeter("Loss", ":.4f"), AverageMeter("Time", ":.3f")
    model.train()
    end = time.time()
    for i, (videos, target) in enumerate(loader):
        videos, target = videos.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            output = model(videos)
            loss = criterion(output, target)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.update(loss.item(), videos.size(0))
        batch_time.update(time.time() - end)
        end = time.time()
        if rank == 0 and i % args.print_freq == 0:
            print(f"Epoch [{epoch}][{i}/{len(loader)}]  {batch_time}  {losses}", flush=True)


def validate(loader, model, device):
    model.eval()
    totals = torch.zeros(3, device=device)
    with torch.no_grad():
        for videos, target in loader:
            videos, target = videos.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                output = model(videos)
            c1, c5 = accuracy(output, target, topk=(1, 5))
            totals += torch.stack([c1, c5, torch.tensor(float(target.size(0)), device=device)])
    dist.all_reduce(totals)
    return (100 * totals[0] / totals[2]).item(), (100 * totals[1] / totals[2]).item()


def save_checkpoint(state, is_best, out_dir, filename="checkpoint.pth.tar"):
    path = os.path.join(out_dir, filename)
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(out_dir, "model_best.pth.tar"))


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.out_dir, exist_ok=True)

    model = r2plus1d_18(num_classes=174)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    criterion = nn.CrossEntropyLoss().to(device)
    lr = args.lr * args.batch_size * world_size / 128
    optimizer = torch.optim.SGD(model.parameters(), lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[30, 40], gamma=0.1)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_acc1 = 0, 0.0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device)
        start_epoch, best_acc1 = checkpoint["epoch"], checkpoint["best_acc1"]
        model.module.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        if rank == 0:
            print(f"=> resumed '{args.resume}' (epoch {start_epoch})")

    train_dataset = SomethingSomething(args.data, "train", args.segments, train=True)
    val_dataset = SomethingSomething(args.data, "validation", args.segments, train=False)
    train_sampler = DistributedSampler(train_dataset)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_dataset, batch_size=args.batch_size, num_workers=args.workers,
                            sampler=NoPadDistSampler(val_dataset, world_size, rank), pin_memory=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, scaler, epoch, device, rank, args)
        scheduler.step()
        acc1, acc5 = validate(val_loader, model.module, device)
        if rank == 0:
            print(f" * epoch {epoch} Acc@1 {acc1:.3f} Acc@5 {acc5:.3f}", flush=True)

        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        save_checkpoint({
            "epoch": epoch + 1,
            "arch": "r2plus1d_18",
            "state_dict": model.module.state_dict(),
            "best_acc1": best_acc1,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        }, is_best, args.out_dir)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
