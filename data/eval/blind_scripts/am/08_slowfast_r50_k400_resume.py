"""SlowFast-R50 8x8 training on Kinetics-400 with automatic resume.

Preemptible cluster: the job is requeued with the same command and picks up from the
latest checkpoint in --output-dir.

    torchrun --nnodes=1 --nproc_per_node=8 08_slowfast_r50_k400_resume.py \
        --data /datasets/k400 --output-dir /checkpoint/$USER/slowfast_r50 --auto-resume
"""
import argparse
import glob
import math
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from pytorchvideo.data.encoded_video import EncodedVideo
from pytorchvideo.models.slowfast import create_slowfast
from pytorchvideo.transforms import Normalize, RandomShortSideScale, ShortSideScale
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.transforms import CenterCrop, Compose, RandomCrop

ALPHA = 4


class PackPathway(nn.Module):
    def forward(self, frames):
        slow = torch.index_select(frames, 1, torch.linspace(0, frames.shape[1] - 1,
                                                             frames.shape[1] // ALPHA).long())
        return [slow, frames]


class KineticsDataset(Dataset):
    def __init__(self, root, split, train, num_frames=32, sampling_rate=2):
        self.root, self.train = os.path.join(root, split), train
        with open(os.path.join(root, f"{split}.csv")) as f:
            self.samples = [(p, int(l)) for p, l in (r.strip().split(",") for r in f.readlines()[1:])]
        self.num_frames, self.rate = num_frames, sampling_rate
        self.clip_sec = num_frames * sampling_rate / 30.0
        spatial = [RandomShortSideScale(256, 320), RandomCrop(224)] if train else [ShortSideScale(256), CenterCrop(256)]
        self.transform = Compose([Normalize((0.45, 0.45, 0.45), (0.225, 0.225, 0.225)), *spatial])
        self.pack = PackPathway()

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        g = torch.Generator().manual_seed(idx * 7919 + int(time.time() * 1000) % 100000)
        for attempt in range(8):
            path, label = self.samples[idx]
            try:
                video = EncodedVideo.from_path(os.path.join(self.root, path), decode_audio=False)
                dur = float(video.duration)
                if self.train:
                    start = torch.rand(1, generator=g).item() * max(dur - self.clip_sec, 0.0)
                else:
                    start = max(dur - self.clip_sec, 0.0) / 2
                data = video.get_clip(start, start + self.clip_sec)["video"]  # C T H W, uint8 range
                video.close()
                if data is None or data.shape[1] == 0:
                    raise RuntimeError("empty clip")
                t = torch.linspace(0, data.shape[1] - 1, self.num_frames).long()
                frames = self.transform(data[:, t] / 255.0)
                return self.pack(frames), label
            except Exception:
                idx = torch.randint(len(self.samples), (1,), generator=g).item()
        raise RuntimeError("decode failed repeatedly")


def latest_checkpoint(out_dir):
    files = glob.glob(os.path.join(out_dir, "checkpoint_epoch_*.pyth"))
    if not files:
        return None
    return max(files, key=lambda f: int(re.search(r"epoch_(\d+)", f).group(1)))


def lr_policy(cur_epoch, cfg):
    if cur_epoch < cfg.warmup_epochs:
        alpha = cur_epoch / cfg.warmup_epochs
        return cfg.lr * (0.1 + 0.9 * alpha)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * cur_epoch / cfg.epochs))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--epochs", type=int, default=196)
    p.add_argument("--warmup-epochs", type=float, default=34)
    p.add_argument("--lr", type=float, default=0.8, help="for 64 clips; scaled linearly")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--auto-resume", action="store_true")
    p.add_argument("--ckpt-period", type=int, default=5)
    cfg = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg.lr = cfg.lr * cfg.batch_size * world / 64

    train_set = KineticsDataset(cfg.data, "train", train=True)
    val_set = KineticsDataset(cfg.data, "val", train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=cfg.batch_size, num_workers=cfg.workers, pin_memory=True)

    model = create_slowfast(model_num_class=400)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    criterion = nn.CrossEntropyLoss()

    start_epoch = 0
    ckpt_file = latest_checkpoint(cfg.output_dir) if cfg.auto_resume else None
    if ckpt_file:
        checkpoint = torch.load(ckpt_file)
        model.module.load_state_dict(checkpoint["model_state"])
        optimizer.load_state_dict(checkpoint["optimizer_state"])
        start_epoch = checkpoint["epoch"] + 1
        if rank == 0:
            print(f"Resumed from {ckpt_file} (epoch {checkpoint['epoch']})", flush=True)
        del checkpoint

    iters = len(train_loader)
    for epoch in range(start_epoch, cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (inputs, labels) in enumerate(train_loader):
            lr = lr_policy(epoch + it / iters, cfg)
            for g in optimizer.param_groups:
                g["lr"] = lr
            inputs = [x.cuda(non_blocking=True) for x in inputs]
            labels = labels.cuda(non_blocking=True)
            loss = criterion(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if it % 50 == 0:
                stat = loss.detach().clone()
                dist.all_reduce(stat, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {it}/{iters} loss {stat.item():.4f} lr {lr:.4f} "
                          f"{(time.time() - tic) / (it + 1):.2f}s/it", flush=True)

        model.eval()
        correct = torch.zeros(3, device="cuda")
        with torch.no_grad():
            for inputs, labels in val_loader:
                inputs = [x.cuda(non_blocking=True) for x in inputs]
                labels = labels.cuda(non_blocking=True)
                top5 = model.module(inputs).topk(5, 1).indices
                correct[0] += (top5[:, 0] == labels).sum()
                correct[1] += (top5 == labels[:, None]).any(1).sum()
                correct[2] += labels.numel()
        dist.all_reduce(correct)
        if rank == 0:
            print(f"epoch {epoch}: val top1 {100 * correct[0] / correct[2]:.2f} "
                  f"top5 {100 * correct[1] / correct[2]:.2f}", flush=True)

        if (epoch + 1) % cfg.ckpt_period == 0 or epoch + 1 == cfg.epochs:
            if rank == 0:
                os.makedirs(cfg.output_dir, exist_ok=True)
                path = os.path.join(cfg.output_dir, f"checkpoint_epoch_{epoch:05d}.pyth")
                torch.save({"epoch": epoch, "model_state": model.module.state_dict(),
                            "optimizer_state": optimizer.state_dict()}, path + ".tmp")
                os.replace(path + ".tmp", path)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
