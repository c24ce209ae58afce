"""Fine-tune MC3-18 (Kinetics-400 init) on HMDB-51, split 1.

HMDB-51 layout:
    <root>/videos/<class>/<name>.avi
    <root>/testTrainMulti_7030_splits/<class>_test_split<k>.txt   ("<name>.avi 1" = train, 2 = test, 0 = unused)

Launch:
    torchrun --nproc_per_node=4 10_mc3_hmdb51.py --root /data/hmdb51 --init /models/mc3_18-a90a0ba3.pth
"""
import argparse
import glob
import os
import random
import time

import av
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.models.video import mc3_18

MEAN = np.array([0.43216, 0.394666, 0.37645], dtype=np.float32)
STD = np.array([0.22803, 0.22145, 0.216989], dtype=np.float32)


def get_parser():
    parser = argparse.ArgumentParser("mc3 hmdb51")
    parser.add_argument("--root", type=str, required=True)
    parser.add_argument("--split", type=int, default=1)
    parser.add_argument("--init", type=str, default="")
    parser.add_argument("--clip-len", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.005, help="for 64 clips per step")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--test-clips", type=int, default=10)
    parser.add_argument("--logdir", type=str, default="runs/mc3_hmdb51")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


def read_split(root, split):
    train, test = [], []
    files = sorted(glob.glob(os.path.join(root, "testTrainMulti_7030_splits", f"*_test_split{split}.txt")))
    classes = sorted(os.path.basename(f)[: -len(f"_test_split{split}.txt")] for f in files)
    cls_idx = {c: i for i, c in enumerate(classes)}
    for f in files:
        cls = os.path.basename(f)[: -len(f"_test_split{split}.txt")]
        for line in open(f):
            parts = line.split()
            if len(parts) != 2:
                continue
            item = (os.path.join(root, "videos", cls, parts[0]), cls_idx[cls])
            if parts[1] == "1":
                train.append(item)
            elif parts[1] == "2":
                test.append(item)
    return train, test, classes


def decode_frames(path):
    with av.open(path) as c:
        return [fr.to_ndarray(format="rgb24") for fr in c.decode(video=0)]


class HMDBClips(Dataset):
    def __init__(self, items, clip_len, train, num_clips=1):
        self.items, self.clip_len, self.train, self.num_clips = items, clip_len, train, num_clips

    def __len__(self):
        return len(self.items) * self.num_clips

    def __getitem__(self, index):
        vid, clip = divmod(index, self.num_clips)
        path, label = self.items[vid]
        frames = decode_frames(path)
        n = len(frames)
        if self.train:
            start = random.randint(0, max(0, n - self.clip_len))
        else:
            start = int(max(0, n - self.clip_len) * (clip + 0.5) / self.num_clips)
        ids = [min(start + k, n - 1) for k in range(self.clip_len)]
        clip_arr = (np.stack([frames[k] for k in ids]).astype(np.float32) / 255.0 - MEAN) / STD
        x = torch.from_numpy(clip_arr).permute(0, 3, 1, 2)
        x = F.interpolate(x, size=(128, 171), mode="bilinear", align_corners=False)
        if self.train:
            i, j = random.randint(0, 16), random.randint(0, 59)
            x = x[..., i:i + 112, j:j + 112]
            if random.random() < 0.5:
                x = torch.flip(x, dims=[-1])
        else:
            x = x[..., 8:120, 29:141]
        return x.permute(1, 0, 2, 3).contiguous(), label, vid


class TestShard(torch.utils.data.Sampler):
    def __init__(self, n, replicas, rank):
        self.ids = list(range(rank, n, replicas))

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


@torch.no_grad()
def test_video_level(net, loader, n_videos, n_classes, device):
    net.eval()
    logits_sum = torch.zeros(n_videos, n_classes, device=device)
    label_of = torch.zeros(n_videos, dtype=torch.long, device=device)
    for x, y, vid in loader:
        x, y, vid = x.to(device), y.to(device), vid.to(device)
        logits_sum.index_add_(0, vid, net(x).float())
        label_of[vid] = y
    dist.all_reduce(logits_sum)
    dist.all_reduce(label_of, op=dist.ReduceOp.MAX)
    return (logits_sum.argmax(1) == label_of).float().mean().item() * 100


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)
    random.seed(rank)
    torch.manual_seed(rank)

    train_items, test_items, classes = read_split(args.root, args.split)
    train_set = HMDBClips(train_items, args.clip_len, train=True)
    test_set = HMDBClips(test_items, args.clip_len, train=False, num_clips=args.test_clips)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size,
                             sampler=TestShard(len(test_set), world_size, rank),
                             num_workers=args.workers, pin_memory=True)

    model = mc3_18()
    if args.init:
        model.load_state_dict(torch.load(args.init, map_location="cpu"))
    model.fc = nn.Sequential(nn.Dropout(0.5), nn.Linear(model.fc.in_features, len(classes)))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    lr = args.lr * args.batch_size * world_size / 64
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        agg = torch.zeros(3, device=device)
        for clips, labels, _ in train_loader:
            clips = clips.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            out = model(clips)
            loss = F.cross_entropy(out, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            agg += torch.stack([loss.detach() * labels.size(0), (out.argmax(1) == labels).sum().float(),
                                torch.tensor(float(labels.size(0)), device=device)])
        scheduler.step()
        dist.all_reduce(agg)
        if rank == 0:
            writer.add_scalar("train/loss", (agg[0] / agg[2]).item(), epoch)
            writer.add_scalar("train/acc", (100 * agg[1] / agg[2]).item(), epoch)
            print(f"epoch {epoch} loss {(agg[0] / agg[2]).item():.3f} acc {(100 * agg[1] / agg[2]).item():.1f} "
                  f"time {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "classes": classes}, os.path.join(args.logdir, "checkpoint.pth"))

    acc = test_video_level(model.module, test_loader, len(test_items), len(classes), device)
    if rank == 0:
        print(f"HMDB51 split{args.split} video accuracy ({args.test_clips} clips): {acc:.2f}")
        writer.add_scalar("test/video_acc", acc, args.epochs)
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
