"""Pose-TGCN baseline for WLASL: OpenPose body + hand keypoints, GCN over joints with
temporal features stacked per joint (as in Li et al., WACV 2020), multi-GPU.

    torchrun --nproc_per_node=4 12_wlasl_pose_tgcn.py --subset 300 --pose-root /data/WLASL/pose_per_individual_videos
"""
import argparse
import json
import math
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

BODY_KEEP = [0, 1, 2, 3, 4, 5, 6, 7]  # nose, neck, arms
NUM_JOINTS = len(BODY_KEEP) + 21 + 21


def load_frame(path):
    with open(path) as f:
        person = json.load(f)["people"][0]
    body = np.array(person["pose_keypoints_2d"]).reshape(-1, 3)[BODY_KEEP, :2]
    lh = np.array(person["hand_left_keypoints_2d"]).reshape(-1, 3)[:, :2]
    rh = np.array(person["hand_right_keypoints_2d"]).reshape(-1, 3)[:, :2]
    xy = np.concatenate([body, lh, rh], 0)
    return 2 * (xy / 256.0) - 1  # videos are 256x256


class WLASLPose(Dataset):
    def __init__(self, split_file, pose_root, subset, split, num_samples=50, train=True):
        with open(split_file) as f:
            content = json.load(f)[:subset]
        self.items = []
        for label, entry in enumerate(content):
            for inst in entry["instances"]:
                if inst["split"] == split and os.path.isdir(os.path.join(pose_root, inst["video_id"])):
                    self.items.append((inst["video_id"], label, inst["frame_start"], inst["frame_end"]))
        self.pose_root, self.num_samples, self.train = pose_root, num_samples, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, label, fs, fe = self.items[i]
        d = os.path.join(self.pose_root, vid)
        frames = sorted(os.listdir(d))
        start = max(fs - 1, 0)
        end = len(frames) if fe == -1 else min(fe, len(frames))
        n = max(end - start, 1)
        if self.train and n > self.num_samples:
            s = np.random.randint(0, n - self.num_samples + 1)
            idx = np.arange(s, s + self.num_samples) + start
        else:
            idx = np.linspace(start, start + n - 1, self.num_samples).round().astype(int)
        poses = np.stack([load_frame(os.path.join(d, frames[j])) for j in idx])  # T, J, 2
        x = torch.from_numpy(poses).float().permute(1, 0, 2).reshape(NUM_JOINTS, -1)  # J, T*2
        return x, label


class GraphConvolution(nn.Module):
    def __init__(self, in_f, out_f, num_nodes):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_f, out_f))
        self.att = nn.Parameter(torch.empty(num_nodes, num_nodes))
        self.bias = nn.Parameter(torch.zeros(out_f))
        stdv = 1.0 / math.sqrt(out_f)
        nn.init.uniform_(self.weight, -stdv, stdv)
        nn.init.uniform_(self.att, -stdv, stdv)

    def forward(self, x):
        return torch.matmul(self.att, x @ self.weight) + self.bias


class GCBlock(nn.Module):
    def __init__(self, f, num_nodes, p):
        super().__init__()
        self.gc1, self.bn1 = GraphConvolution(f, f, num_nodes), nn.BatchNorm1d(num_nodes * f)
        self.gc2, self.bn2 = GraphConvolution(f, f, num_nodes), nn.BatchNorm1d(num_nodes * f)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, n, f = x.shape
        y = self.drop(torch.tanh(self.bn1(self.gc1(x).view(b, -1)).view(b, n, f)))
        y = self.drop(torch.tanh(self.bn2(self.gc2(y).view(b, -1)).view(b, n, f)))
        return x + y


class PoseTGCN(nn.Module):
    def __init__(self, input_feature, hidden, num_class, num_stage=24, p=0.3):
        super().__init__()
        self.gc1 = GraphConvolution(input_feature, hidden, NUM_JOINTS)
        self.bn1 = nn.BatchNorm1d(NUM_JOINTS * hidden)
        self.blocks = nn.Sequential(*[GCBlock(hidden, NUM_JOINTS, p) for _ in range(num_stage)])
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(hidden, num_class)

    def forward(self, x):
        b = x.shape[0]
        y = self.drop(torch.tanh(self.bn1(self.gc1(x).view(b, -1)).view(b, NUM_JOINTS, -1)))
        y = self.blocks(y)
        return self.fc(y.mean(1))


def save_checkpoint(state, is_best, out_dir):
    path = os.path.join(out_dir, "checkpoint.pth.tar")
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, os.path.join(out_dir, "model_best.pth.tar"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--split-file", default="/data/WLASL/splits/asl300.json")
    ap.add_argument("--pose-root", default="/data/WLASL/pose_per_individual_videos")
    ap.add_argument("--subset", type=int, default=300)
    ap.add_argument("--num-samples", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--stages", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="checkpoints/pose_tgcn_asl300")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    np.random.seed(rank)

    train_ds = WLASLPose(args.split_file, args.pose_root, args.subset, "train", args.num_samples, True)
    test_ds = WLASLPose(args.split_file, args.pose_root, args.subset, "test", args.num_samples, False)
    sampler = DistributedSampler(train_ds)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    test_dl = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), args.batch_size, num_workers=4)

    model = PoseTGCN(args.num_samples * 2, args.hidden, args.subset, args.stages)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-8, weight_decay=5e-5)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, "max", factor=0.5, patience=10)

    os.makedirs(args.out, exist_ok=True)
    start_epoch, best_top1 = 0, 0.0
    ckpt_path = os.path.join(args.out, "checkpoint.pth.tar")
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch, best_top1 = ckpt["epoch"] + 1, ckpt["best_top1"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        model.eval()
        stats = torch.zeros(4, device=device)  # top1, top5, top10, n
        with torch.no_grad():
            for x, y in test_dl:
                x, y = x.to(device), y.to(device)
                topk = model(x).topk(10, dim=1).indices
                hit = topk == y[:, None]
                stats += torch.stack([hit[:, :1].any(1).sum(), hit[:, :5].any(1).sum(), hit.any(1).sum(),
                                      torch.tensor(len(y), device=device)]).float()
        dist.all_reduce(stats)
        top1, top5, top10 = (stats[:3] / stats[3]).tolist()
        scheduler.step(top1)
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} top1 {top1:.4f} top5 {top5:.4f} top10 {top10:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
        is_best = top1 > best_top1
        best_top1 = max(top1, best_top1)
        save_checkpoint({"epoch": epoch, "state_dict": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "best_top1": best_top1}, is_best, args.out)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
