"""MS-ASL isolated sign recognition from OpenPose (BODY_25 + hands) keypoints.

OpenPose writes one JSON per frame, which is far too slow to read every epoch, so the first
run packs each split into a single pickle under --cache-dir.

    torchrun --nproc_per_node=4 04_msasl_openpose_cache.py --subset 1000 \
        --openpose-dir /data/msasl/openpose --cache-dir /data/msasl/cache
"""
import argparse
import glob
import json
import logging
import os
import pickle

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

logger = logging.getLogger(__name__)
UPPER_BODY = [0, 1, 2, 3, 4, 5, 6, 7, 15, 16, 17, 18]


def read_openpose_sequence(folder):
    frames = []
    for path in sorted(glob.glob(os.path.join(folder, "*_keypoints.json"))):
        with open(path) as f:
            people = json.load(f)["people"]
        if not people:
            frames.append(np.zeros((12 + 42, 3), np.float32))
            continue
        p = people[0]
        body = np.asarray(p["pose_keypoints_2d"], np.float32).reshape(25, 3)[UPPER_BODY]
        lh = np.asarray(p["hand_left_keypoints_2d"], np.float32).reshape(21, 3)
        rh = np.asarray(p["hand_right_keypoints_2d"], np.float32).reshape(21, 3)
        frames.append(np.concatenate([body, lh, rh], 0))
    return np.stack(frames) if frames else np.zeros((1, 54, 3), np.float32)


def build_split_cache(ann_file, openpose_dir, subset):
    with open(ann_file) as f:
        anns = json.load(f)
    samples = []
    for a in tqdm(anns, desc=os.path.basename(ann_file), disable=None):
        if a["label"] >= subset:
            continue
        folder = os.path.join(openpose_dir, f"{a['clean_text']}_{a['signer_id']}_{a['start_time']:.2f}")
        if not os.path.isdir(folder):
            continue
        samples.append({"kp": read_openpose_sequence(folder).astype(np.float16), "label": a["label"],
                        "signer": a["signer_id"]})
    return samples


def load_split(split, args):
    cache_file = os.path.join(args.cache_dir, f"msasl{args.subset}_{split}.pkl")
    if not os.path.exists(cache_file):
        logger.info("building %s", cache_file)
        samples = build_split_cache(os.path.join(args.ann_dir, f"MSASL_{split}.json"), args.openpose_dir, args.subset)
        os.makedirs(args.cache_dir, exist_ok=True)
        with open(cache_file, "wb") as f:
            pickle.dump(samples, f, protocol=pickle.HIGHEST_PROTOCOL)
        return samples
    with open(cache_file, "rb") as f:
        return pickle.load(f)


class PoseSequences(Dataset):
    def __init__(self, samples, num_frames=64, train=True):
        self.samples = samples
        self.num_frames = num_frames
        self.train = train

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        s = self.samples[i]
        kp = s["kp"].astype(np.float32)
        t = len(kp)
        if self.train:
            start = np.random.randint(0, max(1, t // 8))
            end = t - np.random.randint(0, max(1, t // 8))
            idx = np.linspace(start, end - 1, self.num_frames)
        else:
            idx = np.linspace(0, t - 1, self.num_frames)
        kp = kp[idx.round().astype(int)]
        xy, c = kp[..., :2], kp[..., 2:]
        neck = xy[:, 1:2]
        shoulder = np.linalg.norm(xy[:, 2] - xy[:, 5], axis=-1)[:, None, None].clip(1.0)
        xy = (xy - neck) / shoulder * (c > 0.1)
        if self.train:
            xy = xy * np.random.uniform(0.85, 1.15, size=(1, 1, 2)).astype(np.float32)
        x = np.concatenate([xy, c], -1).reshape(self.num_frames, -1)
        return torch.from_numpy(x), s["label"]


class ResBlock1d(nn.Module):
    def __init__(self, dim, dilation):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv1d(dim, dim, 3, padding=dilation, dilation=dilation), nn.BatchNorm1d(dim), nn.ReLU(inplace=True),
            nn.Dropout(0.1), nn.Conv1d(dim, dim, 3, padding=dilation, dilation=dilation), nn.BatchNorm1d(dim))

    def forward(self, x):
        return F.relu(x + self.body(x))


class PoseTCN(nn.Module):
    def __init__(self, in_dim, num_classes, dim=384):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(in_dim, dim, 1), nn.BatchNorm1d(dim), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(*[ResBlock1d(dim, d) for d in (1, 2, 4, 8, 1, 2, 4, 8)])
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x):
        h = self.blocks(self.stem(x.transpose(1, 2)))
        return self.fc(h.mean(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ann-dir", default="/data/msasl/MS-ASL")
    ap.add_argument("--openpose-dir", default="/data/msasl/openpose")
    ap.add_argument("--cache-dir", default="/data/msasl/cache")
    ap.add_argument("--subset", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--out", default="runs/msasl_tcn")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")
    device = torch.device("cuda", local_rank)

    train_set = PoseSequences(load_split("train", args), train=True)
    val_set = PoseSequences(load_split("val", args), train=False)
    logger.info("train %d / val %d sequences", len(train_set), len(val_set))

    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=128, num_workers=2)

    model = PoseTCN(54 * 3, args.subset)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f lr %.4f", epoch, step, loss.item(), sched.get_last_lr()[0])

        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                correct[0] += (model(x).argmax(-1) == y).sum()
                correct[1] += len(y)
        dist.all_reduce(correct)
        acc = (correct[0] / correct[1]).item()
        logger.info("epoch %d val acc %.2f", epoch, acc * 100)
        if rank == 0 and acc > best_acc:
            best_acc = acc
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                       os.path.join(args.out, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
