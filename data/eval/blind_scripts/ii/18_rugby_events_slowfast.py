"""Rugby-union event recognition (scrum, lineout, ruck, maul, tackle, kick,
try, conversion, open play) from broadcast clips with SlowFast-R50.

Clips are 64 frames at 30 fps (~2.1 s) around each annotated event centre,
plus randomly placed open-play clips. High resolution (288 px short side) is
needed to see the ball in wide shots, which limits the batch to 4 clips per
80 GB GPU.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        18_rugby_events_slowfast.py --ann /shared/rugby/events.json --video-root /shared/rugby/clips
"""
import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pytorchvideo.data.encoded_video import EncodedVideo
from pytorchvideo.models.hub import slowfast_r50
from pytorchvideo.transforms import Normalize, RandomShortSideScale, ShortSideScale
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import CenterCrop, Compose, RandomCrop

EVENTS = ["open_play", "scrum", "lineout", "ruck", "maul", "tackle", "kick", "try", "conversion"]
ALPHA = 4  # slow pathway stride


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ann", type=Path, required=True)
    ap.add_argument("--video-root", type=Path, required=True)
    ap.add_argument("--clips-per-gpu", type=int, default=4)
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--crop", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=36)
    ap.add_argument("--base-lr", type=float, default=0.1, help="SGD lr per 64 clips")
    ap.add_argument("--warmup-epochs", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=Path("/shared/rugby/runs/slowfast_r50"))
    return ap.parse_args()


class RugbyClips(Dataset):
    def __init__(self, items, root, frames, crop, train):
        self.items, self.root, self.frames, self.train = items, root, frames, train
        norm = Normalize((0.45, 0.45, 0.45), (0.225, 0.225, 0.225))
        self.tf = Compose([RandomShortSideScale(256, 320), RandomCrop(crop), norm]) if train else \
            Compose([ShortSideScale(288), CenterCrop(crop), norm])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        video = EncodedVideo.from_path(str(self.root / it["file"]), decode_audio=False)
        dur = float(video.duration)
        centre = it.get("t", dur / 2)
        span = 64 / 30.0
        if self.train:
            centre += random.uniform(-0.3, 0.3)
        start = min(max(0.0, centre - span / 2), max(0.0, dur - span))
        clip = video.get_clip(start, start + span)["video"]          # C T H W, uint8
        idx = torch.linspace(0, clip.shape[1] - 1, self.frames).long()
        x = clip[:, idx].float() / 255.0
        if self.train and random.random() < 0.5:
            x = x.flip(-1)
        x = self.tf(x)
        slow = x[:, ::ALPHA]
        return [slow, x], EVENTS.index(it["label"])


def build_model():
    model = slowfast_r50(pretrained=True)
    head = model.blocks[-1]
    head.proj = nn.Linear(head.proj.in_features, len(EVENTS))
    head.activation = None
    return model


def lr_at(epoch_float, args, peak):
    if epoch_float < args.warmup_epochs:
        return peak * (0.01 + 0.99 * epoch_float / args.warmup_epochs)
    p = (epoch_float - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
    return peak * 0.5 * (1 + np.cos(np.pi * p))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    ann = json.loads(args.ann.read_text())
    train_ds = RugbyClips(ann["train"], args.video_root, args.frames, args.crop, train=True)
    val_ds = RugbyClips(ann["val"], args.video_root, args.frames, args.crop, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.clips_per_gpu, sampler=sampler, num_workers=10,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=args.clips_per_gpu, num_workers=10)

    model = build_model().to(device)
    model = DDP(model, device_ids=[local_rank])

    peak_lr = args.base_lr * args.clips_per_gpu * world / 64
    bn_params = [p for n, p in model.named_parameters() if "bn" in n or "norm" in n]
    other = [p for n, p in model.named_parameters() if not ("bn" in n or "norm" in n)]
    opt = torch.optim.SGD([{"params": other, "weight_decay": 1e-4}, {"params": bn_params, "weight_decay": 0.0}],
                          lr=peak_lr, momentum=0.9, nesterov=True)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"world {world}, {len(train_ds)} train clips, peak lr {peak_lr:.3f}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (inputs, y) in enumerate(train_dl):
            for g in opt.param_groups:
                g["lr"] = lr_at(epoch + it / len(train_dl), args, peak_lr)
            inputs = [t.to(device, non_blocking=True) for t in inputs]
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(inputs), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if rank == 0 and it % 50 == 0:
                print(f"[{epoch}][{it}/{len(train_dl)}] loss {loss.item():.4f} "
                      f"lr {opt.param_groups[0]['lr']:.4f} {(time.time() - t0) / (it + 1):.2f}s/it", flush=True)

        model.eval()
        cm = torch.zeros(len(EVENTS), len(EVENTS), device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for inputs, y in val_dl:
                pred = model.module([t.to(device) for t in inputs]).argmax(1)
                cm.index_put_((y.to(device), pred), torch.ones_like(pred, dtype=cm.dtype), accumulate=True)
        dist.all_reduce(cm)
        acc = (cm.diag().sum() / cm.sum()).item()
        mean_rec = (cm.diag() / cm.sum(1).clamp(min=1)).mean().item()
        if rank == 0:
            print(f"epoch {epoch}: top1 {acc:.4f} mean recall {mean_rec:.4f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, args.out / "last.pyth")
            if mean_rec > best:
                best = mean_rec
                torch.save({"model": model.module.state_dict(), "epoch": epoch}, args.out / "best.pyth")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
