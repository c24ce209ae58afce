"""TSM (temporal shift module) ResNet-50, 8 segments, on Kinetics-400.

    torchrun --nproc_per_node=8 18_tsm_r50_kinetics.py --train-list lists/k400_train.txt \
        --val-list lists/k400_val.txt --video-root /data/k400 --imagenet /models/resnet50-11ad3fa6.pth
"""
import argparse
import os
import random
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


def parse_args():
    ap = argparse.ArgumentParser("TSM")
    ap.add_argument("--train-list", required=True)
    ap.add_argument("--val-list", required=True)
    ap.add_argument("--video-root", required=True)
    ap.add_argument("--imagenet", default="")
    ap.add_argument("--num-classes", type=int, default=400)
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--shift-div", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--lr", type=float, default=0.02, help="for 128 videos per step")
    ap.add_argument("--lr-steps", type=int, nargs="+", default=[20, 40])
    ap.add_argument("--dropout", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--save-dir", default="checkpoints/tsm_r50_k400")
    return ap.parse_args()


# ----------------------------------------------------------------------------- model
class TemporalShift(nn.Module):
    def __init__(self, net, n_segment, fold_div):
        super().__init__()
        self.net, self.n_segment, self.fold_div = net, n_segment, fold_div

    def forward(self, x):
        nt, c, h, w = x.shape
        x = x.view(nt // self.n_segment, self.n_segment, c, h, w)
        fold = c // self.fold_div
        out = torch.zeros_like(x)
        out[:, :-1, :fold] = x[:, 1:, :fold]  # shift left
        out[:, 1:, fold:2 * fold] = x[:, :-1, fold:2 * fold]  # shift right
        out[:, :, 2 * fold:] = x[:, :, 2 * fold:]
        return self.net(out.view(nt, c, h, w))


class TSM(nn.Module):
    def __init__(self, num_classes, n_segment, shift_div, dropout, imagenet=""):
        super().__init__()
        self.n_segment = n_segment
        base = torchvision.models.resnet50()
        if imagenet:
            base.load_state_dict(torch.load(imagenet, map_location="cpu"))
        for layer in (base.layer1, base.layer2, base.layer3, base.layer4):
            for blk in layer:
                blk.conv1 = TemporalShift(blk.conv1, n_segment, shift_div)
        base.fc = nn.Identity()
        self.base = base
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(2048, num_classes)
        nn.init.normal_(self.fc.weight, 0, 0.001)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x):
        # x: (B, T, C, H, W) -> frames through the 2D backbone, average consensus over T
        b, t = x.shape[:2]
        feats = self.base(x.flatten(0, 1))
        logits = self.fc(self.dropout(feats))
        return logits.view(b, t, -1).mean(1)


# ----------------------------------------------------------------------------- data
IMNET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
IMNET_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


class TSNVideoDataset(Dataset):
    def __init__(self, list_file, root, segments, train):
        self.items = []
        with open(list_file) as f:
            for line in f:
                rel, label = line.split()
                self.items.append((os.path.join(root, rel), int(label)))
        self.segments, self.train = segments, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        vr = VideoReader(path, ctx=cpu(0), num_threads=1)
        n = len(vr)
        avg = n / self.segments
        if self.train:
            ids = [int(avg * k) + random.randrange(max(1, int(avg))) for k in range(self.segments)]
        else:
            ids = [int(avg * k + avg / 2) for k in range(self.segments)]
        x = torch.from_numpy(vr.get_batch(np.clip(ids, 0, n - 1)).asnumpy()).permute(0, 3, 1, 2).float() / 255
        h, w = x.shape[-2:]
        x = F.interpolate(x, scale_factor=256 / min(h, w), mode="bilinear", align_corners=False)
        h, w = x.shape[-2:]
        if self.train:
            # multi-scale crop
            size = int(256 * random.choice([1, 0.875, 0.75, 0.66]))
            a, b = random.randint(0, h - size), random.randint(0, w - size)
            x = F.interpolate(x[..., a:a + size, b:b + size], size=(224, 224), mode="bilinear", align_corners=False)
            if random.random() < 0.5:
                x = x.flip(-1)
        else:
            a, b = (h - 224) // 2, (w - 224) // 2
            x = x[..., a:a + 224, b:b + 224]
        return (x - IMNET_MEAN) / IMNET_STD, label


class EvalShard(torch.utils.data.Sampler):
    def __init__(self, n, world, rank):
        self.ids = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


@torch.no_grad()
def evaluate(model, loader, num_classes):
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.eval()
    correct1 = torch.zeros((), device=device)
    correct5 = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for frames, labels in loader:
        frames, labels = frames.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(frames)
        top5 = logits.topk(min(5, num_classes), 1).indices
        correct1 += (top5[:, 0] == labels).sum()
        correct5 += (top5 == labels[:, None]).any(1).sum()
        count += labels.numel()
    stats = torch.stack([correct1, correct5, count])
    if dist.is_initialized():
        dist.all_reduce(stats)
    return (100 * stats[0] / stats[2]).item(), (100 * stats[1] / stats[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(rank)

    train_set = TSNVideoDataset(args.train_list, args.video_root, args.segments, train=True)
    val_set = TSNVideoDataset(args.val_list, args.video_root, args.segments, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=EvalShard(len(val_set), world, rank),
                            num_workers=args.workers, pin_memory=True)

    model = TSM(args.num_classes, args.segments, args.shift_div, args.dropout, args.imagenet)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    lr = args.lr * args.batch_size * world / 128
    fc_params = list(model.module.fc.parameters())
    fc_ids = {id(p) for p in fc_params}
    optimizer = torch.optim.SGD([
        {"params": [p for p in model.parameters() if id(p) not in fc_ids], "lr": lr},
        {"params": fc_params, "lr": lr * 5},
    ], lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, args.lr_steps, gamma=0.1)
    scaler = torch.cuda.amp.GradScaler()

    writer = None
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.save_dir, "logs"))

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        agg = torch.zeros(2, device=device)
        for it, (frames, labels) in enumerate(train_loader):
            frames, labels = frames.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(frames), labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 20)
            scaler.step(optimizer)
            scaler.update()
            agg += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} [{it}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"{(time.time() - tic) / (it + 1):.2f}s/it", flush=True)
        scheduler.step()
        dist.all_reduce(agg)

        top1, top5 = evaluate(model.module, val_loader, args.num_classes)
        if rank == 0:
            writer.add_scalar("train/loss", (agg[0] / agg[1]).item(), epoch)
            writer.add_scalar("val/top1", top1, epoch)
            writer.add_scalar("val/top5", top5, epoch)
            print(f"epoch {epoch}: val top1 {top1:.2f} top5 {top5:.2f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch, "best": max(best, top1)}
            torch.save(ckpt, os.path.join(args.save_dir, "last.pth"))
            if top1 > best:
                torch.save(ckpt, os.path.join(args.save_dir, "best.pth"))
        best = max(best, top1)

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
