"""AUTSL (226 Turkish signs): RGB R(2+1)D-18 + pose GCN late fusion.

Single node, processes started with torch.multiprocessing:

    python 02_autsl_rgb_pose_fusion_spawn.py --gpus 4 --root /data/AUTSL --accum 2
"""
import argparse
import csv
import os
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import R2Plus1D_18_Weights, r2plus1d_18

NUM_CLASSES = 226
NUM_POSE_JOINTS = 27  # body 7 + 2 x 10 hand points (SAM-SLR style subset)


class AUTSLClips(Dataset):
    def __init__(self, root, split, clip_len=16, train=True):
        self.video_dir = os.path.join(root, split)
        self.pose_dir = os.path.join(root, "pose27", split)
        with open(os.path.join(root, f"{split}_labels.csv")) as f:
            self.items = [(r[0], int(r[1])) for r in csv.reader(f)]
        self.clip_len = clip_len
        self.train = train
        self.mean = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
        self.std = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)

    def __len__(self):
        return len(self.items)

    def _frame_ids(self, n):
        if self.train:
            ticks = np.linspace(0, n, self.clip_len + 1)
            return np.array([np.random.randint(int(a), max(int(a) + 1, int(b))) for a, b in zip(ticks[:-1], ticks[1:])]).clip(0, n - 1)
        return np.linspace(0, n - 1, self.clip_len).round().astype(int)

    def __getitem__(self, i):
        name, label = self.items[i]
        vr = VideoReader(os.path.join(self.video_dir, f"{name}_color.mp4"), ctx=cpu(0), width=128, height=128)
        ids = self._frame_ids(len(vr))
        rgb = torch.from_numpy(vr.get_batch(ids.tolist()).asnumpy()).permute(3, 0, 1, 2).float() / 255.0
        if self.train:
            top, left = np.random.randint(0, 17, size=2)
        else:
            top = left = 8
        rgb = (rgb[:, :, top:top + 112, left:left + 112] - self.mean) / self.std
        pose = np.load(os.path.join(self.pose_dir, f"{name}_color.npy")).astype(np.float32)  # T, 27, 3
        pose = pose[np.linspace(0, len(pose) - 1, 64).round().astype(int)]
        pose[..., :2] = (pose[..., :2] - 256.0) / 256.0
        if self.train:
            pose[..., :2] *= np.random.uniform(0.9, 1.1)
        return rgb, torch.from_numpy(pose), label


class PoseGCNBlock(nn.Module):
    def __init__(self, cin, cout, A, stride=1):
        super().__init__()
        self.register_buffer("A", A)
        self.spatial = nn.Conv2d(cin, cout, 1)
        # GroupNorm rather than BN: these blocks are recomputed under activation checkpointing
        self.temporal = nn.Sequential(nn.GroupNorm(8, cout), nn.ReLU(inplace=True),
                                      nn.Conv2d(cout, cout, (9, 1), (stride, 1), (4, 0)), nn.GroupNorm(8, cout))
        self.down = nn.Identity() if (cin == cout and stride == 1) else nn.Conv2d(cin, cout, 1, (stride, 1))

    def forward(self, x):
        y = torch.einsum("nctv,vw->nctw", self.spatial(x), self.A)
        return F.relu(self.temporal(y) + self.down(x))


class PoseStream(nn.Module):
    def __init__(self, A, widths=(64, 64, 128, 128, 256, 256), use_ckpt=True):
        super().__init__()
        blocks, cin = [], 3
        for k, w in enumerate(widths):
            blocks.append(PoseGCNBlock(cin, w, A, stride=2 if k in (2, 4) else 1))
            cin = w
        self.blocks = nn.ModuleList(blocks)
        self.use_ckpt = use_ckpt
        self.out_dim = cin

    def forward(self, pose):  # N T V C
        x = pose.permute(0, 3, 1, 2).contiguous()
        for blk in self.blocks:
            if self.use_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return x.mean(dim=(2, 3))


class FusionNet(nn.Module):
    def __init__(self, A, num_classes=NUM_CLASSES):
        super().__init__()
        self.rgb = r2plus1d_18(weights=R2Plus1D_18_Weights.KINETICS400_V1)
        self.rgb.fc = nn.Identity()
        self.pose = PoseStream(A)
        self.rgb_head = nn.Linear(512, num_classes)
        self.pose_head = nn.Linear(self.pose.out_dim, num_classes)
        self.fuse_head = nn.Linear(512 + self.pose.out_dim, num_classes)

    def forward(self, rgb, pose):
        fr, fp = self.rgb(rgb), self.pose(pose)
        return self.fuse_head(torch.cat([fr, fp], 1)), self.rgb_head(fr), self.pose_head(fp)

    def param_groups(self, lr, backbone_mult=0.1):
        backbone = list(self.rgb.parameters())
        ids = {id(p) for p in backbone}
        rest = [p for p in self.parameters() if id(p) not in ids]
        return [{"params": backbone, "lr": lr * backbone_mult}, {"params": rest, "lr": lr}]


def pose_adjacency():
    edges = [(0, 1), (0, 2), (1, 3), (2, 4), (3, 5), (4, 6)]
    for hand_root, wrist in ((7, 5), (17, 6)):
        edges.append((wrist, hand_root))
        edges += [(hand_root, hand_root + k) for k in range(1, 10)]
    A = torch.eye(NUM_POSE_JOINTS)
    for i, j in edges:
        A[i, j] = A[j, i] = 1
    return A / A.sum(1, keepdim=True)


def train_worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    train_set = AUTSLClips(args.root, "train", train=True)
    val_set = AUTSLClips(args.root, "val", train=False)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=args.batch_size,
                            num_workers=args.workers, pin_memory=True)

    model = FusionNet(pose_adjacency())
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[rank])
    eff_batch = args.batch_size * args.accum * world_size
    lr = args.lr * eff_batch / 32
    optimizer = torch.optim.SGD(model.module.param_groups(lr), momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    start_epoch, best = 0, 0.0
    last_path = os.path.join(args.out, "last.pth")
    if args.resume and os.path.isfile(last_path):
        ckpt = torch.load(last_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"effective batch {eff_batch}, lr {lr:.4f}, start epoch {start_epoch}")

    for epoch in range(start_epoch, args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        optimizer.zero_grad(set_to_none=True)
        for it, (rgb, pose, y) in enumerate(train_loader):
            rgb, pose, y = rgb.to(device, non_blocking=True), pose.to(device, non_blocking=True), y.to(device)
            do_step = (it + 1) % args.accum == 0 or (it + 1) == len(train_loader)
            with (nullcontext() if do_step else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    fused, r, p = model(rgb, pose)
                    loss = F.cross_entropy(fused, y) + 0.5 * (F.cross_entropy(r, y) + F.cross_entropy(p, y))
                (loss / args.accum).backward()
            if do_step:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} iter {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
        scheduler.step()

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for rgb, pose, y in val_loader:
                fused, _, _ = model(rgb.to(device), pose.to(device))
                hits[0] += (fused.argmax(1) == y.to(device)).sum()
                hits[1] += y.numel()
        dist.all_reduce(hits)
        acc = (hits[0] / hits[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: val top-1 {acc * 100:.2f}", flush=True)
            best = max(best, acc)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best}
            torch.save(state, last_path)
            if acc >= best:
                torch.save(state, os.path.join(args.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/AUTSL")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=29512)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--out", default="work_dirs/autsl_fusion")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    mp.spawn(train_worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
