# SlowFast-R50 8x8 on Kinetics-400 (pytorchvideo model, our own decord loader).
#
# launch (same as the old cluster scripts):
#   python -m torch.distributed.launch --nproc_per_node=8 \
#       10_slowfast_launch_apex.py --data /data/k400 --out work_dirs/sf_r50
import argparse
import json
import os
import random
import time

import decord
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pytorchvideo.models.slowfast import create_slowfast
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

try:
    from apex.parallel import convert_syncbn_model
    HAS_APEX = True
except ImportError:
    HAS_APEX = False

ALPHA = 4  # slow/fast frame ratio


def parse_args():
    parser = argparse.ArgumentParser(description="SlowFast training")
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--out", type=str, default="work_dirs/sf_r50")
    parser.add_argument("--num_frames", type=int, default=32)
    parser.add_argument("--sample_rate", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=196)
    parser.add_argument("--base_lr", type=float, default=0.1, help="lr for 64 clips")
    parser.add_argument("--warmup_epochs", type=int, default=34)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


class KineticsDecord(Dataset):
    def __init__(self, root, split, num_frames, sample_rate, train=True):
        with open(os.path.join(root, f"{split}.json")) as f:
            self.items = json.load(f)  # [[relpath, label], ...]
        self.root = root
        self.num_frames, self.sample_rate, self.train = num_frames, sample_rate, train
        self.mean = torch.tensor([0.45, 0.45, 0.45]).view(3, 1, 1, 1)
        self.std = torch.tensor([0.225, 0.225, 0.225]).view(3, 1, 1, 1)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        rel, label = self.items[idx]
        try:
            vr = decord.VideoReader(os.path.join(self.root, rel), num_threads=1)
        except Exception:
            # a few k400 files are broken, fall back to a random other one
            return self[random.randrange(len(self))]
        n = len(vr)
        span = self.num_frames * self.sample_rate
        start = random.randint(0, max(n - span, 0)) if self.train else max(n - span, 0) // 2
        ind = np.clip(np.arange(start, start + span, self.sample_rate), 0, n - 1)
        frames = torch.from_numpy(vr.get_batch(ind).asnumpy()).permute(3, 0, 1, 2).float() / 255.0
        short = random.randint(256, 320) if self.train else 256
        c, t, h, w = frames.shape
        if h < w:
            nh, nw = short, int(w * short / h)
        else:
            nh, nw = int(h * short / w), short
        frames = F.interpolate(frames, size=(nh, nw), mode="bilinear", align_corners=False)
        if self.train:
            y0, x0 = random.randint(0, nh - 224), random.randint(0, nw - 224)
        else:
            y0, x0 = (nh - 224) // 2, (nw - 224) // 2
        frames = frames[:, :, y0:y0 + 224, x0:x0 + 224]
        if self.train and random.random() < 0.5:
            frames = frames.flip(-1)
        frames = (frames - self.mean) / self.std
        slow = frames[:, ::ALPHA]
        return [slow, frames], label


def lr_at(epoch_f, args, world):
    peak = args.base_lr * args.batch_size * world / 64
    if epoch_f < args.warmup_epochs:
        return 0.01 * peak + (peak - 0.01 * peak) * epoch_f / args.warmup_epochs
    return peak * 0.5 * (np.cos(np.pi * (epoch_f - args.warmup_epochs) / (args.epochs - args.warmup_epochs)) + 1)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)

    train_set = KineticsDecord(args.data, "train", args.num_frames, args.sample_rate, train=True)
    val_set = KineticsDecord(args.data, "val", args.num_frames, args.sample_rate, train=False)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = create_slowfast(model_num_class=400)
    if HAS_APEX:
        model = convert_syncbn_model(model)
    else:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)

    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9, weight_decay=1e-4, nesterov=True)
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}, {len(train_set)} train clips, apex syncbn: {HAS_APEX}", flush=True)

    iters = len(train_loader)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for i, (inputs, labels) in enumerate(train_loader):
            lr = lr_at(epoch + i / iters, args, world)
            for g in opt.param_groups:
                g["lr"] = lr
            inputs = [x.to(device, non_blocking=True) for x in inputs]
            labels = labels.to(device, non_blocking=True)
            with torch.cuda.amp.autocast(enabled=args.amp):
                loss = F.cross_entropy(model(inputs), labels)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if rank == 0 and i % 20 == 0:
                print(f"[{epoch}][{i}/{iters}] loss {loss.item():.4f} lr {lr:.4f} "
                      f"{(time.time() - tic) / (i + 1):.2f}s/it", flush=True)

        if epoch % 5 == 4 or epoch == args.epochs - 1:
            net = model.module
            net.eval()
            correct = torch.zeros(2, device=device)
            with torch.no_grad():
                for inputs, labels in val_loader:
                    inputs = [x.to(device, non_blocking=True) for x in inputs]
                    labels = labels.to(device, non_blocking=True)
                    with torch.cuda.amp.autocast(enabled=args.amp):
                        pred = net(inputs).argmax(1)
                    correct += torch.stack([(pred == labels).sum().float(),
                                            torch.tensor(float(labels.numel()), device=device)])
            dist.all_reduce(correct)
            if rank == 0:
                print(f"epoch {epoch} val top1 {100 * correct[0] / correct[1]:.2f}", flush=True)
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "opt": opt.state_dict()},
                           os.path.join(args.out, f"epoch_{epoch}.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
