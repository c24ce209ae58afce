# Row-anchor lane detection (Ultra-Fast-Lane-Detection style) on CULane.
# Distributed training:
#   python -m torch.distributed.run --nproc_per_node=4 05_ufld_culane_res18.py --data_root /data/CULane
import argparse
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

CULANE_ROW_ANCHOR = [121, 131, 141, 150, 160, 170, 180, 189, 199, 209, 219, 228,
                     238, 248, 258, 267, 277, 287]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True)
    p.add_argument("--log_path", default="./logs/culane_res18")
    p.add_argument("--backbone", default="18", choices=["18", "34", "50"])
    p.add_argument("--griding_num", type=int, default=200)
    p.add_argument("--num_lanes", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--epoch", type=int, default=50)
    p.add_argument("--learning_rate", type=float, default=0.1)
    p.add_argument("--weight_decay", type=float, default=1e-4)
    p.add_argument("--warmup_iters", type=int, default=695)
    p.add_argument("--sim_loss_w", type=float, default=0.0)
    p.add_argument("--exist_weight", type=float, default=0.0,
                   help="weight of the lane-existence BCE term (0 disables it)")
    p.add_argument("--num_workers", type=int, default=8)
    return p.parse_args()


class CULaneRowAnchor(Dataset):
    def __init__(self, root, list_file, griding_num, num_lanes, row_anchor, img_size=(800, 288)):
        self.root = root
        with open(os.path.join(root, list_file)) as f:
            self.entries = [l.split() for l in f if l.strip()]
        self.griding_num, self.num_lanes = griding_num, num_lanes
        self.row_anchor = np.array(row_anchor)
        self.img_w, self.img_h = img_size
        self.mean = np.array([0.485, 0.456, 0.406], np.float32)
        self.std = np.array([0.229, 0.224, 0.225], np.float32)

    def __len__(self):
        return len(self.entries)

    def _grid_label(self, seg):
        h, w = seg.shape
        rows = (self.row_anchor * h / 288.0).astype(int)
        label = np.full((len(rows), self.num_lanes), self.griding_num, np.int64)
        col_sample = np.linspace(0, w - 1, self.griding_num)
        for lane in range(1, self.num_lanes + 1):
            for r, y in enumerate(rows):
                xs = np.where(seg[y] == lane)[0]
                if len(xs) == 0:
                    continue
                label[r, lane - 1] = int(np.argmin(np.abs(col_sample - xs.mean())))
        return label

    def __getitem__(self, idx):
        img_rel, seg_rel = self.entries[idx][0], self.entries[idx][1]
        exist = np.array([int(v) for v in self.entries[idx][2:2 + self.num_lanes]], np.float32)
        img = cv2.imread(self.root + img_rel)[:, :, ::-1]
        seg = cv2.imread(self.root + seg_rel, cv2.IMREAD_GRAYSCALE)
        # random horizontal shift + small vertical shift, applied to both image and label
        dx, dy = np.random.randint(-200, 201), np.random.randint(-10, 11)
        M = np.float32([[1, 0, dx], [0, 1, dy]])
        img = cv2.warpAffine(np.ascontiguousarray(img), M, (img.shape[1], img.shape[0]))
        seg = cv2.warpAffine(seg, M, (seg.shape[1], seg.shape[0]), flags=cv2.INTER_NEAREST)
        cls_label = self._grid_label(seg)
        img = cv2.resize(img, (self.img_w, self.img_h)).astype(np.float32) / 255.0
        img = ((img - self.mean) / self.std).transpose(2, 0, 1)
        return torch.from_numpy(img), torch.from_numpy(cls_label), torch.from_numpy(exist)


class ParsingNet(nn.Module):
    def __init__(self, backbone="18", griding_num=200, cls_dim=(201, 18, 4)):
        super().__init__()
        self.cls_dim = cls_dim
        net = getattr(torchvision.models, f"resnet{backbone}")(weights="IMAGENET1K_V1")
        self.model = nn.Sequential(*list(net.children())[:-2])
        in_ch = 2048 if backbone == "50" else 512
        self.pool = nn.Conv2d(in_ch, 8, 1)
        total_dim = int(np.prod(cls_dim))
        self.cls = nn.Sequential(nn.Linear(1800, 2048), nn.ReLU(), nn.Linear(2048, total_dim))
        self.exist = nn.Sequential(nn.Linear(1800, 128), nn.ReLU(), nn.Linear(128, cls_dim[-1]))

    def forward(self, x):
        fea = self.pool(self.model(x)).view(x.size(0), -1)
        group_cls = self.cls(fea).view(-1, *self.cls_dim)
        return group_cls, self.exist(fea)


def similarity_loss(logits):
    # adjacent row anchors should give similar distributions over grid cells
    p = F.softmax(logits, dim=1)
    return F.l1_loss(p[:, :, :-1], p[:, :, 1:])


def lane_accuracy(cls_out, cls_label, griding_num):
    pred = cls_out.argmax(1)
    valid = cls_label != griding_num
    correct = ((pred == cls_label) & valid).sum()
    return correct.float(), valid.sum().float()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.backends.cudnn.benchmark = True

    train_set = CULaneRowAnchor(args.data_root, "list/train_gt.txt", args.griding_num, args.num_lanes, CULANE_ROW_ANCHOR)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True)

    cls_dim = (args.griding_num + 1, len(CULANE_ROW_ANCHOR), args.num_lanes)
    net = ParsingNet(args.backbone, args.griding_num, cls_dim).cuda()
    net = DistributedDataParallel(net, device_ids=[local_rank])

    # scale the base LR (given for a global batch of 32) to the real global batch
    lr = args.learning_rate * args.batch_size * world_size / 32
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=args.weight_decay)
    total_iters = args.epoch * len(loader)

    def lr_at(it):
        if it < args.warmup_iters:
            return lr * (it + 1) / args.warmup_iters
        return lr * 0.5 * (1 + np.cos(np.pi * (it - args.warmup_iters) / (total_iters - args.warmup_iters)))

    writer = SummaryWriter(args.log_path) if rank == 0 else None
    global_step = 0
    for epoch in range(args.epoch):
        sampler.set_epoch(epoch)
        net.train()
        t_data = time.time()
        for img, cls_label, exist in loader:
            img = img.cuda(non_blocking=True)
            cls_label = cls_label.cuda(non_blocking=True)
            exist = exist.cuda(non_blocking=True)
            for g in optimizer.param_groups:
                g["lr"] = lr_at(global_step)

            cls_out, exist_out = net(img)
            loss = F.cross_entropy(cls_out, cls_label)
            if args.sim_loss_w > 0:
                loss = loss + args.sim_loss_w * similarity_loss(cls_out)
            if args.exist_weight > 0:
                loss = loss + args.exist_weight * F.binary_cross_entropy_with_logits(exist_out, exist)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            global_step += 1

            if global_step % 20 == 0:
                correct, total = lane_accuracy(cls_out.detach(), cls_label, args.griding_num)
                stats = torch.stack([loss.detach(), correct, total])
                dist.all_reduce(stats)
                if writer is not None:
                    writer.add_scalar("loss/total", stats[0].item() / world_size, global_step)
                    writer.add_scalar("metric/top1", (stats[1] / stats[2].clamp(min=1)).item(), global_step)
                    writer.add_scalar("meta/lr", optimizer.param_groups[0]["lr"], global_step)
        if rank == 0:
            print(f"epoch {epoch} finished, {time.time() - t_data:.0f}s", flush=True)
            torch.save({"model": net.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.log_path, "ep%03d.pth" % epoch))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
