"""TimeSformer (divided space-time attention) on Kinetics-400 with repeated augmentation.

Every video is sampled `num_repeats` times per epoch with different temporal offsets and
crops; the repeats are spread over different GPUs (DeiT-style RASampler).

  torchrun --nnodes=1 --nproc_per_node=8 05_timesformer_repeated_aug.py \
      --train-csv k400/train.csv --val-csv k400/val.csv --pretrained vit_base_in21k.pth
"""
import argparse
import math
import os
import time

import av
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timesformer.models.vit import TimeSformer
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.tensorboard import SummaryWriter


class RASampler(Sampler):
    """Repeated-augmentation sampler restricted to this rank's share of the data."""

    def __init__(self, dataset, num_replicas, rank, num_repeats=3, shuffle=True, seed=0):
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.num_repeats, self.shuffle, self.seed = num_repeats, shuffle, seed
        self.epoch = 0
        self.num_samples = int(math.ceil(len(dataset) * num_repeats / num_replicas))
        self.total_size = self.num_samples * num_replicas
        # one epoch still sees ~len(dataset) clips in total across ranks
        self.num_selected = int(math.floor(len(dataset) // 256 * 256 / num_replicas))

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        if self.shuffle:
            indices = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            indices = list(range(len(self.dataset)))
        indices = [i for i in indices for _ in range(self.num_repeats)]
        indices += indices[: self.total_size - len(indices)]
        indices = indices[self.rank:self.total_size:self.num_replicas]
        return iter(indices[: self.num_selected])

    def __len__(self):
        return self.num_selected

    def set_epoch(self, epoch):
        self.epoch = epoch


class PyAVClips(Dataset):
    def __init__(self, csv_path, root, num_frames=8, rate=32, size=224, train=True):
        self.root, self.num_frames, self.rate, self.size, self.train = root, num_frames, rate, size, train
        self.rows = []
        with open(csv_path) as f:
            for line in f:
                path, label = line.strip().split(" ")
                self.rows.append((path, int(label)))
        self.mean = torch.tensor([0.45, 0.45, 0.45]).view(3, 1, 1, 1)
        self.std = torch.tensor([0.225, 0.225, 0.225]).view(3, 1, 1, 1)

    def __len__(self):
        return len(self.rows)

    def _read(self, path):
        with av.open(path) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        if not frames:
            raise ValueError("no frames")
        return np.stack(frames)

    def _clip(self, frames):
        n = len(frames)
        span = (self.num_frames - 1) * self.rate + 1
        if self.train:
            start = np.random.randint(0, max(n - span, 0) + 1)
        else:
            start = max(n - span, 0) // 2
        idx = np.clip(start + np.arange(self.num_frames) * self.rate, 0, n - 1)
        x = torch.from_numpy(frames[idx]).permute(3, 0, 1, 2).float() / 255.0
        h, w = x.shape[-2:]
        short = np.random.randint(256, 321) if self.train else 224
        scale = short / min(h, w)
        x = F.interpolate(x, size=(int(h * scale), int(w * scale)), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            y0, x0 = np.random.randint(0, h - self.size + 1), np.random.randint(0, w - self.size + 1)
        else:
            y0, x0 = (h - self.size) // 2, (w - self.size) // 2
        x = x[:, :, y0:y0 + self.size, x0:x0 + self.size]
        if self.train and np.random.rand() < 0.5:
            x = x.flip(-1)
        return (x - self.mean) / self.std

    def __getitem__(self, i):
        path, label = self.rows[i]
        for _ in range(5):
            try:
                return self._clip(self._read(os.path.join(self.root, path))), label
            except (av.AVError, ValueError, IndexError):
                i = np.random.randint(len(self.rows))
                path, label = self.rows[i]
        raise RuntimeError(f"could not decode a replacement for {self.rows[i][0]}")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-csv", required=True)
    p.add_argument("--val-csv", required=True)
    p.add_argument("--root", default="/datasets/kinetics400/videos")
    p.add_argument("--pretrained", default="")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="runs/timesformer_k400")
    return p.parse_args()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0

    train_ds = PyAVClips(args.train_csv, args.root, train=True)
    val_ds = PyAVClips(args.val_csv, args.root, train=False)
    sampler = RASampler(train_ds, world, rank, num_repeats=args.num_repeats, seed=1234)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_ds), world))
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=args.batch_size,
                            num_workers=args.workers, pin_memory=True)

    model = TimeSformer(img_size=224, num_classes=400, num_frames=8, attention_type="divided_space_time",
                        pretrained_model=args.pretrained).cuda()
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[11, 14], gamma=0.1)
    scaler = torch.cuda.amp.GradScaler()
    writer = SummaryWriter(args.out) if is_main else None

    ckpt_file = os.path.join(args.out, "last.pyth")
    start_epoch = 0
    if os.path.exists(ckpt_file):
        state = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(state["model_state"])
        optimizer.load_state_dict(state["optimizer_state"])
        scheduler.load_state_dict(state["scheduler_state"])
        scaler.load_state_dict(state["scaler_state"])
        start_epoch = state["epoch"] + 1

    global_step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        model.train()
        tic = time.time()
        for i, (clips, labels) in enumerate(train_loader):
            clips, labels = clips.cuda(non_blocking=True), labels.cuda(non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = F.cross_entropy(model(clips), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            global_step += 1
            if i % 20 == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg)
                avg /= world
                if is_main:
                    writer.add_scalar("train/loss", avg.item(), global_step)
                    writer.add_scalar("train/lr", optimizer.param_groups[0]["lr"], global_step)
                    print(f"[{epoch}][{i}/{len(train_loader)}] loss={avg.item():.4f} "
                          f"{(time.time() - tic) / (i + 1):.2f}s/it", flush=True)
        scheduler.step()

        model.eval()
        hits = torch.zeros(3, device="cuda")
        with torch.no_grad():
            for clips, labels in val_loader:
                clips, labels = clips.cuda(non_blocking=True), labels.cuda(non_blocking=True)
                with torch.cuda.amp.autocast():
                    logits = model.module(clips)
                top5 = logits.topk(5, 1).indices
                hits[0] += (top5[:, 0] == labels).sum()
                hits[1] += (top5 == labels[:, None]).any(1).sum()
                hits[2] += labels.numel()
        dist.all_reduce(hits)
        top1, top5 = (100 * hits[:2] / hits[2]).tolist()
        if is_main:
            writer.add_scalar("val/top1", top1, epoch)
            writer.add_scalar("val/top5", top5, epoch)
            print(f"epoch {epoch}: top1 {top1:.2f} top5 {top5:.2f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"epoch": epoch, "model_state": model.module.state_dict(),
                        "optimizer_state": optimizer.state_dict(), "scheduler_state": scheduler.state_dict(),
                        "scaler_state": scaler.state_dict()}, ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
        dist.barrier()

    if is_main:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
