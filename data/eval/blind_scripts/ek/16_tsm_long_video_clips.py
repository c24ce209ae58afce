"""TSM-R50 on our long-form kitchen/assembly recordings.

Each long video is cut into fixed-length windows (``--window-sec`` seconds, stride ``--stride-sec``);
every window carries the label of the activity annotated for that time span.

    torchrun --nproc_per_node=8 16_tsm_long_video_clips.py --root /mnt/lab/longvid --out /mnt/lab/exp/tsm_long
"""
import argparse
import json
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--segments", type=int, default=8)
    p.add_argument("--window-sec", type=float, default=4.0)
    p.add_argument("--stride-sec", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.01, help="for 64 clips")
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


def shift(x, n_segment, fold_div=8):
    nt, c, h, w = x.shape
    x = x.view(nt // n_segment, n_segment, c, h, w)
    fold = c // fold_div
    out = torch.zeros_like(x)
    out[:, :-1, :fold] = x[:, 1:, :fold]
    out[:, 1:, fold:2 * fold] = x[:, :-1, fold:2 * fold]
    out[:, :, 2 * fold:] = x[:, :, 2 * fold:]
    return out.view(nt, c, h, w)


class ShiftedConv(nn.Module):
    def __init__(self, conv, n_segment):
        super().__init__()
        self.conv, self.n_segment = conv, n_segment

    def forward(self, x):
        return self.conv(shift(x, self.n_segment))


class TSM(nn.Module):
    def __init__(self, num_classes, segments):
        super().__init__()
        self.segments = segments
        self.backbone = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        for stage in [self.backbone.layer1, self.backbone.layer2, self.backbone.layer3, self.backbone.layer4]:
            for blk in stage:
                blk.conv1 = ShiftedConv(blk.conv1, segments)
        self.backbone.fc = nn.Sequential(nn.Dropout(0.5), nn.Linear(2048, num_classes))

    def forward(self, x):
        b = x.shape[0]
        return self.backbone(x.flatten(0, 1)).view(b, self.segments, -1).mean(1)


class LongVideoWindows(Dataset):
    def __init__(self, root, split, segments, window_sec, stride_sec, train):
        self.root, self.segments, self.train = root, segments, train
        with open(os.path.join(root, f"{split}.json")) as f:
            anno = json.load(f)  # {video: [{"start": s, "end": e, "label": k}, ...]}
        meta_file = os.path.join(root, f"{split}_meta.pkl")
        if os.path.exists(meta_file):
            with open(meta_file, "rb") as f:
                meta = pickle.load(f)
        else:
            meta = {}
            for vid in anno:
                vr = VideoReader(os.path.join(root, "videos", vid), ctx=cpu(0))
                meta[vid] = (len(vr), float(vr.get_avg_fps()))
            with open(meta_file, "wb") as f:
                pickle.dump(meta, f)
        self.windows = []
        for vid, segs in anno.items():
            n, fps = meta[vid]
            win, stride = int(window_sec * fps), int(stride_sec * fps)
            for s in segs:
                a, b = int(s["start"] * fps), min(int(s["end"] * fps), n)
                for st in range(a, max(a + 1, b - win + 1), stride):
                    self.windows.append((vid, st, min(st + win, b), s["label"]))

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        vid, a, b, label = self.windows[i]
        vr = VideoReader(os.path.join(self.root, "videos", vid), ctx=cpu(0), num_threads=1, width=341, height=256)
        seg = max(b - a, 1) / self.segments
        off = np.random.rand(self.segments) * seg if self.train else np.full(self.segments, seg / 2)
        idx = np.minimum(a + (np.arange(self.segments) * seg + off).astype(int), len(vr) - 1)
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(0, 3, 1, 2).float() / 255
        if self.train:
            t, l = np.random.randint(0, 33), np.random.randint(0, 118)
            x = x[..., t:t + 224, l:l + 224]
            if np.random.rand() < 0.5:
                x = x.flip(-1)
        else:
            x = x[..., 16:240, 58:282]
        x = (x - x.new_tensor([0.485, 0.456, 0.406])[:, None, None]) / x.new_tensor([0.229, 0.224, 0.225])[:, None, None]
        return x, label


@torch.no_grad()
def evaluate(model, loader, device, num_classes):
    model.eval()
    confusion = torch.zeros(num_classes, num_classes, device=device)
    top5_hits = torch.zeros(1, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        top5 = out.topk(5, 1).indices
        top5_hits += (top5 == y[:, None]).any(1).sum()
        confusion.index_put_((y, top5[:, 0]), torch.ones_like(y, dtype=confusion.dtype), accumulate=True)
    dist.all_reduce(confusion)
    dist.all_reduce(top5_hits)
    n = confusion.sum()
    top1 = confusion.diag().sum() / n * 100
    per_class = confusion.diag() / confusion.sum(1).clamp(min=1)
    return top1.item(), (top5_hits / n * 100).item(), per_class.mean().item() * 100


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    with open(os.path.join(args.root, "classes.txt")) as f:
        num_classes = sum(1 for l in f if l.strip())

    train_set = LongVideoWindows(args.root, "train", args.segments, args.window_sec, args.stride_sec, True)
    val_set = LongVideoWindows(args.root, "val", args.segments, args.window_sec, args.window_sec, False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = TSM(num_classes, args.segments)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 64
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=args.epochs * len(train_loader),
                                                    pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    if rank == 0:
        print(f"{len(train_set)} train windows, {len(val_set)} val windows, {num_classes} classes")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and it % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), epoch * len(train_loader) + it)
        top1, top5, mca = evaluate(model.module, val_loader, device, num_classes)
        if rank == 0:
            writer.add_scalars("val", {"top1": top1, "top5": top5, "mean_class_acc": mca}, epoch)
            print(f"epoch {epoch} ({time.time() - t0:.0f}s): top1 {top1:.2f} top5 {top5:.2f} mca {mca:.2f}", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, os.path.join(args.out, "last.pth"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
