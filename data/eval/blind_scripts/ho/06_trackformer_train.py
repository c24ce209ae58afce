"""TrackFormer-style training on frame pairs (previous frame -> current frame).

Queries matched to objects in the previous frame are passed as track queries into the
current frame. Track queries are augmented with false negatives (dropped) and false
positives (queries of unmatched background), as in the paper.

Tracking results of the val-half are written as MOTChallenge txt files and scored with
motmetrics.
"""
import argparse
import glob
import os
import random
import time

import motmetrics as mm
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms.functional as TF
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.ops import box_convert, box_iou, generalized_box_iou

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def read_gt(seq_dir):
    gt = {}
    for r in np.loadtxt(os.path.join(seq_dir, "gt", "gt.txt"), delimiter=",", ndmin=2):
        if r[6] == 0 or r[7] != 1:
            continue
        gt.setdefault(int(r[0]), []).append((int(r[1]), r[2], r[3], r[2] + r[4], r[3] + r[5]))
    return gt


def load_img(path):
    img = Image.open(path).convert("RGB")
    w, h = img.size
    return TF.normalize(TF.to_tensor(TF.resize(img, 800, max_size=1333)), MEAN, STD), (w, h)


class FramePairs(Dataset):
    def __init__(self, root, seqs, half="train", max_gap=5):
        self.samples, self.gts, self.max_gap = [], {}, max_gap
        for s in seqs:
            d = os.path.join(root, s)
            n = len(glob.glob(os.path.join(d, "img1", "*.jpg")))
            self.gts[d] = read_gt(d)
            rng = range(2, n // 2 + 1) if half == "train" else range(n // 2 + 2, n + 1)
            self.samples += [(d, f) for f in rng]

    def __len__(self):
        return len(self.samples)

    def target(self, d, f, wh):
        rows = self.gts[d].get(f, [])
        b = torch.tensor([r[1:] for r in rows], dtype=torch.float32).reshape(-1, 4)
        b = box_convert(b, "xyxy", "cxcywh") / torch.tensor([*wh, *wh], dtype=torch.float32)
        return {"boxes": b, "ids": torch.tensor([r[0] for r in rows], dtype=torch.long)}

    def __getitem__(self, i):
        d, f = self.samples[i]
        prev_f = max(1, f - random.randint(1, self.max_gap))
        prev, wh = load_img(os.path.join(d, "img1", f"{prev_f:06d}.jpg"))
        cur, _ = load_img(os.path.join(d, "img1", f"{f:06d}.jpg"))
        return prev, cur, self.target(d, prev_f, wh), self.target(d, f, wh)


def collate(batch):
    return [list(x) for x in zip(*batch)]


class Tracker(nn.Module):
    def __init__(self, num_queries=300, dim=256):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.proj = nn.Conv2d(2048, dim, 1)
        self.row = nn.Embedding(64, dim // 2)
        self.col = nn.Embedding(64, dim // 2)
        self.transformer = nn.Transformer(dim, 8, 6, 6, 2048, 0.1, batch_first=True)
        self.query = nn.Embedding(num_queries, dim)
        self.cls = nn.Linear(dim, 2)
        self.box = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 4))

    def forward(self, img, track_q=None):
        f = self.proj(self.backbone(img[None]))
        h, w = f.shape[-2:]
        pos = torch.cat([self.col.weight[:w][None].expand(h, -1, -1), self.row.weight[:h][:, None].expand(-1, w, -1)], -1)
        src = (f[0].permute(1, 2, 0) + pos).reshape(1, h * w, -1)
        q = self.query.weight[None]
        if track_q is not None and len(track_q):
            q = torch.cat([track_q[None], q], 1)
        hs = self.transformer(src, q)[0]
        return self.cls(hs), self.box(hs).sigmoid(), hs


def set_loss(logits, boxes, tgt, fixed):
    """fixed: {query_idx: gt_idx} for track queries; the rest is Hungarian-matched."""
    n_gt = len(tgt["ids"])
    used = set(fixed.values())
    free_q = [q for q in range(len(logits)) if q not in fixed]
    free_g = [g for g in range(n_gt) if g not in used]
    pairs = dict(fixed)
    if free_g:
        pb, gb = boxes[free_q], tgt["boxes"][free_g]
        cost = 5 * torch.cdist(pb, gb, p=1) - 2 * generalized_box_iou(box_convert(pb, "cxcywh", "xyxy"), box_convert(gb, "cxcywh", "xyxy"))
        cost -= 2 * logits[free_q].softmax(-1)[:, :1]
        r, c = linear_sum_assignment(cost.detach().cpu())
        pairs.update({free_q[i]: free_g[j] for i, j in zip(r, c)})
    labels = torch.ones(len(logits), dtype=torch.long, device=logits.device)
    loss = boxes.sum() * 0
    if pairs:
        q = torch.tensor(list(pairs.keys()), device=logits.device)
        g = torch.tensor(list(pairs.values()), device=logits.device)
        labels[q] = 0
        pb, gb = boxes[q], tgt["boxes"][g]
        loss = loss + 5 * F.l1_loss(pb, gb) + 2 * (1 - torch.diag(generalized_box_iou(box_convert(pb, "cxcywh", "xyxy"), box_convert(gb, "cxcywh", "xyxy")))).mean()
    w = torch.tensor([1.0, 0.1], device=logits.device)
    return loss + 2 * F.cross_entropy(logits, labels, w), pairs


def pair_loss(model, prev, cur, t_prev, t_cur, fn_prob=0.4, fp_prob=0.1):
    logits, boxes, hs = model(prev)
    loss_prev, pairs = set_loss(logits, boxes, t_prev, {})
    # track queries: matched previous-frame queries (some dropped), plus a few background queries
    kept = [(q, int(t_prev["ids"][g])) for q, g in pairs.items() if random.random() > fn_prob]
    bg = [q for q in range(len(logits)) if q not in pairs and random.random() < fp_prob * len(kept) / len(logits)]
    track_idx = [q for q, _ in kept] + bg
    track_q = hs[track_idx].detach() if track_idx else None
    cur_ids = t_cur["ids"].tolist()
    fixed = {i: cur_ids.index(tid) for i, (_, tid) in enumerate(kept) if tid in cur_ids}
    logits, boxes, _ = model(cur, track_q)
    loss_cur, _ = set_loss(logits, boxes, t_cur, fixed)
    return loss_prev + loss_cur


class TwoFrameWrapper(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, prevs, curs, t_prevs, t_curs):
        losses = [pair_loss(self.net, p, c, tp, tc) for p, c, tp, tc in zip(prevs, curs, t_prevs, t_curs)]
        return torch.stack(losses).mean()


@torch.no_grad()
def track_sequence(net, seq_dir, out_file, det_thr=0.5, keep_thr=0.4):
    n = len(glob.glob(os.path.join(seq_dir, "img1", "*.jpg")))
    tracks, next_id, lines = {}, 1, []  # id -> embedding of the last frame
    for f in range(n // 2 + 1, n + 1):
        img, (W, H) = load_img(os.path.join(seq_dir, "img1", f"{f:06d}.jpg"))
        ids = list(tracks)
        track_q = torch.stack([tracks[i] for i in ids]) if ids else None
        logits, boxes, hs = net(img.cuda(), track_q)
        scores = logits.softmax(-1)[:, 0]
        boxes = box_convert(boxes, "cxcywh", "xyxy") * torch.tensor([W, H, W, H], device=boxes.device)
        new_tracks = {}
        for k, tid in enumerate(ids):
            if scores[k] > keep_thr:
                new_tracks[tid] = hs[k]
                lines.append((f, tid, boxes[k]))
        det = len(ids) + torch.nonzero(scores[len(ids):] > det_thr).flatten()
        if len(lines) and len(det):
            prev_boxes = torch.stack([b for fr, _, b in lines if fr == f]) if new_tracks else None
            if prev_boxes is not None:
                det = det[box_iou(boxes[det], prev_boxes).max(1).values < 0.7]
        for k in det.tolist():
            new_tracks[next_id] = hs[k]
            lines.append((f, next_id, boxes[k]))
            next_id += 1
        tracks = new_tracks
    with open(out_file, "w") as fh:
        for f, tid, b in lines:
            x1, y1, x2, y2 = b.tolist()
            fh.write(f"{f},{tid},{x1:.1f},{y1:.1f},{x2 - x1:.1f},{y2 - y1:.1f},1,-1,-1,-1\n")


def mot_eval(root, seqs, res_dir):
    accs = []
    for s in seqs:
        gt = mm.io.loadtxt(os.path.join(root, s, "gt", "gt.txt"), fmt="mot15-2D", min_confidence=1)
        n = len(glob.glob(os.path.join(root, s, "img1", "*.jpg")))
        gt = gt[gt.index.get_level_values(0) > n // 2]
        ts = mm.io.loadtxt(os.path.join(res_dir, f"{s}.txt"), fmt="mot15-2D")
        accs.append(mm.utils.compare_to_groundtruth(gt, ts, "iou", distth=0.5))
    mh = mm.metrics.create()
    summary = mh.compute_many(accs, names=seqs, metrics=["mota", "idf1", "num_switches"], generate_overall=True)
    return summary.loc["OVERALL"].to_dict()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mot-root", default="/data/MOT17/train")
    p.add_argument("--out", default="outputs/trackformer_mot17")
    p.add_argument("--pretrained", default="weights/detr_r50_crowdhuman.pth")
    p.add_argument("--resume", default="")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=2)
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)

    seqs = sorted(s for s in os.listdir(args.mot_root) if s.endswith("FRCNN"))
    dataset = FramePairs(args.mot_root, seqs, "train")
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=6, collate_fn=collate, pin_memory=True)

    net = Tracker()
    if args.pretrained and not args.resume:
        state = torch.load(args.pretrained, map_location="cpu")["model"]
        missing, unexpected = net.load_state_dict(state, strict=False)
        if rank == 0:
            print(f"loaded detector weights, missing={len(missing)} unexpected={len(unexpected)}")
    model = DDP(TwoFrameWrapper(net).cuda(), device_ids=[local_rank])
    optimizer = torch.optim.AdamW([{"params": [p for n, p in net.named_parameters() if not n.startswith("backbone")]},
                                   {"params": [p for n, p in net.named_parameters() if n.startswith("backbone")], "lr": args.lr * 0.1}],
                                  lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30)

    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume)
        net.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["lr_scheduler"])
        start_epoch = checkpoint["epoch"] + 1

    res_dir = os.path.join(args.out, "val_half")
    if rank == 0:
        os.makedirs(res_dir, exist_ok=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for it, (prevs, curs, t_prevs, t_curs) in enumerate(loader):
            prevs = [x.cuda(non_blocking=True) for x in prevs]
            curs = [x.cuda(non_blocking=True) for x in curs]
            t_prevs = [{k: v.cuda() for k, v in t.items()} for t in t_prevs]
            t_curs = [{k: v.cuda() for k, v in t.items()} for t in t_curs]
            loss = model(prevs, curs, t_prevs, t_curs)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            if it % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {it}/{len(loader)} loss {l.item():.4f}", flush=True)
        scheduler.step()
        if rank == 0:
            print(f"epoch {epoch} took {time.time() - tic:.0f}s", flush=True)
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "lr_scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "checkpoint.pth"))

        if (epoch + 1) % 5 == 0:
            net.eval()
            dist.barrier()
            for s in seqs[rank::world]:
                track_sequence(net, os.path.join(args.mot_root, s), os.path.join(res_dir, f"{s}.txt"))
            net.train()
            dist.barrier()
            if rank == 0:
                m = mot_eval(args.mot_root, seqs, res_dir)
                print(f"epoch {epoch} val-half MOTA {m['mota']:.3f} IDF1 {m['idf1']:.3f} IDSW {m['num_switches']:.0f}", flush=True)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
