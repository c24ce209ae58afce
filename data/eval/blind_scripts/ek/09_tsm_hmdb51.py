"""TSM on HMDB51 (3 splits), initialised from Kinetics-400 TSM weights.

torchrun --nproc_per_node=4 09_tsm_hmdb51.py --video-dir /data/hmdb51/videos \
    --split-dir /data/hmdb51/testTrainMulti_7030_splits --split 1 --init ckpts/tsm_k400_r50_8f.pth
"""
import argparse
import glob
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.tensorboard import SummaryWriter


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--video-dir", required=True)
    p.add_argument("--split-dir", required=True)
    p.add_argument("--split", type=int, default=1, choices=[1, 2, 3])
    p.add_argument("--init", default="")
    p.add_argument("--segments", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.00125, help="per 8 clips")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="exp/tsm_hmdb51")
    return p.parse_args()


class TemporalShift(nn.Module):
    def __init__(self, conv, n_segment, fold_div=8):
        super().__init__()
        self.conv, self.n_segment, self.fold_div = conv, n_segment, fold_div

    def forward(self, x):
        nt, c, h, w = x.shape
        x = x.reshape(nt // self.n_segment, self.n_segment, c, h, w)
        fold = c // self.fold_div
        out = torch.zeros_like(x)
        out[:, :-1, :fold] = x[:, 1:, :fold]
        out[:, 1:, fold:2 * fold] = x[:, :-1, fold:2 * fold]
        out[:, :, 2 * fold:] = x[:, :, 2 * fold:]
        return self.conv(out.reshape(nt, c, h, w))


class TSMNet(nn.Module):
    def __init__(self, num_classes, segments):
        super().__init__()
        self.segments = segments
        r50 = torchvision.models.resnet50()
        for stage in [r50.layer1, r50.layer2, r50.layer3, r50.layer4]:
            for blk in stage:
                blk.conv1 = TemporalShift(blk.conv1, segments)
        r50.fc = nn.Identity()
        self.backbone = r50
        self.dropout = nn.Dropout(0.5)
        self.cls_head = nn.Linear(2048, num_classes)

    def forward(self, x):
        b = x.shape[0]
        feat = self.backbone(x.flatten(0, 1))
        logits = self.cls_head(self.dropout(feat))
        return logits.view(b, self.segments, -1).mean(1)


class HMDB51(Dataset):
    def __init__(self, video_dir, split_dir, split, train, segments):
        self.video_dir, self.train, self.segments = video_dir, train, segments
        files = sorted(glob.glob(os.path.join(split_dir, f"*_test_split{split}.txt")))
        self.classes = [os.path.basename(f)[:-len(f"_test_split{split}.txt")] for f in files]
        want = "1" if train else "2"
        self.samples = []
        for label, f in enumerate(files):
            with open(f) as fh:
                for line in fh:
                    name, tag = line.split()
                    if tag == want:
                        self.samples.append((os.path.join(self.classes[label], name), label))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        rel, label = self.samples[i]
        vr = VideoReader(os.path.join(self.video_dir, rel), ctx=cpu(0), num_threads=1)
        n = len(vr)
        seg = n / self.segments
        jitter = np.random.rand(self.segments) if self.train else np.full(self.segments, 0.5)
        idx = np.minimum((np.arange(self.segments) + jitter) * seg, n - 1).astype(int)
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        x = F.interpolate(x, size=(256, 340), mode="bilinear", align_corners=False)
        if self.train:
            s = int(np.random.choice([256, 224, 192, 168]))
            t, l = np.random.randint(0, 256 - s + 1), np.random.randint(0, 340 - s + 1)
            x = F.interpolate(x[..., t:t + s, l:l + s], size=(224, 224), mode="bilinear", align_corners=False)
            if np.random.rand() < 0.5:
                x = x.flip(-1)
        else:
            x = x[..., 16:240, 58:282]
        mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
        std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
        return (x - mean) / std, label


def evaluate(model, loader, device):
    model.eval()
    stat = torch.zeros(3, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
            top5 = out.topk(5, 1).indices
            stat[0] += (top5[:, 0] == y).sum()
            stat[1] += (top5 == y[:, None]).any(1).sum()
            stat[2] += len(y)
    dist.all_reduce(stat)
    return (stat[0] / stat[2] * 100).item(), (stat[1] / stat[2] * 100).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.backends.cudnn.benchmark = True

    model = TSMNet(51, args.segments)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")
        sd = sd.get("state_dict", sd)
        sd = {k.replace("module.", ""): v for k, v in sd.items() if not k.startswith(("cls_head", "module.cls_head"))}
        missing, _ = model.load_state_dict(sd, strict=False)
        if rank == 0:
            print(f"init from {args.init}; missing keys: {missing}")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    train_set = HMDB51(args.video_dir, args.split_dir, args.split, True, args.segments)
    test_set = HMDB51(args.video_dir, args.split_dir, args.split, False, args.segments)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), batch_size=args.batch_size,
                             num_workers=args.workers, pin_memory=True)

    lr = args.lr * args.batch_size * world / 8
    head = list(model.module.cls_head.parameters())
    body = [p for n, p in model.module.named_parameters() if not n.startswith("cls_head")]
    optimizer = torch.optim.SGD([{"params": body, "lr": lr}, {"params": head, "lr": lr * 10}],
                                momentum=0.9, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [10, 20], 0.1)
    scaler = torch.cuda.amp.GradScaler()
    writer = SummaryWriter(args.out) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_set)} train / {len(test_set)} test videos, {world} GPUs, lr {lr}")

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        tic, running = time.time(), 0.0
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 20)
            scaler.step(optimizer)
            scaler.update()
            running += loss.item()
        scheduler.step()
        avg = torch.tensor([running / max(len(train_loader), 1)], device=device)
        dist.all_reduce(avg)
        avg = avg.item() / world

        top1, top5 = evaluate(model.module, test_loader, device)
        if rank == 0:
            writer.add_scalar("train/loss", avg, epoch)
            writer.add_scalar("test/top1", top1, epoch)
            writer.add_scalar("test/top5", top5, epoch)
            print(f"epoch {epoch} loss {avg:.4f} top1 {top1:.2f} top5 {top5:.2f} ({time.time() - tic:.0f}s)",
                  flush=True)
            torch.save({"epoch": epoch, "state_dict": model.module.state_dict()}, os.path.join(args.out, "last.pth"))
            if top1 > best:
                best = top1
                torch.save({"epoch": epoch, "state_dict": model.module.state_dict()},
                           os.path.join(args.out, "best.pth"))

    if rank == 0:
        writer.close()
        print(f"split {args.split} best top1 {best:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
