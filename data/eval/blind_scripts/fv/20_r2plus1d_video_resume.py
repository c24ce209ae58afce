"""Action recognition with R(2+1)D-18 on Kinetics-style clips (pre-decoded .npy).

Based on the old torchvision video reference that was started with
`python -m torch.distributed.launch --use_env`; now torchrun. Long runs are
pre-empted regularly, so training resumes from --resume.
"""
import argparse
import datetime
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import r2plus1d_18, R2Plus1D_18_Weights


def get_args_parser():
    parser = argparse.ArgumentParser(description="Video classification training")
    parser.add_argument("--data-path", default="/datasets/kinetics400_npy")
    parser.add_argument("--clip-len", default=16, type=int)
    parser.add_argument("--batch-size", default=24, type=int)
    parser.add_argument("--epochs", default=45, type=int)
    parser.add_argument("--lr", default=0.64, type=float, help="lr for the whole job (64 GPUs x 8 clips)")
    parser.add_argument("--ref-batch", default=512, type=int)
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--weight-decay", default=1e-4, type=float)
    parser.add_argument("--lr-milestones", nargs="+", default=[20, 30, 40], type=int)
    parser.add_argument("--lr-warmup-epochs", default=10, type=int)
    parser.add_argument("--workers", default=10, type=int)
    parser.add_argument("--output-dir", default="./video_out")
    parser.add_argument("--resume", default="")
    parser.add_argument("--amp", action="store_true")
    return parser


class NpyClips(Dataset):
    MEAN = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
    STD = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)

    def __init__(self, root, split, clip_len, train):
        self.root = os.path.join(root, split)
        self.classes = sorted(os.listdir(self.root))
        self.items = [(os.path.join(self.root, c, f), i) for i, c in enumerate(self.classes)
                      for f in sorted(os.listdir(os.path.join(self.root, c)))]
        self.clip_len, self.train = clip_len, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        path, label = self.items[idx]
        frames = np.load(path, mmap_mode="r")                         # T,H,W,C uint8 at 128x171
        t = frames.shape[0]
        start = np.random.randint(0, max(1, t - self.clip_len + 1)) if self.train else max(0, (t - self.clip_len) // 2)
        clip = torch.from_numpy(np.array(frames[start:start + self.clip_len]))
        if clip.shape[0] < self.clip_len:
            clip = torch.cat([clip, clip[-1:].expand(self.clip_len - clip.shape[0], -1, -1, -1)])
        clip = clip.permute(3, 0, 1, 2).float() / 255.0                # C,T,H,W
        h, w = clip.shape[-2:]
        if self.train:
            y, x = np.random.randint(0, h - 112 + 1), np.random.randint(0, w - 112 + 1)
            clip = clip[..., y:y + 112, x:x + 112]
            if np.random.rand() < 0.5:
                clip = clip.flip(-1)
        else:
            y, x = (h - 112) // 2, (w - 112) // 2
            clip = clip[..., y:y + 112, x:x + 112]
        return (clip - self.MEAN) / self.STD, label


def train_one_epoch(model, criterion, optimizer, lr_scheduler, loader, device, epoch, scaler, rank):
    model.train()
    t0 = time.time()
    for i, (video, target) in enumerate(loader):
        video, target = video.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", enabled=scaler is not None):
            output = model(video)
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        lr_scheduler.step()
        if rank == 0 and i % 50 == 0:
            print(f"Epoch [{epoch}] [{i}/{len(loader)}] loss {loss.item():.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.4f} {time.time() - t0:.0f}s")


@torch.no_grad()
def evaluate(model, criterion, loader, device):
    model.eval()
    sums = torch.zeros(4, device=device)
    for video, target in loader:
        video, target = video.to(device, non_blocking=True), target.to(device, non_blocking=True)
        output = model(video)
        top5 = output.topk(5, 1).indices
        sums += torch.stack([criterion(output, target) * target.size(0),
                             (top5[:, 0] == target).sum().float(),
                             (top5 == target[:, None]).any(1).sum().float(),
                             torch.tensor(float(target.size(0)), device=device)])
    dist.all_reduce(sums)
    return (sums[0] / sums[3]).item(), (100 * sums[1] / sums[3]).item(), (100 * sums[2] / sums[3]).item()


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", timeout=datetime.timedelta(minutes=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_set = NpyClips(args.data_path, "train", args.clip_len, train=True)
    val_set = NpyClips(args.data_path, "val", args.clip_len, train=False)
    train_sampler = DistributedSampler(train_set)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    model = r2plus1d_18(weights=R2Plus1D_18_Weights.KINETICS400_V1 if len(train_set.classes) == 400 else None,
                        num_classes=len(train_set.classes))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)

    lr = args.lr * args.batch_size * world_size / args.ref_batch
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler() if args.amp else None

    iters_per_epoch = len(train_loader)
    warmup_iters = iters_per_epoch * args.lr_warmup_epochs
    main_sched = torch.optim.lr_scheduler.MultiStepLR(
        optimizer, milestones=[iters_per_epoch * (m - args.lr_warmup_epochs) for m in args.lr_milestones], gamma=0.1)
    warmup_sched = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.001, total_iters=warmup_iters)
    lr_scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup_sched, main_sched], milestones=[warmup_iters])

    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
        if scaler is not None and "scaler" in checkpoint:
            scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"] + 1

    model = DDP(model, device_ids=[local_rank])

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train_one_epoch(model, criterion, optimizer, lr_scheduler, train_loader, device, epoch, scaler, rank)
        val_loss, acc1, acc5 = evaluate(model, criterion, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val loss {val_loss:.4f} clip acc@1 {acc1:.2f} acc@5 {acc5:.2f}")
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch}
            if scaler is not None:
                ckpt["scaler"] = scaler.state_dict()
            torch.save(ckpt, os.path.join(args.output_dir, f"model_{epoch}.pth"))
            torch.save(ckpt, os.path.join(args.output_dir, "checkpoint.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args_parser().parse_args())
