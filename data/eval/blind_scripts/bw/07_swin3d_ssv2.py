"""Video Swin-T (torchvision swin3d_t, Kinetics-400 init) on Something-Something V2.

    torchrun --nproc_per_node=8 07_swin3d_ssv2.py --ssv2-root /data/ssv2 \
        --init /models/swin3d_t-7615ae03.pth --output runs/swin3d_t_ssv2
"""
import argparse
import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import swin3d_t
from transformers import get_cosine_schedule_with_warmup

log = logging.getLogger(__name__)
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ssv2-root", required=True)
    p.add_argument("--init", default="")
    p.add_argument("--output", default="runs/swin3d_t_ssv2")
    p.add_argument("--num-frames", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8, help="per GPU")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--warmup-epochs", type=float, default=2.5)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--backbone-lr-mult", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--test-clips", type=int, default=2)
    p.add_argument("--test-crops", type=int, default=3)
    return p.parse_args()


def load_split(root, split):
    with open(os.path.join(root, "labels", "labels.json")) as f:
        label_of = {k: int(v) for k, v in json.load(f).items()}
    with open(os.path.join(root, "labels", f"{split}.json")) as f:
        items = json.load(f)
    return [(os.path.join(root, "20bn-something-something-v2", f"{it['id']}.webm"),
             label_of[it["template"].replace("[", "").replace("]", "")]) for it in items]


class SSV2Clips(Dataset):
    def __init__(self, items, num_frames, train, clips=1, crops=1, size=224):
        self.items, self.num_frames, self.train = items, num_frames, train
        self.clips, self.crops, self.size = clips, crops, size

    def __len__(self):
        return len(self.items) * self.clips * self.crops

    def __getitem__(self, index):
        vid, view = divmod(index, self.clips * self.crops)
        clip, crop = divmod(view, self.crops)
        path, label = self.items[vid]
        vr = VideoReader(path, ctx=cpu(0), num_threads=1)
        n = len(vr)
        seg = n / self.num_frames
        if self.train:
            ids = [int(seg * k + random.uniform(0, seg)) for k in range(self.num_frames)]
        else:
            ids = [int(seg * (k + (clip + 0.5) / self.clips)) for k in range(self.num_frames)]
        ids = np.clip(ids, 0, n - 1)
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        h, w = x.shape[-2:]
        if self.train:
            # multi-scale crop; never flip (left/right templates)
            side = int(min(h, w) * random.choice([1.0, 0.875, 0.75, 0.66]))
            i, j = random.randint(0, h - side), random.randint(0, w - side)
            x = F.interpolate(x[..., i:i + side, j:j + side], size=(self.size, self.size),
                              mode="bilinear", align_corners=False)
        else:
            s = self.size / min(h, w)
            x = F.interpolate(x, size=(round(h * s), round(w * s)), mode="bilinear", align_corners=False)
            h, w = x.shape[-2:]
            k = 1 if self.crops == 1 else crop
            i = (h - self.size) * k // 2 if h > w else (h - self.size) // 2
            j = (w - self.size) * k // 2 if w >= h else (w - self.size) // 2
            x = x[..., i:i + self.size, j:j + self.size]
        return (x.permute(1, 0, 2, 3) - MEAN) / STD, label, vid


class NoPadShard(torch.utils.data.Sampler):
    def __init__(self, n, world, rank):
        self.ids = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


@torch.no_grad()
def evaluate(model, loader, n_videos, device):
    model.eval()
    scores = torch.zeros(n_videos, 174, device=device)
    labels = torch.zeros(n_videos, dtype=torch.long, device=device)
    hit = torch.zeros(n_videos, dtype=torch.long, device=device)
    for x, y, v in loader:
        x, y, v = x.to(device, non_blocking=True), y.to(device), v.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
        scores.index_add_(0, v, logits.float().softmax(1))
        labels[v] = y
        hit[v] = 1
    dist.all_reduce(scores)
    dist.all_reduce(labels, op=dist.ReduceOp.MAX)
    dist.all_reduce(hit, op=dist.ReduceOp.MAX)
    keep = hit.bool()
    top = scores[keep].topk(5, 1).indices
    y = labels[keep]
    return (top[:, 0] == y).float().mean().item() * 100, (top == y[:, None]).any(1).float().mean().item() * 100


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(rank)
    random.seed(rank)

    train_items = load_split(args.ssv2_root, "train")
    val_items = load_split(args.ssv2_root, "validation")
    train_set = SSV2Clips(train_items, args.num_frames, train=True)
    val_set = SSV2Clips(val_items, args.num_frames, train=False)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                              num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, num_workers=args.workers,
                            sampler=NoPadShard(len(val_set), world, rank), pin_memory=True)

    model = swin3d_t()
    if args.init:
        model.load_state_dict(torch.load(args.init, map_location="cpu"))
    model.head = nn.Linear(model.head.in_features, 174)
    model = DDP(model.to(device), device_ids=[local_rank])

    head_params = list(model.module.head.parameters())
    head_ids = {id(p) for p in head_params}
    backbone_params = [p for p in model.parameters() if id(p) not in head_ids]
    optimizer = torch.optim.AdamW([
        {"params": backbone_params, "lr": args.lr * args.backbone_lr_mult},
        {"params": head_params, "lr": args.lr},
    ], lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.999))

    steps_per_epoch = len(train_set) // args.batch_size
    scheduler = get_cosine_schedule_with_warmup(
        optimizer,
        num_warmup_steps=int(args.warmup_epochs * steps_per_epoch),
        num_training_steps=args.epochs * steps_per_epoch,
    )
    scaler = torch.cuda.amp.GradScaler()
    mixup = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=0.1, num_classes=174)
    criterion = SoftTargetCrossEntropy()

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
    log.info("world=%d, %d train videos, %d steps/epoch, %d total steps", world, len(train_set),
             steps_per_epoch, args.epochs * steps_per_epoch)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device=device)
        for step, (x, y, _) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y_soft = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(x), y_soft)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            tot += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f lr %.2e", epoch, step, len(train_loader),
                         loss.item(), scheduler.get_last_lr()[-1])
        dist.all_reduce(tot)
        top1, top5 = evaluate(model.module, val_loader, len(val_items), device)
        log.info("epoch %d train loss %.4f | val top1 %.2f top5 %.2f", epoch, (tot[0] / tot[1]).item(), top1, top5)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.output, "last.pth"))
            if top1 > best:
                best = top1
                torch.save(model.module.state_dict(), os.path.join(args.output, "best.pth"))
        dist.barrier()

    # multi-view test with the best weights
    model.module.load_state_dict(torch.load(os.path.join(args.output, "best.pth"), map_location="cpu"))
    test_set = SSV2Clips(val_items, args.num_frames, train=False, clips=args.test_clips, crops=args.test_crops)
    test_loader = DataLoader(test_set, batch_size=args.batch_size, num_workers=args.workers,
                             sampler=NoPadShard(len(test_set), world, rank), pin_memory=True)
    top1, top5 = evaluate(model.module, test_loader, len(val_items), device)
    log.info("%dx%d views: top1 %.2f top5 %.2f", args.test_clips, args.test_crops, top1, top5)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
