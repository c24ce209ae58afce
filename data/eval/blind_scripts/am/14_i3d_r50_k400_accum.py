"""I3D-R50 (8x8) on Kinetics-400 with gradient accumulation and fp16.

    torchrun --nproc_per_node=8 14_i3d_r50_k400_accum.py --data-dir /data/kinetics400 \
        --batch-size 8 --accum-steps 2 --epochs 100
"""
import argparse
import logging
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from pytorchvideo.models.hub import i3d_r50
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger("i3d")


class Kinetics(Dataset):
    MEAN = np.array([0.45, 0.45, 0.45], dtype=np.float32)
    STD = np.array([0.225, 0.225, 0.225], dtype=np.float32)

    def __init__(self, data_dir, split, num_frames=8, rate=8, train=True):
        self.video_dir = os.path.join(data_dir, split)
        with open(os.path.join(data_dir, f"{split}_list.txt")) as f:
            self.samples = [(p, int(c)) for p, c in (line.split() for line in f)]
        self.num_frames, self.rate, self.train = num_frames, rate, train

    def __len__(self):
        return len(self.samples)

    def load(self, path):
        vr = VideoReader(path, ctx=cpu(0), num_threads=1)
        n, span = len(vr), self.num_frames * self.rate
        start = random.randint(0, max(n - span, 0)) if self.train else max(n - span, 0) // 2
        idx = np.clip(np.arange(start, start + span, self.rate), 0, n - 1)
        return vr.get_batch(idx).asnumpy()

    def transform(self, frames):
        x = torch.from_numpy(((frames / 255.0 - self.MEAN) / self.STD).astype(np.float32))
        x = x.permute(3, 0, 1, 2)                                         # C T H W
        h, w = x.shape[-2:]
        short = random.randint(256, 320) if self.train else 256
        x = F.interpolate(x, scale_factor=short / min(h, w), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        crop = 224
        if self.train:
            y0, x0 = random.randint(0, h - crop), random.randint(0, w - crop)
        else:
            y0, x0 = (h - crop) // 2, (w - crop) // 2
        x = x[:, :, y0:y0 + crop, x0:x0 + crop]
        if self.train and random.random() < 0.5:
            x = torch.flip(x, dims=[3])
        return x

    def __getitem__(self, i):
        for _ in range(10):
            path, label = self.samples[i]
            try:
                return self.transform(self.load(os.path.join(self.video_dir, path))), label
            except Exception as exc:
                log.warning("bad video %s: %s", path, exc)
                i = random.randrange(len(self.samples))
        raise RuntimeError("could not find a readable video")


def seed_worker(worker_id):
    s = torch.initial_seed() % 2 ** 32
    np.random.seed(s)
    random.seed(s)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    correct1 = correct5 = total = 0
    for clips, labels in loader:
        clips, labels = clips.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(clips)
        top5 = logits.topk(5, dim=1).indices
        correct1 += (top5[:, 0] == labels).sum().item()
        correct5 += (top5 == labels.unsqueeze(1)).any(dim=1).sum().item()
        total += labels.size(0)
    counts = torch.tensor([correct1, correct5, total], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return 100.0 * counts[0].item() / counts[2].item(), 100.0 * counts[1].item() / counts[2].item()


def main():
    parser = argparse.ArgumentParser(description="I3D-R50 Kinetics-400")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--output-dir", default="output/i3d_r50")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accum-steps", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--base-lr", type=float, default=0.1, help="for a global batch of 128")
    parser.add_argument("--warmup-epochs", type=int, default=5)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--resume", default="")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s [%(name)s] %(message)s")

    train_set = Kinetics(args.data_dir, "train", train=True)
    val_set = Kinetics(args.data_dir, "val", train=False)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True,
                              worker_init_fn=seed_worker)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size)),
                            batch_size=args.batch_size, num_workers=args.num_workers, pin_memory=True)

    model = i3d_r50(pretrained=False)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    global_batch = args.batch_size * args.accum_steps * world_size
    lr = args.base_lr * global_batch / 128
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    scaler = torch.cuda.amp.GradScaler()
    steps_per_epoch = len(train_loader) // args.accum_steps
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch

    def lr_at(step):
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        return 0.5 * lr * (1 + math.cos(math.pi * (step - warmup_steps) / (total_steps - warmup_steps)))

    start_epoch, best_top1 = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_top1 = ckpt["epoch"] + 1, ckpt["best_top1"]

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        log.info("global batch %d, lr %.4f, %d optimizer steps/epoch", global_batch, lr, steps_per_epoch)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        tic = time.time()
        for it, (clips, labels) in enumerate(train_loader):
            if it >= steps_per_epoch * args.accum_steps:
                break
            clips, labels = clips.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            sync = (it + 1) % args.accum_steps == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.cross_entropy(model(clips), labels) / args.accum_steps
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
            if sync:
                step = epoch * steps_per_epoch + it // args.accum_steps
                for g in optimizer.param_groups:
                    g["lr"] = lr_at(step)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                if (it // args.accum_steps) % 50 == 0:
                    avg = loss_sum.clone()
                    dist.all_reduce(avg)
                    if rank == 0:
                        log.info("epoch %d step %d/%d loss %.4f lr %.5f (%.1fs)", epoch, it // args.accum_steps,
                                 steps_per_epoch, avg.item() / world_size, optimizer.param_groups[0]["lr"],
                                 time.time() - tic)
                loss_sum.zero_()

        top1, top5 = validate(model.module, val_loader, device)
        if rank == 0:
            log.info("epoch %d: top1 %.2f top5 %.2f", epoch, top1, top5)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch, "best_top1": max(best_top1, top1)}
            torch.save(state, os.path.join(args.output_dir, "last.pth"))
            if top1 > best_top1:
                torch.save(state, os.path.join(args.output_dir, "best.pth"))
        best_top1 = max(best_top1, top1)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
