"""ir-CSN (pytorchvideo) on Kinetics-400 under Slurm, one task per GPU.

sbatch script (4 nodes x 8 GPUs; every task sees all 8 GPUs of its node):

    #SBATCH --nodes=4 --ntasks-per-node=8 --gres=gpu:8 --cpus-per-task=10
    export MASTER_PORT=29511
    srun python 19_csn_slurm.py --data /shared/k400 --out /shared/exp/csn50_$SLURM_JOB_ID

The same file also runs under torchrun (RANK/LOCAL_RANK/WORLD_SIZE already set).
"""
import argparse
import math
import os
import random
import subprocess

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from pytorchvideo.models.csn import create_csn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--depth", type=int, default=50)
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--rate", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=58)
    ap.add_argument("--warmup-epochs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.4, help="for a global batch of 256")
    ap.add_argument("--workers", type=int, default=9)
    ap.add_argument("--test-clips", type=int, default=10)
    ap.add_argument("--test-crops", type=int, default=3)
    return ap.parse_args()


def init_distributed():
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ["SLURM_LOCALID"]
        if "MASTER_ADDR" not in os.environ:
            hosts = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]])
            os.environ["MASTER_ADDR"] = hosts.decode().split()[0]
        os.environ.setdefault("MASTER_PORT", "29500")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    # with --gpus-per-task=1 each task only sees its own GPU, which is then device 0
    gpu = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world)
    return rank, world, gpu


MEAN = torch.tensor([0.45, 0.45, 0.45]).view(3, 1, 1, 1)
STD = torch.tensor([0.225, 0.225, 0.225]).view(3, 1, 1, 1)


class Kinetics(Dataset):
    def __init__(self, data, split, frames, rate, train, clips=1, crops=1):
        self.items = []
        with open(os.path.join(data, f"{split}.txt")) as f:
            for line in f:
                rel, label = line.rsplit(maxsplit=1)
                self.items.append((os.path.join(data, split, rel), int(label)))
        self.frames, self.rate, self.train, self.clips, self.crops = frames, rate, train, clips, crops

    def __len__(self):
        return len(self.items) * self.clips * self.crops

    def __getitem__(self, idx):
        vid, view = divmod(idx, self.clips * self.crops)
        clip, crop = divmod(view, self.crops)
        path, label = self.items[vid]
        vr = VideoReader(path, ctx=cpu(0), num_threads=1)
        n, span = len(vr), self.frames * self.rate
        s = random.randint(0, max(0, n - span)) if self.train else \
            int(max(0, n - span) * clip / max(1, self.clips - 1))
        x = torch.from_numpy(vr.get_batch(np.minimum(np.arange(s, s + span, self.rate), n - 1)).asnumpy())
        x = x.permute(0, 3, 1, 2).float() / 255
        h, w = x.shape[-2:]
        short = random.randint(256, 320) if self.train else 256
        x = F.interpolate(x, scale_factor=short / min(h, w), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            a, b = random.randint(0, h - 224), random.randint(0, w - 224)
        else:
            k = 1 if self.crops == 1 else crop
            a = (h - 224) * k // 2 if h > w else (h - 224) // 2
            b = (w - 224) * k // 2 if w >= h else (w - 224) // 2
        x = x[..., a:a + 224, b:b + 224]
        if self.train and random.random() < 0.5:
            x = x.flip(-1)
        return (x.transpose(0, 1) - MEAN) / STD, label, vid


def video_shard(num_videos, views, world, rank):
    """All views of a video go to the same rank."""
    vids = range(rank, num_videos, world)
    return [v * views + k for v in vids for k in range(views)]


@torch.no_grad()
def test(model, loader, num_videos, num_classes, device):
    model.eval()
    scores = torch.zeros(num_videos, num_classes, device=device)
    labels = torch.zeros(num_videos, dtype=torch.long, device=device)
    for x, y, v in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x.to(device, non_blocking=True))
        v = v.to(device)
        scores.index_add_(0, v, out.float().softmax(1))
        labels[v] = y.to(device)
    dist.all_reduce(scores)
    dist.all_reduce(labels)  # every video has exactly one owner, the others hold 0
    top5 = scores.topk(5, 1).indices
    return (top5[:, 0] == labels).float().mean().item() * 100, (top5 == labels[:, None]).any(1).float().mean().item() * 100


def main():
    args = parse_args()
    rank, world, gpu = init_distributed()
    device = torch.device("cuda", gpu)
    random.seed(rank)
    torch.manual_seed(rank)

    train_ds = Kinetics(args.data, "train", args.frames, args.rate, train=True)
    test_ds = Kinetics(args.data, "val", args.frames, args.rate, train=False,
                       clips=args.test_clips, crops=args.test_crops)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    views = args.test_clips * args.test_crops
    test_dl = DataLoader(torch.utils.data.Subset(test_ds, video_shard(len(test_ds.items), views, world, rank)),
                         batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    num_classes = 400
    model = create_csn(model_depth=args.depth, model_num_class=num_classes, dropout_rate=0.5,
                       head_pool_kernel_size=(args.frames // 8, 7, 7))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[gpu])

    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    iters = len(train_dl)
    warm, total = args.warmup_epochs * iters, args.epochs * iters

    ckpt_path = os.path.join(args.out, "checkpoint.pth")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{world} ranks, lr {lr:.4f}, {iters} iters/epoch, start epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        skipped = 0
        for it, (x, y, _) in enumerate(train_dl):
            step = epoch * iters + it
            cur = lr * (step + 1) / warm if step < warm else lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))
            for g in optimizer.param_groups:
                g["lr"] = cur
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            # all ranks agree on skipping, so nobody is left waiting in the gradient all-reduce
            finite = torch.isfinite(loss.detach()).float()
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
            if finite.item() == 0:
                skipped += 1
                continue
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} [{it}/{iters}] loss {loss.item():.4f} lr {cur:.4f} skipped {skipped}", flush=True)

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)

    top1, top5 = test(model.module, test_dl, len(test_ds.items), num_classes, device)
    if rank == 0:
        print(f"{args.test_clips}x{args.test_crops} view test: top1 {top1:.2f} top5 {top5:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
