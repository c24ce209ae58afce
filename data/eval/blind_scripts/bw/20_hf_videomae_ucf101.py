"""Fine-tune Hugging Face VideoMAE-base on UCF-101 with a plain PyTorch DDP loop.

    torchrun --nproc_per_node=4 20_hf_videomae_ucf101.py --model-dir /models/videomae-base-finetuned-kinetics \
        --ucf-root /data/UCF101 --output-dir /exp/videomae_ucf101
"""
import argparse
import math
import os
import random

import av
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter
from transformers import VideoMAEForVideoClassification

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--ucf-root", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--split", type=int, default=1)
    p.add_argument("--num-frames", type=int, default=16)
    p.add_argument("--sample-rate", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-5, help="AdamW lr for a global batch of 32")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def read_ucf_split(root, split):
    lists = os.path.join(root, "ucfTrainTestlist")
    with open(os.path.join(lists, "classInd.txt")) as f:
        classes = [line.split()[1] for line in f if line.strip()]
    cls_idx = {c: i for i, c in enumerate(classes)}

    def load(name):
        with open(os.path.join(lists, name)) as f:
            rels = [line.split()[0] for line in f if line.strip()]
        return [(os.path.join(root, "UCF-101", r), cls_idx[r.split("/")[0]]) for r in rels]

    return load(f"trainlist0{split}.txt"), load(f"testlist0{split}.txt"), classes


def read_frames(path, indices):
    wanted = set(int(i) for i in indices)
    frames = {}
    with av.open(path) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i in wanted:
                frames[i] = frame.to_ndarray(format="rgb24")
            if i >= max(wanted):
                break
    last = frames[max(frames)]
    return np.stack([frames.get(int(i), last) for i in indices])


def count_frames(path):
    with av.open(path) as container:
        n = container.streams.video[0].frames
        if n > 0:
            return n
        return sum(1 for _ in container.decode(video=0))


class UCFVideoMAE(Dataset):
    def __init__(self, samples, num_frames, rate, train, size=224):
        self.samples, self.num_frames, self.rate, self.train, self.size = samples, num_frames, rate, train, size

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        n = count_frames(path)
        span = self.num_frames * self.rate
        start = random.randint(0, max(0, n - span)) if self.train else max(0, n - span) // 2
        idx = np.clip(np.arange(start, start + span, self.rate), 0, n - 1)
        x = torch.from_numpy(read_frames(path, idx)).permute(0, 3, 1, 2).float() / 255.0
        h, w = x.shape[-2:]
        if self.train:
            s = random.uniform(0.7, 1.0)
            ch, cw = int(h * s), int(h * s)
            a, b = random.randint(0, h - ch), random.randint(0, w - cw)
            x = x[..., a:a + ch, b:b + cw]
            if random.random() < 0.5:
                x = x.flip(-1)
        else:
            b = (w - h) // 2
            x = x[..., :, b:b + h]
        x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        return (x - MEAN) / STD, label  # (T, C, H, W)


class RankShard(torch.utils.data.Sampler):
    def __init__(self, n, world, rank):
        self.ids = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(pixel_values=x).logits.float()
        stats[0] += F.cross_entropy(logits, y, reduction="sum")
        stats[1] += (logits.argmax(-1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (100 * stats[1] / stats[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    train_samples, test_samples, classes = read_ucf_split(args.ucf_root, args.split)
    train_ds = UCFVideoMAE(train_samples, args.num_frames, args.sample_rate, train=True)
    test_ds = UCFVideoMAE(test_samples, args.num_frames, args.sample_rate, train=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_ds, batch_size=args.batch_size, sampler=RankShard(len(test_ds), world, rank),
                             num_workers=args.workers, pin_memory=True)

    model = VideoMAEForVideoClassification.from_pretrained(
        args.model_dir,
        num_labels=len(classes),
        label2id={c: i for i, c in enumerate(classes)},
        id2label={i: c for i, c in enumerate(classes)},
        ignore_mismatched_sizes=True,
    ).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 32
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    steps_per_epoch = len(train_loader)
    warmup, total = args.warmup_epochs * steps_per_epoch, args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))

    writer = SummaryWriter(os.path.join(args.output_dir, "tb")) if rank == 0 else None
    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        running = torch.zeros(2, device=device)
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outputs = model(pixel_values=x, labels=y)
            loss = outputs.loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if writer is not None and step % 20 == 0:
                writer.add_scalar("train/loss", loss.item(), epoch * steps_per_epoch + step)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], epoch * steps_per_epoch + step)
        dist.all_reduce(running)

        val_loss, val_acc = evaluate(model.module, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: train loss {(running[0] / running[1]).item():.4f} "
                  f"val loss {val_loss:.4f} val acc {val_acc:.2f}", flush=True)
            writer.add_scalar("val/acc", val_acc, epoch)
            writer.add_scalar("val/loss", val_loss, epoch)
            if val_acc > best_acc:
                best_acc = val_acc
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
            model.module.save_pretrained(os.path.join(args.output_dir, "last"))

    if rank == 0:
        print(f"best clip accuracy {best_acc:.2f}")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
