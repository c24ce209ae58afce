"""Quasi-dense appearance embedding for MOT17 (key / reference frame pairs, GT boxes only).

The embedding model is later plugged into our ByteTrack association as the re-ID cue.

torchrun --nproc_per_node=4 07_mot_quasidense_embed.py --mot-root /data/MOT17 --work-dir work/qd_embed_r50
"""
import argparse
import configparser
import os
import os.path as osp
import random
from collections import defaultdict

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torchvision.ops import roi_align
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

MAX_BOXES = 128
TRAIN_SEQS = ["MOT17-02", "MOT17-04", "MOT17-05", "MOT17-09", "MOT17-10", "MOT17-11"]
VAL_SEQS = ["MOT17-13"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--mot-root", default="/data/MOT17")
    p.add_argument("--work-dir", default="work/qd_embed_r50")
    p.add_argument("--img-size", type=int, nargs=2, default=[1088, 608])
    p.add_argument("--ref-range", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4, help="pairs per GPU")
    p.add_argument("--lr", type=float, default=0.02, help="SGD lr for 16 pairs per step")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--tau", type=float, default=0.07)
    return p.parse_args()


class PairDataset(Dataset):
    def __init__(self, root, seqs, img_size, ref_range, train=True):
        self.w, self.h = img_size
        self.ref_range, self.train = ref_range, train
        self.frames, self.boxes = [], {}
        for seq in seqs:
            d = osp.join(root, "train", f"{seq}-FRCNN")
            ini = configparser.ConfigParser()
            ini.read(osp.join(d, "seqinfo.ini"))
            n = int(ini["Sequence"]["seqLength"])
            gt = np.loadtxt(osp.join(d, "gt", "gt.txt"), delimiter=",")
            gt = gt[(gt[:, 6] == 1) & (gt[:, 7] == 1)]  # pedestrians that count
            per_frame = defaultdict(list)
            for f, tid, x, y, bw, bh in gt[:, :6]:
                per_frame[int(f)].append([x, y, x + bw, y + bh, tid])
            for f in range(1, n + 1):
                self.boxes[(d, f)] = np.array(per_frame[f], np.float32).reshape(-1, 5)
                self.frames.append((d, f, n))

    def __len__(self):
        return len(self.frames)

    def _load(self, d, f, flip):
        img = cv2.imread(osp.join(d, "img1", f"{f:06d}.jpg"))
        h0, w0 = img.shape[:2]
        img = cv2.resize(img, (self.w, self.h))
        boxes = self.boxes[(d, f)].copy()
        boxes[:, [0, 2]] *= self.w / w0
        boxes[:, [1, 3]] *= self.h / h0
        if flip:
            img = img[:, ::-1]
            boxes[:, [0, 2]] = self.w - boxes[:, [2, 0]]
        img = torch.from_numpy(np.ascontiguousarray(img[:, :, ::-1]).transpose(2, 0, 1).copy()).float()
        img = (img / 255.0 - torch.tensor([0.485, 0.456, 0.406])[:, None, None]) / torch.tensor([0.229, 0.224, 0.225])[:, None, None]
        padded = np.full((MAX_BOXES, 5), -1, np.float32)
        padded[:min(len(boxes), MAX_BOXES)] = boxes[:MAX_BOXES]
        return img, torch.from_numpy(padded)

    def __getitem__(self, i):
        d, f, n = self.frames[i]
        if self.train:
            rf = min(max(1, f + random.randint(-self.ref_range, self.ref_range)), n)
            flip = random.random() < 0.5
        else:
            rf, flip = min(f + 1, n), False
        key_img, key_boxes = self._load(d, f, flip)
        ref_img, ref_boxes = self._load(d, rf, flip)
        return key_img, key_boxes, ref_img, ref_boxes


class EmbedNet(nn.Module):
    def __init__(self, emb_dim=256, frozen_stages=1):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1")
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.layer1, self.layer2, self.layer3 = r.layer1, r.layer2, r.layer3
        for m in [self.stem, self.layer1][:frozen_stages + 1]:
            for p in m.parameters():
                p.requires_grad_(False)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                for p in m.parameters():
                    p.requires_grad_(False)
        self.reduce = nn.Conv2d(1024, 256, 1)
        convs = []
        for _ in range(4):
            convs += [nn.Conv2d(256, 256, 3, padding=1, bias=False), nn.GroupNorm(32, 256), nn.ReLU(inplace=True)]
        self.convs = nn.Sequential(*convs)
        self.fc = nn.Linear(256 * 7 * 7, 1024)
        self.embed = nn.Linear(1024, emb_dim)

    def train(self, mode=True):
        super().train(mode)
        # keep ImageNet BN statistics (norm_eval)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        return self

    def forward(self, img, boxes):
        x = self.layer3(self.layer2(self.layer1(self.stem(img))))
        x = self.reduce(x)
        valid = boxes[..., 4] >= 0
        batch_idx = torch.nonzero(valid)[:, 0].to(boxes.dtype)
        rois = torch.cat([batch_idx[:, None], boxes[valid][:, :4]], dim=1)
        feats = roi_align(x, rois, output_size=(7, 7), spatial_scale=1 / 16, sampling_ratio=2, aligned=True)
        feats = self.convs(feats).flatten(1)
        return self.embed(F.relu(self.fc(feats)))


def split_per_image(emb, boxes):
    counts = (boxes[..., 4] >= 0).sum(1).tolist()
    ids = [b[b[:, 4] >= 0, 4] for b in boxes]
    return list(torch.split(emb, counts)), ids


def quasi_dense_loss(key_emb, key_boxes, ref_emb, ref_boxes, tau):
    k_embs, k_ids = split_per_image(key_emb, key_boxes)
    r_embs, r_ids = split_per_image(ref_emb, ref_boxes)
    losses = []
    for ke, ki, re_, ri in zip(k_embs, k_ids, r_embs, r_ids):
        if len(ke) == 0 or len(re_) == 0:
            continue
        sim = ke @ re_.t() / tau
        pos = (ki[:, None] == ri[None, :]).float()
        has_pos = pos.sum(1) > 0
        if not has_pos.any():
            continue
        log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
        mp = -(log_prob * pos).sum(1) / pos.sum(1).clamp(min=1)
        cos = F.normalize(ke, dim=1) @ F.normalize(re_, dim=1).t()
        aux = ((cos - pos) ** 2).mean()
        losses.append(mp[has_pos].mean() + aux)
    if not losses:
        return key_emb.sum() * 0.0 + ref_emb.sum() * 0.0
    return torch.stack(losses).mean()


@torch.no_grad()
def match_accuracy(model, loader, device):
    model.eval()
    counts = torch.zeros(2, device=device)
    for key_img, key_boxes, ref_img, ref_boxes in loader:
        key_img, key_boxes = key_img.to(device), key_boxes.to(device)
        ref_img, ref_boxes = ref_img.to(device), ref_boxes.to(device)
        k_embs, k_ids = split_per_image(model(key_img, key_boxes), key_boxes)
        r_embs, r_ids = split_per_image(model(ref_img, ref_boxes), ref_boxes)
        for ke, ki, re_, ri in zip(k_embs, k_ids, r_embs, r_ids):
            if len(ke) == 0 or len(re_) == 0:
                continue
            best = (F.normalize(ke, dim=1) @ F.normalize(re_, dim=1).t()).argmax(1)
            has_match = (ki[:, None] == ri[None, :]).any(1)
            counts[0] += (ri[best] == ki)[has_match].sum()
            counts[1] += has_match.sum()
    dist.all_reduce(counts)
    return (counts[0] / counts[1].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = PairDataset(args.mot_root, TRAIN_SEQS, args.img_size, args.ref_range)
    val_set = PairDataset(args.mot_root, VAL_SEQS, args.img_size, args.ref_range, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=args.batch_size,
                            num_workers=6, pin_memory=True)

    model = DDP(EmbedNet().to(device), device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    lr = args.lr * args.batch_size * world / 16
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[8, 11], gamma=0.1)
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (key_img, key_boxes, ref_img, ref_boxes) in enumerate(train_loader):
            key_img, key_boxes = key_img.to(device, non_blocking=True), key_boxes.to(device, non_blocking=True)
            ref_img, ref_boxes = ref_img.to(device, non_blocking=True), ref_boxes.to(device, non_blocking=True)
            key_emb = model(key_img, key_boxes)
            ref_emb = model(ref_img, ref_boxes)
            loss = quasi_dense_loss(key_emb, key_boxes, ref_emb, ref_boxes, args.tau)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 35.0)
            optimizer.step()
            if it % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} [{it}/{len(train_loader)}] loss {l.item():.4f}", flush=True)
        scheduler.step()

        acc = match_accuracy(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val match accuracy {acc:.4f}", flush=True)
            torch.save({"state_dict": model.module.state_dict(), "epoch": epoch + 1, "val_acc": acc},
                       osp.join(args.work_dir, f"epoch_{epoch + 1}.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
