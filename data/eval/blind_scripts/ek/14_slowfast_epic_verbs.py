"""SlowFast R50 verb recognition on EPIC-KITCHENS-100.

Action segments are cut on the fly out of the long, untrimmed participant videos.

    torchrun --nproc_per_node=8 14_slowfast_epic_verbs.py --videos /data/epic100/videos \
        --annotations /data/epic100/annotations --init ckpts/slowfast_r50_k400.pyth
"""
import argparse
import csv
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

NUM_VERBS = 97


def args_parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--videos", required=True)
    ap.add_argument("--annotations", required=True)
    ap.add_argument("--init", default="")
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--alpha", type=int, default=4)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=0.01, help="for a total batch of 32")
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--out", default="exp/epic_verbs_sf")
    return ap.parse_args()


def cbr(i, o, k, s=1, p=0):
    return nn.Sequential(nn.Conv3d(i, o, k, s, p, bias=False), nn.BatchNorm3d(o), nn.ReLU(inplace=True))


class Bottleneck(nn.Module):
    def __init__(self, i, o, stride, tk):
        super().__init__()
        m = o // 4
        self.a = cbr(i, m, (tk, 1, 1), 1, (tk // 2, 0, 0))
        self.b = cbr(m, m, (1, 3, 3), (1, stride, stride), (0, 1, 1))
        self.c = nn.Sequential(nn.Conv3d(m, o, 1, bias=False), nn.BatchNorm3d(o))
        self.sc = nn.Identity() if (i == o and stride == 1) else nn.Sequential(
            nn.Conv3d(i, o, 1, (1, stride, stride), bias=False), nn.BatchNorm3d(o))

    def forward(self, x):
        return F.relu(self.c(self.b(self.a(x))) + self.sc(x), inplace=True)


class SlowFastR50(nn.Module):
    def __init__(self, num_classes, alpha):
        super().__init__()
        self.alpha = alpha
        S, Fc, D = [64, 256, 512, 1024, 2048], [8, 32, 64, 128, 256], [3, 4, 6, 3]
        self.s0 = nn.Sequential(cbr(3, 64, (1, 7, 7), (1, 2, 2), (0, 3, 3)), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        self.f0 = nn.Sequential(cbr(3, 8, (5, 7, 7), (1, 2, 2), (2, 3, 3)), nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)))
        self.lat = nn.ModuleList([cbr(Fc[i], 2 * Fc[i], (5, 1, 1), (alpha, 1, 1), (2, 0, 0)) for i in range(4)])
        self.sres = nn.ModuleList()
        self.fres = nn.ModuleList()
        for i in range(4):
            st = 1 if i == 0 else 2
            self.sres.append(nn.Sequential(*[Bottleneck(S[i] + 2 * Fc[i] if j == 0 else S[i + 1], S[i + 1],
                                                        st if j == 0 else 1, 1 if i < 2 else 3) for j in range(D[i])]))
            self.fres.append(nn.Sequential(*[Bottleneck(Fc[i] if j == 0 else Fc[i + 1], Fc[i + 1],
                                                        st if j == 0 else 1, 3) for j in range(D[i])]))
        self.head = nn.Sequential(nn.Dropout(0.5), nn.Linear(S[-1] + Fc[-1], num_classes))

    def forward(self, x):
        s, f = self.s0(x[:, :, ::self.alpha]), self.f0(x)
        for i in range(4):
            s = self.sres[i](torch.cat([s, self.lat[i](f)], 1))
            f = self.fres[i](f)
        return self.head(torch.cat([s.mean((2, 3, 4)), f.mean((2, 3, 4))], 1))


class EpicSegments(Dataset):
    def __init__(self, videos, csv_path, frames, train):
        self.videos, self.frames, self.train = videos, frames, train
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
        self.segs = [(r["participant_id"], r["video_id"], int(r["start_frame"]), int(r["stop_frame"]),
                      int(r["verb_class"])) for r in rows]

    def __len__(self):
        return len(self.segs)

    def __getitem__(self, i):
        pid, vid, start, stop, verb = self.segs[i]
        vr = VideoReader(os.path.join(self.videos, pid, f"{vid}.MP4"), ctx=cpu(0), num_threads=1, width=455, height=256)
        stop = min(stop, len(vr) - 1)
        length = max(stop - start, 1)
        seg = length / self.frames
        off = np.random.rand(self.frames) * seg if self.train else np.full(self.frames, seg / 2)
        idx = np.clip(start + (np.arange(self.frames) * seg + off).astype(int), start, stop)
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(3, 0, 1, 2).float() / 255.0
        if self.train:
            t, l = np.random.randint(0, 256 - 224 + 1), np.random.randint(0, 455 - 224 + 1)
            x = x[..., t:t + 224, l:l + 224]
            if np.random.rand() < 0.5:
                x = x.flip(-1)
        else:
            x = x[..., 16:240, 115:339]
        mean = torch.tensor([0.45, 0.45, 0.45]).view(3, 1, 1, 1)
        return (x - mean) / 0.225, verb


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    top1 = top5 = n = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        pred = out.topk(5, 1).indices
        top1 += (pred[:, 0] == y).sum().item()
        top5 += (pred == y[:, None]).any(1).sum().item()
        n += y.size(0)
    stats = torch.tensor([top1, top5, n], dtype=torch.float64)
    dist.all_reduce(stats)
    return 100 * stats[0].item() / stats[2].item(), 100 * stats[1].item() / stats[2].item()


def main():
    args = args_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = SlowFastR50(NUM_VERBS, args.alpha)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")["model_state"]
        sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
        model.load_state_dict(sd, strict=False)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_set = EpicSegments(args.videos, os.path.join(args.annotations, "EPIC_100_train.csv"), args.frames, True)
    val_set = EpicSegments(args.videos, os.path.join(args.annotations, "EPIC_100_validation.csv"), args.frames, False)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, prefetch_factor=4)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)), batch_size=args.bs,
                            num_workers=args.workers, pin_memory=True)

    lr = args.lr * args.bs * world / 32
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[20, 25], gamma=0.1)
    scaler = torch.cuda.amp.GradScaler()
    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        epoch_loss = torch.zeros(2, device=device)
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            epoch_loss += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if rank == 0 and it % 100 == 0:
                print(f"ep{epoch} {it}/{len(train_loader)} loss {loss.item():.3f} {time.time() - tic:.0f}s", flush=True)
        scheduler.step()
        dist.all_reduce(epoch_loss)

        top1, top5 = validate(model.module, val_loader, device)
        if rank == 0:
            writer.add_scalar("train/loss", (epoch_loss[0] / epoch_loss[1]).item(), epoch)
            writer.add_scalar("val/verb_top1", top1, epoch)
            writer.add_scalar("val/verb_top5", top5, epoch)
            print(f"epoch {epoch} verb top1 {top1:.2f} top5 {top5:.2f}", flush=True)
            ckpt = {"epoch": epoch, "model_state": model.module.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(ckpt, os.path.join(args.out, "last.pyth"))
            if top1 > best:
                best = top1
                torch.save(ckpt, os.path.join(args.out, "best.pyth"))

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
