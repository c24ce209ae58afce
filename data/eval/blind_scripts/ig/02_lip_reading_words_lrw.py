"""Word-level lip reading on LRW (500 classes), ResNet-18 frontend + BiGRU backend.

Expects the LRW mouth ROIs pre-cropped into .npz files:
    <root>/<WORD>/<split>/<WORD>_00001.npz   with key "data": uint8 [29, 96, 96]

Launch:
    torchrun --nproc_per_node=8 02_lip_reading_words_lrw.py --data-root /datasets/lrw_roi
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    parser = argparse.ArgumentParser(description="LRW word classification")
    parser.add_argument("--data-root", type=str, required=True)
    parser.add_argument("--save-dir", type=str, default="./checkpoints/lrw_resnet_bigru")
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per process")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--mixup-alpha", type=float, default=0.4)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--resume", type=str, default="")
    parser.add_argument("--log-interval", type=int, default=50)
    return parser.parse_args()


class LRWDataset(Dataset):
    MEAN, STD = 0.421, 0.165

    def __init__(self, root, split, classes):
        self.split = split
        self.class_to_idx = {c: i for i, c in enumerate(classes)}
        self.samples = []
        for c in classes:
            for path in sorted(glob.glob(os.path.join(root, c, split, "*.npz"))):
                self.samples.append((path, self.class_to_idx[c]))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        frames = np.load(path)["data"].astype(np.float32) / 255.0  # 29, 96, 96
        if self.split == "train":
            y, x = np.random.randint(0, 9, size=2)
            frames = frames[:, y:y + 88, x:x + 88]
            if np.random.rand() < 0.5:
                frames = frames[:, :, ::-1]
        else:
            frames = frames[:, 4:92, 4:92]
        frames = (frames - self.MEAN) / self.STD
        return torch.from_numpy(np.ascontiguousarray(frames)), label


class ResBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.PReLU(cout),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.skip = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        self.act = nn.PReLU(cout)

    def forward(self, x):
        return self.act(self.body(x) + self.skip(x))


class LipReader(nn.Module):
    def __init__(self, num_classes=500, hidden=1024):
        super().__init__()
        self.frontend3d = nn.Sequential(
            nn.Conv3d(1, 64, (5, 7, 7), (1, 2, 2), (2, 3, 3), bias=False),
            nn.BatchNorm3d(64), nn.PReLU(64),
            nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1)),
        )
        chans = [64, 64, 128, 256, 512]
        layers = []
        for i in range(4):
            stride = 1 if i == 0 else 2
            layers += [ResBlock(chans[i], chans[i + 1], stride), ResBlock(chans[i + 1], chans[i + 1])]
        self.resnet = nn.Sequential(*layers)
        self.gru = nn.GRU(512, hidden, num_layers=3, batch_first=True, bidirectional=True, dropout=0.2)
        self.fc = nn.Linear(2 * hidden, num_classes)

    def forward(self, x):
        b, t = x.shape[:2]
        x = self.frontend3d(x.unsqueeze(1))                      # B, 64, T, H, W
        x = x.transpose(1, 2).flatten(0, 1)                      # B*T, 64, H, W
        x = F.adaptive_avg_pool2d(self.resnet(x), 1).view(b, t, -1)
        x, _ = self.gru(x)
        return self.fc(x.mean(1))


def mixup(x, y, alpha):
    lam = float(np.random.beta(alpha, alpha))
    perm = torch.randperm(x.size(0), device=x.device)
    return lam * x + (1 - lam) * x[perm], y, y[perm], lam


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # correct, count, loss sum
    for frames, labels in loader:
        frames, labels = frames.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model(frames)
        stats[0] += (logits.argmax(1) == labels).sum()
        stats[1] += labels.numel()
        stats[2] += F.cross_entropy(logits.float(), labels, reduction="sum")
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[1]).item(), (stats[2] / stats[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0

    torch.manual_seed(42)
    np.random.seed(42 + rank)
    torch.backends.cudnn.benchmark = True

    classes = sorted(os.listdir(args.data_root))
    assert len(classes) == 500, f"expected 500 LRW words, found {len(classes)}"
    train_set = LRWDataset(args.data_root, "train", classes)
    val_set = LRWDataset(args.data_root, "val", classes)

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, list(range(rank, len(val_set), world_size))),
                            batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    model = LipReader(num_classes=len(classes))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    start_epoch, best_acc = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ckpt["model_state_dict"])
        optimizer.load_state_dict(ckpt["optimizer_state_dict"])
        scheduler.load_state_dict(ckpt["scheduler_state_dict"])
        scaler.load_state_dict(ckpt["scaler_state_dict"])
        start_epoch = ckpt["epoch"] + 1
        best_acc = ckpt.get("best_acc", 0.0)

    writer = None
    if is_main:
        os.makedirs(args.save_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.save_dir, "tb"))
        print(f"train {len(train_set)} / val {len(val_set)} clips, world size {world_size}")

    global_step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        model.train()
        running, seen, tic = 0.0, 0, time.time()
        for i, (frames, labels) in enumerate(train_loader):
            frames = frames.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            frames, ya, yb, lam = mixup(frames, labels, args.mixup_alpha)

            with torch.autocast(device_type="cuda", dtype=torch.float16):
                logits = model(frames)
                loss = lam * criterion(logits, ya) + (1 - lam) * criterion(logits, yb)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
            scaler.step(optimizer)
            scaler.update()

            running += loss.item() * labels.size(0)
            seen += labels.size(0)
            global_step += 1
            if is_main and i % args.log_interval == 0:
                writer.add_scalar("train/loss", loss.item(), global_step)
                writer.add_scalar("train/lr", optimizer.param_groups[0]["lr"], global_step)
                print(f"[ep {epoch:03d} it {i:05d}/{len(train_loader)}] loss {running / seen:.4f} "
                      f"{seen * world_size / (time.time() - tic):.1f} clips/s")
        scheduler.step()

        acc, val_loss = validate(model, val_loader, device)
        if is_main:
            writer.add_scalar("val/acc", acc, epoch)
            writer.add_scalar("val/loss", val_loss, epoch)
            print(f"epoch {epoch}: val acc {acc * 100:.2f}%  val loss {val_loss:.4f}")
            ckpt = {
                "epoch": epoch,
                "model_state_dict": model.module.state_dict(),
                "optimizer_state_dict": optimizer.state_dict(),
                "scheduler_state_dict": scheduler.state_dict(),
                "scaler_state_dict": scaler.state_dict(),
                "best_acc": max(best_acc, acc),
            }
            torch.save(ckpt, os.path.join(args.save_dir, "last.pth"))
            if acc > best_acc:
                torch.save(ckpt, os.path.join(args.save_dir, "best.pth"))
        best_acc = max(best_acc, acc)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
