"""TSM-R50 training on Kinetics-400 (8x1x1 segments, dense multi-view test).

Launch:
    torchrun --nproc_per_node=8 01_tsm_k400_train.py --data-root /datasets/k400 \
        --train-list lists/k400_train.txt --val-list lists/k400_val.txt
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def parse_args():
    p = argparse.ArgumentParser("TSM K400")
    p.add_argument("--data-root", required=True)
    p.add_argument("--train-list", required=True)
    p.add_argument("--val-list", required=True)
    p.add_argument("--num-classes", type=int, default=400)
    p.add_argument("--num-segments", type=int, default=8)
    p.add_argument("--shift-div", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8, help="clips per GPU")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--base-lr", type=float, default=0.01, help="lr for a total batch of 64")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--test-clips", type=int, default=10)
    p.add_argument("--test-crops", type=int, default=3)
    p.add_argument("--output", default="work_dirs/tsm_k400")
    p.add_argument("--print-freq", type=int, default=50)
    return p.parse_args()


class TemporalShift(nn.Module):
    def __init__(self, net, n_segment, n_div):
        super().__init__()
        self.net = net
        self.n_segment = n_segment
        self.fold_div = n_div

    def forward(self, x):
        nt, c, h, w = x.size()
        x = x.view(nt // self.n_segment, self.n_segment, c, h, w)
        fold = c // self.fold_div
        out = torch.zeros_like(x)
        out[:, :-1, :fold] = x[:, 1:, :fold]
        out[:, 1:, fold:2 * fold] = x[:, :-1, fold:2 * fold]
        out[:, :, 2 * fold:] = x[:, :, 2 * fold:]
        return self.net(out.view(nt, c, h, w))


class TSM(nn.Module):
    def __init__(self, num_classes, num_segments, shift_div, dropout):
        super().__init__()
        self.num_segments = num_segments
        base = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        for layer in [base.layer1, base.layer2, base.layer3, base.layer4]:
            for blk in layer:
                blk.conv1 = TemporalShift(blk.conv1, num_segments, shift_div)
        feat_dim = base.fc.in_features
        base.fc = nn.Dropout(dropout)
        self.base = base
        self.fc = nn.Linear(feat_dim, num_classes)
        nn.init.normal_(self.fc.weight, 0, 0.001)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x):
        # x: B, T, C, H, W
        b, t = x.shape[:2]
        out = self.fc(self.base(x.flatten(0, 1)))
        return out.view(b, t, -1).mean(1)


class K400Videos(Dataset):
    def __init__(self, root, list_file, num_segments, mode, test_clips=1, test_crops=1):
        self.root = root
        self.num_segments = num_segments
        self.mode = mode
        self.test_clips = test_clips
        self.test_crops = test_crops
        with open(list_file) as f:
            self.samples = [(l.split()[0], int(l.split()[1])) for l in f if l.strip()]

    def __len__(self):
        return len(self.samples)

    def _segment_indices(self, n, clip_idx=None):
        seg = n / self.num_segments
        if clip_idx is None:
            offs = np.random.uniform(0, seg, self.num_segments)
        else:
            offs = np.full(self.num_segments, seg * (clip_idx + 0.5) / self.test_clips)
        idx = (np.arange(self.num_segments) * seg + offs).astype(np.int64)
        return np.clip(idx, 0, n - 1)

    def _prepare(self, frames, size=256):
        x = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255.0
        h, w = x.shape[-2:]
        scale = size / min(h, w)
        x = F.interpolate(x, size=(round(h * scale), round(w * scale)), mode="bilinear", align_corners=False)
        return x

    def __getitem__(self, i):
        path, label = self.samples[i]
        vr = VideoReader(os.path.join(self.root, path), num_threads=1, ctx=cpu(0))
        n = len(vr)
        if self.mode == "train":
            x = self._prepare(vr.get_batch(self._segment_indices(n)).asnumpy())
            h, w = x.shape[-2:]
            y0, x0 = np.random.randint(0, h - 224 + 1), np.random.randint(0, w - 224 + 1)
            x = x[..., y0:y0 + 224, x0:x0 + 224]
            if np.random.rand() < 0.5:
                x = x.flip(-1)
            return (x - MEAN) / STD, label
        views = []
        for c in range(self.test_clips):
            x = self._prepare(vr.get_batch(self._segment_indices(n, c)).asnumpy(), 224)
            h, w = x.shape[-2:]
            for k in range(self.test_crops):
                if w >= h:
                    x0 = (w - 224) * k // max(self.test_crops - 1, 1)
                    crop = x[..., :, x0:x0 + 224]
                else:
                    y0 = (h - 224) * k // max(self.test_crops - 1, 1)
                    crop = x[..., y0:y0 + 224, :]
                views.append((crop - MEAN) / STD)
        return torch.stack(views), label


class ShardSampler(torch.utils.data.Sampler):
    """Contiguous shards without padding, for evaluation."""

    def __init__(self, size, rank, world_size):
        shard = (size + world_size - 1) // world_size
        self.indices = list(range(rank * shard, min(size, (rank + 1) * shard)))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def accuracy(logits, target, topk=(1, 5)):
    _, pred = logits.topk(max(topk), dim=1)
    hit = pred.eq(target.view(-1, 1))
    return [hit[:, :k].any(dim=1).float().sum().item() for k in topk]


@torch.no_grad()
def multiview_test(model, loader, device):
    model.eval()
    top1 = top5 = total = 0
    for views, target in loader:
        b, v = views.shape[:2]
        views = views.to(device, non_blocking=True).flatten(0, 1)
        target = target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(views)
        probs = logits.float().softmax(-1).view(b, v, -1).mean(1)
        c1, c5 = accuracy(probs, target)
        top1 += c1
        top5 += c5
        total += b
    return 100.0 * top1 / total, 100.0 * top5 / total


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True

    writer = None
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.output, "tb"))

    model = TSM(args.num_classes, args.num_segments, args.shift_div, args.dropout)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_set = K400Videos(args.data_root, args.train_list, args.num_segments, "train")
    test_set = K400Videos(args.data_root, args.val_list, args.num_segments, "test", args.test_clips, args.test_crops)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_set, batch_size=2, sampler=ShardSampler(len(test_set), rank, world_size),
                             num_workers=args.workers, pin_memory=True)

    lr = args.base_lr * args.batch_size * world_size / 64
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader))
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss()

    best_top1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        t0 = time.time()
        for it, (clips, target) in enumerate(train_loader):
            clips = clips.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(clips), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 20.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_sum += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if rank == 0 and it % args.print_freq == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.5f} {time.time() - t0:.1f}s", flush=True)
        dist.all_reduce(loss_sum)
        train_loss = (loss_sum[0] / loss_sum[1]).item()

        if (epoch + 1) % 5 == 0 or epoch + 1 == args.epochs:
            top1, top5 = multiview_test(model.module, test_loader, device)
            if rank == 0:
                print(f"epoch {epoch}: train loss {train_loss:.4f} top1 {top1:.2f} top5 {top5:.2f}")
                writer.add_scalar("val/top1", top1, epoch)
                writer.add_scalar("val/top5", top5, epoch)
                state = {"epoch": epoch + 1, "model": model.module.state_dict(),
                         "optimizer": optimizer.state_dict(), "top1": top1}
                torch.save(state, os.path.join(args.output, "last.pth"))
                if top1 > best_top1:
                    best_top1 = top1
                    torch.save(state, os.path.join(args.output, "best.pth"))
        if rank == 0:
            writer.add_scalar("train/loss", train_loss, epoch)

    if rank == 0:
        writer.close()
        print(f"best top1 {best_top1:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
