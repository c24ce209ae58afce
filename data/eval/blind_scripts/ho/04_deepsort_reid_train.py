"""Appearance (re-ID) model for a DeepSORT-style tracker, trained on MOT17 identity crops.

Validation runs the association step on the val-half with ground-truth boxes as
detections (oracle detections), so MOTA / ID switches only reflect the embedding.
"""
import argparse
import os
import random
from collections import defaultdict

import motmetrics as mm
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

CROP_TF = T.Compose([T.Resize((256, 128)), T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])


def load_gt(seq_dir, first=None, last=None):
    per_frame = defaultdict(list)
    for row in np.loadtxt(os.path.join(seq_dir, "gt", "gt.txt"), delimiter=","):
        fr, tid, x, y, w, h, mark, cls, vis = row[:9]
        if mark == 0 or cls != 1 or vis < 0.2:
            continue
        if (first and fr < first) or (last and fr > last):
            continue
        per_frame[int(fr)].append((int(tid), x, y, w, h))
    return per_frame


class MOTCrops(Dataset):
    def __init__(self, root, seqs):
        self.items, self.num_ids = [], 0
        self.tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                             T.ColorJitter(0.2, 0.2, 0.2), T.ToTensor(),
                             T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]), T.RandomErasing(p=0.5)])
        for seq in seqs:
            seq_dir = os.path.join(root, seq)
            n_frames = len(os.listdir(os.path.join(seq_dir, "img1")))
            gt = load_gt(seq_dir, last=n_frames // 2)
            local = {}
            for fr in sorted(gt):
                for tid, x, y, w, h in gt[fr][::2]:
                    if tid not in local:
                        local[tid] = self.num_ids + len(local)
                    self.items.append((os.path.join(seq_dir, "img1", f"{fr:06d}.jpg"), (x, y, w, h), local[tid]))
            self.num_ids += len(local)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, (x, y, w, h), pid = self.items[i]
        img = Image.open(path).convert("RGB").crop((x, y, x + w, y + h))
        return self.tf(img), pid


class ReIDNet(nn.Module):
    def __init__(self, num_ids, feat_dim=512):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.body = nn.Sequential(*list(r.children())[:-2])
        self.reduce = nn.Linear(2048, feat_dim, bias=False)
        self.bnneck = nn.BatchNorm1d(feat_dim)
        self.bnneck.bias.requires_grad_(False)
        self.classifier = nn.Linear(feat_dim, num_ids, bias=False)

    def forward(self, x):
        f = self.reduce(F.adaptive_avg_pool2d(self.body(x), 1).flatten(1))
        fn = self.bnneck(f)
        if self.training:
            return f, self.classifier(fn)
        return F.normalize(fn, dim=1)


def batch_hard_triplet(feat, pids, margin=0.3):
    d = torch.cdist(feat, feat)
    same = pids[:, None] == pids[None, :]
    hardest_pos = (d * same.float()).max(1).values
    hardest_neg = (d + same.float() * 1e4).min(1).values
    return F.relu(hardest_pos - hardest_neg + margin).mean()


@torch.no_grad()
def embed_boxes(net, img, boxes, device):
    if not boxes:
        return torch.zeros(0, 512, device=device)
    crops = torch.stack([CROP_TF(img.crop((x, y, x + w, y + h))) for _, x, y, w, h in boxes]).to(device)
    return net(crops)


@torch.no_grad()
def track_sequence(net, seq_dir, device, max_age=30, gate=0.4):
    n_frames = len(os.listdir(os.path.join(seq_dir, "img1")))
    gt = load_gt(seq_dir, first=n_frames // 2 + 1)
    acc = mm.MOTAccumulator(auto_id=True)
    tracks, next_id = {}, 1  # id -> (embedding, last_frame)
    for fr in range(n_frames // 2 + 1, n_frames + 1):
        boxes = gt.get(fr, [])
        img = Image.open(os.path.join(seq_dir, "img1", f"{fr:06d}.jpg")).convert("RGB")
        emb = embed_boxes(net, img, boxes, device)
        alive = [t for t, (_, last) in tracks.items() if fr - last <= max_age]
        hyp = [None] * len(boxes)
        if alive and len(boxes):
            cost = 1 - emb @ torch.stack([tracks[t][0] for t in alive]).T
            rows, cols = linear_sum_assignment(cost.cpu().numpy())
            for r, c in zip(rows, cols):
                if cost[r, c] < gate:
                    hyp[r] = alive[c]
        for i, h in enumerate(hyp):
            if h is None:
                h, next_id = next_id, next_id + 1
                hyp[i] = h
            old = tracks.get(h, (emb[i], fr))[0]
            tracks[h] = (F.normalize(0.9 * old + 0.1 * emb[i], dim=0), fr)
        gt_ids = [b[0] for b in boxes]
        xywh = np.array([b[1:] for b in boxes]).reshape(-1, 4)
        acc.update(gt_ids, hyp, mm.distances.iou_matrix(xywh, xywh, max_iou=0.5))
    return acc


def validate(net, root, seqs, rank, world, device):
    net.eval()
    mh = mm.metrics.create()
    fields = ["num_objects", "num_misses", "num_false_positives", "num_switches"]
    local = np.zeros(len(fields))
    for seq in seqs[rank::world]:
        acc = track_sequence(net, os.path.join(root, seq), device)
        summary = mh.compute(acc, metrics=fields, name=seq)
        local += summary.loc[seq, fields].to_numpy(dtype=np.float64)
    counts = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(counts)
    gt_total, fn, fp, idsw = counts.tolist()
    net.train()
    return {"MOTA": 1.0 - (fn + fp + idsw) / max(gt_total, 1.0), "IDSW": idsw}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/MOT17/train")
    ap.add_argument("--out", default="checkpoints/reid_mot17")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3.5e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(0)
    torch.manual_seed(0)

    seqs = sorted(s for s in os.listdir(args.root) if s.endswith("-FRCNN"))
    train_set = MOTCrops(args.root, seqs)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    model = ReIDNet(train_set.num_ids).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [30, 50], gamma=0.1)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for imgs, pids in loader:
            imgs, pids = imgs.to(device, non_blocking=True), pids.to(device, non_blocking=True)
            feat, logits = model(imgs)
            loss_id = F.cross_entropy(logits, pids, label_smoothing=0.1)
            loss_tri = batch_hard_triplet(feat, pids)
            loss = loss_id + loss_tri
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % 50 == 0:
                stats = torch.stack([loss_id.detach(), loss_tri.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("loss/id", stats[0].item(), step)
                    writer.add_scalar("loss/triplet", stats[1].item(), step)
        scheduler.step()

        if (epoch + 1) % 10 == 0:
            metrics = validate(model.module, args.root, seqs, rank, world, device)
            if rank == 0:
                print(f"epoch {epoch + 1}: MOTA {metrics['MOTA']:.3f} IDSW {metrics['IDSW']:.0f}", flush=True)
                writer.add_scalar("val/MOTA", metrics["MOTA"], epoch + 1)
                writer.add_scalar("val/IDSW", metrics["IDSW"], epoch + 1)
                os.makedirs(args.out, exist_ok=True)
                torch.save(model.module.state_dict(), os.path.join(args.out, f"reid_ep{epoch + 1}.pth"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
