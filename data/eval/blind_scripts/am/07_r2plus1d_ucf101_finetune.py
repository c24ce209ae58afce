"""Fine-tune torchvision's R(2+1)D-18 (Kinetics-400 weights) on UCF-101 split 1.

    torchrun --nproc_per_node=4 07_r2plus1d_ucf101_finetune.py --root /data/UCF-101 \
        --splits /data/ucfTrainTestlist --output-dir /shared/exp/r2p1d_ucf101
"""
import argparse
import datetime
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.io import read_video
from torchvision.models.video import R2Plus1D_18_Weights, r2plus1d_18
from torchvision.transforms import v2


class UCF101Clips(Dataset):
    def __init__(self, root, split_dir, fold=1, train=True, frames=16, step=2, clips_per_video=1):
        names = sorted(os.path.basename(d) for d in glob.glob(os.path.join(root, "*")) if os.path.isdir(d))
        self.class_to_idx = {n: i for i, n in enumerate(names)}
        list_name = f"{'trainlist' if train else 'testlist'}{fold:02d}.txt"
        with open(os.path.join(split_dir, list_name)) as f:
            rels = [line.split()[0] for line in f if line.strip()]
        self.videos = [(os.path.join(root, r), self.class_to_idx[r.split("/")[0]]) for r in rels]
        self.frames, self.step, self.train = frames, step, train
        self.clips_per_video = clips_per_video
        self.tf = v2.Compose([
            v2.ToDtype(torch.float32, scale=True),
            v2.Resize((128, 171), antialias=True),
            v2.RandomCrop(112) if train else v2.CenterCrop(112),
            v2.RandomHorizontalFlip() if train else v2.Identity(),
            v2.Normalize(mean=[0.43216, 0.394666, 0.37645], std=[0.22803, 0.22145, 0.216989]),
        ])

    def __len__(self):
        return len(self.videos) * self.clips_per_video

    def __getitem__(self, idx):
        vid_idx, clip_idx = divmod(idx, self.clips_per_video)
        path, label = self.videos[vid_idx]
        video, _, _ = read_video(path, pts_unit="sec", output_format="TCHW")
        n, span = video.shape[0], self.frames * self.step
        if self.train:
            start = np.random.randint(0, max(n - span, 0) + 1)
        else:
            start = int(max(n - span, 0) * (clip_idx + 0.5) / self.clips_per_video)
        t = torch.arange(start, start + span, self.step).clamp(max=n - 1)
        clip = self.tf(video[t])                  # T C H W
        return clip.permute(1, 0, 2, 3), label, vid_idx


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--splits", required=True)
    p.add_argument("--fold", type=int, default=1)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.001, help="for the global batch of 64")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--test-clips", type=int, default=5)
    p.add_argument("--sync-bn", action="store_true")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def train_epoch(model, loader, criterion, optimizer, scaler, device, epoch, rank):
    model.train()
    meter = torch.zeros(3, device=device)
    t0 = time.time()
    for i, (clip, target, _) in enumerate(loader):
        clip, target = clip.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            out = model(clip)
            loss = criterion(out, target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        meter += torch.stack([loss.detach() * clip.size(0), (out.argmax(1) == target).sum().float(),
                              torch.tensor(float(clip.size(0)), device=device)])
        if rank == 0 and i % 20 == 0:
            print(f"epoch {epoch} [{i}/{len(loader)}] loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    dist.all_reduce(meter)
    return (meter[0] / meter[2]).item(), (100 * meter[1] / meter[2]).item()


@torch.no_grad()
def test_videos(model, dataset, loader, device):
    """Average clip softmax over `clips_per_video` clips and compute video accuracy."""
    model.eval()
    nvid = len(dataset.videos)
    scores = torch.zeros(nvid, 101, device=device)
    counts = torch.zeros(nvid, device=device)
    labels = torch.tensor([l for _, l in dataset.videos], device=device)
    for clip, _, vid in loader:
        clip, vid = clip.to(device, non_blocking=True), vid.to(device)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            prob = model(clip).float().softmax(1)
        scores.index_add_(0, vid, prob)
        counts.index_add_(0, vid, torch.ones_like(vid, dtype=torch.float))
    dist.all_reduce(scores)
    dist.all_reduce(counts)
    pred = (scores / counts.clamp(min=1)[:, None]).argmax(1)
    return 100.0 * (pred == labels).float().mean().item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = UCF101Clips(args.root, args.splits, args.fold, train=True)
    test_set = UCF101Clips(args.root, args.splits, args.fold, train=False, clips_per_video=args.test_clips)
    sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # disjoint, unpadded shards for testing so no clip is counted twice
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = r2plus1d_18(weights=R2Plus1D_18_Weights.KINETICS400_V1)
    model.fc = nn.Linear(model.fc.in_features, 101)
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = nn.parallel.DistributedDataParallel(model.to(device), device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 64
    optimizer = torch.optim.SGD([
        {"params": [p for n, p in model.module.named_parameters() if not n.startswith("fc.")], "lr": lr},
        {"params": model.module.fc.parameters(), "lr": lr * 10},
    ], momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    os.makedirs(args.output_dir, exist_ok=True)
    ckpt_path = os.path.join(args.output_dir, "checkpoint.pth")
    start_epoch, best_acc = 0, 0.0
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["lr_scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        tr_loss, tr_acc = train_epoch(model, train_loader, criterion, optimizer, scaler, device, epoch, rank)
        scheduler.step()
        acc = test_videos(model.module, test_set, test_loader, device)
        best_acc = max(best_acc, acc)
        if rank == 0:
            print(f"epoch {epoch}: train loss {tr_loss:.3f} acc {tr_acc:.1f} | test video acc {acc:.2f} "
                  f"(best {best_acc:.2f})", flush=True)

        checkpoint = {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "epoch": epoch,
            "best_acc": best_acc,
            "args": args,
        }
        torch.save(checkpoint, ckpt_path)
        if acc >= best_acc:
            torch.save(checkpoint, os.path.join(args.output_dir, "model_best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
