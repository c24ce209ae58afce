"""Row-anchor lane detection on TuSimple (UFLD-style ResNet-18, 100 gridding cells, 56 row anchors).

Launch (single node, 4 GPUs):
    torchrun --nproc_per_node=4 12_ufld_tusimple.py --root /data/tusimple --work-dir work/ufld_tusimple
"""
import argparse
import json
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
ROW_ANCHOR = list(range(64, 288, 4))  # 56 rows on the 288-pixel-high input
IMG_W, IMG_H = 1280, 720


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--work-dir", default="work/ufld_tusimple")
    ap.add_argument("--griding-num", type=int, default=100)
    ap.add_argument("--num-lanes", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--shp-w", type=float, default=0.1)
    ap.add_argument("--relation-w", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class TuSimpleRows(Dataset):
    def __init__(self, root, label_files, griding_num, num_lanes, train):
        self.root, self.gn, self.nl, self.train = root, griding_num, num_lanes, train
        self.items = []
        for lf in label_files:
            with open(os.path.join(root, lf)) as f:
                self.items += [json.loads(line) for line in f]
        self.rows = np.array(ROW_ANCHOR, np.float32) * IMG_H / 288.0
        self.mean = np.array([0.485, 0.456, 0.406], np.float32)
        self.std = np.array([0.229, 0.224, 0.225], np.float32)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        it = self.items[idx]
        img = cv2.imread(os.path.join(self.root, it["raw_file"]))[:, :, ::-1]
        h_samples = np.array(it["h_samples"], np.float32)
        lanes = [np.array(l, np.float32) for l in it["lanes"] if any(x >= 0 for x in l)][: self.nl]
        shift = 0
        if self.train:
            shift = np.random.randint(-100, 101)
            img = np.roll(img, shift, axis=1)
            if shift > 0:
                img[:, :shift] = 0
            elif shift < 0:
                img[:, shift:] = 0
        label = np.full((len(ROW_ANCHOR), self.nl), self.gn, np.int64)
        xs_abs = np.full((len(ROW_ANCHOR), self.nl), -1.0, np.float32)
        for k, lane in enumerate(lanes):
            valid = lane >= 0
            if valid.sum() < 2:
                continue
            xs = np.interp(self.rows, h_samples[valid], lane[valid] + shift, left=-1, right=-1)
            for r, x in enumerate(xs):
                if 0 <= x < IMG_W and h_samples[valid].min() <= self.rows[r] <= h_samples[valid].max():
                    label[r, k] = min(int(x / IMG_W * self.gn), self.gn - 1)
                    xs_abs[r, k] = x
        img = cv2.resize(np.ascontiguousarray(img), (800, 288)).astype(np.float32) / 255.0
        img = ((img - self.mean) / self.std).transpose(2, 0, 1)
        return torch.from_numpy(img), torch.from_numpy(label), torch.from_numpy(xs_abs)


class ShardSampler(Sampler):
    def __init__(self, n, rank, world):
        self.ids = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


class RowAnchorNet(nn.Module):
    def __init__(self, griding_num, num_rows, num_lanes):
        super().__init__()
        self.cls_dim = (griding_num + 1, num_rows, num_lanes)
        r = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.pool = nn.Conv2d(512, 8, 1)
        self.cls = nn.Sequential(nn.Linear(1800, 2048), nn.ReLU(inplace=True), nn.Linear(2048, int(np.prod(self.cls_dim))))

    def forward(self, x):
        f = self.pool(self.backbone(x)).flatten(1)
        return self.cls(f).view(-1, *self.cls_dim)


class RelationDisLoss(nn.Module):
    """Second-order smoothness of the expected lane position across neighbouring row anchors."""

    def __init__(self, griding_num):
        super().__init__()
        self.embedding = torch.arange(griding_num, dtype=torch.float32, device=DEVICE).view(1, -1, 1, 1)

    def forward(self, logits):
        prob = F.softmax(logits[:, :-1], dim=1)
        pos = (prob * self.embedding).sum(1)
        d = pos[:, :-1] - pos[:, 1:]
        return F.smooth_l1_loss(d[:, :-1], d[:, 1:])


class RelationLoss(nn.Module):
    def forward(self, logits):
        return F.l1_loss(logits[:, :, :-1], logits[:, :, 1:])


@torch.no_grad()
def evaluate(net, loader, griding_num, device):
    net.eval()
    stats = torch.zeros(2, device=device)
    cell = IMG_W / griding_num
    for img, _, xs_abs in loader:
        out = net(img.to(device))
        prob = F.softmax(out[:, :-1], 1)
        loc = (prob * torch.arange(griding_num, device=device).view(1, -1, 1, 1)).sum(1)
        x_pred = (loc + 0.5) * cell
        absent = out.argmax(1) == griding_num
        xs_abs = xs_abs.to(device)
        gt_valid = xs_abs >= 0
        hit = (~absent) & gt_valid & ((x_pred - xs_abs).abs() < 20)
        stats += torch.stack([hit.sum().float(), gt_valid.sum().float()])
    dist.all_reduce(stats)
    return (stats[0] / stats[1].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = TuSimpleRows(args.root, ["label_data_0313.json", "label_data_0531.json", "label_data_0601.json"],
                             args.griding_num, args.num_lanes, train=True)
    test_set = TuSimpleRows(args.root, ["test_label.json"], args.griding_num, args.num_lanes, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, 64, sampler=ShardSampler(len(test_set), rank, world), num_workers=4)

    net = RowAnchorNet(args.griding_num, len(ROW_ANCHOR), args.num_lanes).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=1e-4)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total, pct_start=0.02)

    ce = nn.CrossEntropyLoss()
    relation = RelationLoss()
    relation_dis = RelationDisLoss(args.griding_num)

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, (img, label, _) in enumerate(train_loader):
            img, label = img.to(device, non_blocking=True), label.to(device, non_blocking=True)
            out = model(img)
            loss = ce(out, label) + args.relation_w * relation(out)
            if args.shp_w > 0:
                loss = loss + args.shp_w * relation_dis(out)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 100 == 0:
                print(f"[{epoch}/{args.epochs}] {step}/{len(train_loader)} loss={loss.item():.4f}", flush=True)

        acc = evaluate(net, test_loader, args.griding_num, device)
        if rank == 0:
            print(f"epoch {epoch}: point accuracy {acc * 100:.2f}% ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.work_dir, "last.pth"))
            if acc > best_acc:
                best_acc = acc
                torch.save({"model": net.state_dict(), "epoch": epoch}, os.path.join(args.work_dir, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
