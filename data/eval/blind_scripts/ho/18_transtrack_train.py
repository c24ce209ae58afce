"""TransTrack-style joint detection and tracking on MOT17 (half split).

Two decoders share the encoder memory of the current frame: the detection decoder uses
learned object queries, the tracking decoder uses the previous frame's object features
as queries and predicts where those objects are now. Boxes from the two decoders are
associated by IoU matching.
"""
import argparse
import glob
import logging
import os
import random

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
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.ops import box_convert, box_iou, generalized_box_iou

logger = logging.getLogger(__name__)


def gt_table(seq_dir):
    arr = np.loadtxt(os.path.join(seq_dir, "gt", "gt.txt"), delimiter=",")
    arr = arr[(arr[:, 6] == 1) & (arr[:, 7] == 1)]
    return {int(f): arr[arr[:, 0] == f][:, 1:6] for f in np.unique(arr[:, 0])}


def load(path):
    im = Image.open(path).convert("RGB")
    W, H = im.size
    return TF.normalize(TF.to_tensor(TF.resize(im, [640, 1152])), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]), (W, H)


class AdjacentFrames(Dataset):
    def __init__(self, root, seqs):
        self.samples, self.gt = [], {}
        for s in seqs:
            d = os.path.join(root, s)
            n = len(glob.glob(os.path.join(d, "img1", "*.jpg")))
            self.gt[d] = gt_table(d)
            self.samples += [(d, f) for f in range(2, n // 2 + 1)]

    def __len__(self):
        return len(self.samples)

    def tgt(self, d, f, W, H):
        rows = self.gt[d].get(f, np.zeros((0, 5)))
        b = torch.tensor(rows[:, 1:5], dtype=torch.float32)
        b = torch.cat([b[:, :2] + b[:, 2:] / 2, b[:, 2:]], 1) / torch.tensor([W, H, W, H])
        return {"boxes": b, "ids": torch.tensor(rows[:, 0], dtype=torch.long)}

    def __getitem__(self, i):
        d, f = self.samples[i]
        p = f - random.randint(1, min(3, f - 1))
        prev, (W, H) = load(os.path.join(d, "img1", f"{p:06d}.jpg"))
        cur, _ = load(os.path.join(d, "img1", f"{f:06d}.jpg"))
        return prev, cur, self.tgt(d, p, W, H), self.tgt(d, f, W, H)


def collate(b):
    prev, cur, tp, tc = zip(*b)
    return torch.stack(prev), torch.stack(cur), list(tp), list(tc)


class TransTrack(nn.Module):
    def __init__(self, dim=256, num_queries=300):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.proj = nn.Conv2d(2048, dim, 1)
        self.pos = nn.Parameter(torch.randn(1, 20 * 36, dim) * 0.02)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, 8, 1024, 0.1, batch_first=True), 6)
        self.det_decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 1024, 0.1, batch_first=True), 6)
        self.track_decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 1024, 0.1, batch_first=True), 6)
        self.queries = nn.Embedding(num_queries, dim)
        self.cls = nn.Linear(dim, 1)
        self.box = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 4))

    def encode(self, img):
        src = self.proj(self.backbone(img)).flatten(2).transpose(1, 2)
        return self.encoder(src + self.pos[:, : src.shape[1]])

    def detect(self, memory):
        hs = self.det_decoder(self.queries.weight[None].expand(memory.shape[0], -1, -1), memory)
        return hs, self.cls(hs)[..., 0], self.box(hs).sigmoid()

    def track_frame(self, memory, prev_hs):
        hs = self.track_decoder(prev_hs, memory)
        return self.cls(hs)[..., 0], self.box(hs).sigmoid()

    def forward(self, prev, cur):
        prev_hs, p_logits, p_boxes = self.detect(self.encode(prev))
        mem = self.encode(cur)
        _, c_logits, c_boxes = self.detect(mem)
        t_logits, t_boxes = self.track_frame(mem, prev_hs)
        return (p_logits, p_boxes), (c_logits, c_boxes), (t_logits, t_boxes)


def hungarian(logits, boxes, gt):
    if len(gt) == 0:
        return np.array([], dtype=int), np.array([], dtype=int)
    cost = 5 * torch.cdist(boxes, gt, p=1) - 2 * generalized_box_iou(box_convert(boxes, "cxcywh", "xyxy"), box_convert(gt, "cxcywh", "xyxy")) - 2 * logits.sigmoid()[:, None]
    return linear_sum_assignment(cost.detach().cpu())


def det_loss(logits, boxes, gt, r, c):
    tgt = torch.zeros_like(logits)
    tgt[r] = 1
    loss = 2 * torchvision.ops.sigmoid_focal_loss(logits, tgt, reduction="sum") / max(len(r), 1) + boxes.sum() * 0
    if len(r):
        loss = loss + 5 * F.l1_loss(boxes[r], gt[c]) + 2 * (1 - generalized_box_iou(box_convert(boxes[r], "cxcywh", "xyxy"), box_convert(gt[c], "cxcywh", "xyxy")).diag()).mean()
    return loss


def compute_loss(outs, tp, tc):
    (pl, pb), (cl, cb), (tl, tb) = outs
    total = 0.0
    for b in range(len(tp)):
        r, c = hungarian(pl[b], pb[b], tp[b]["boxes"])
        total = total + det_loss(pl[b], pb[b], tp[b]["boxes"], r, c)
        r2, c2 = hungarian(cl[b], cb[b], tc[b]["boxes"])
        total = total + det_loss(cl[b], cb[b], tc[b]["boxes"], r2, c2)
        # track query k inherits the identity its previous-frame query was matched to
        cur_ids = tc[b]["ids"].tolist()
        tr, tcol = [], []
        for q, g in zip(r, c):
            tid = int(tp[b]["ids"][g])
            if tid in cur_ids:
                tr.append(q)
                tcol.append(cur_ids.index(tid))
        total = total + det_loss(tl[b], tb[b], tc[b]["boxes"], np.array(tr, dtype=int), np.array(tcol, dtype=int))
    return total / len(tp)


@torch.no_grad()
def run_sequence(model, seq_dir, out_txt, thr=0.5):
    n = len(glob.glob(os.path.join(seq_dir, "img1", "*.jpg")))
    prev_hs, prev_ids, next_id, lines = None, [], 1, []
    for f in range(n // 2 + 1, n + 1):
        img, (W, H) = load(os.path.join(seq_dir, "img1", f"{f:06d}.jpg"))
        mem = model.encode(img[None].cuda())
        hs, dl, db = model.detect(mem)
        keep = dl[0].sigmoid() > thr
        det_boxes = box_convert(db[0][keep], "cxcywh", "xyxy")
        det_ids = [None] * len(det_boxes)
        if prev_hs is not None and len(prev_ids):
            tl, tb = model.track_frame(mem, prev_hs)
            t_boxes = box_convert(tb[0], "cxcywh", "xyxy")
            if len(det_boxes):
                iou = box_iou(det_boxes, t_boxes)
                r, c = linear_sum_assignment(-iou.cpu().numpy())
                for i, j in zip(r, c):
                    if iou[i, j] > 0.5:
                        det_ids[i] = prev_ids[j]
        for i in range(len(det_ids)):
            if det_ids[i] is None:
                det_ids[i], next_id = next_id, next_id + 1
            x1, y1, x2, y2 = (det_boxes[i] * torch.tensor([W, H, W, H], device=det_boxes.device)).tolist()
            lines.append(f"{f},{det_ids[i]},{x1:.1f},{y1:.1f},{x2 - x1:.1f},{y2 - y1:.1f},1,-1,-1,-1\n")
        prev_hs, prev_ids = hs[:, keep], det_ids
    with open(out_txt, "w") as fh:
        fh.writelines(lines)


def evaluate(model, root, seqs, out_dir, rank, world):
    model.eval()
    for s in seqs[rank::world]:
        run_sequence(model, os.path.join(root, s), os.path.join(out_dir, f"{s}.txt"))
    model.train()
    dist.barrier()
    if rank != 0:
        return None
    accs = []
    for s in seqs:
        n = len(glob.glob(os.path.join(root, s, "img1", "*.jpg")))
        gt = mm.io.loadtxt(os.path.join(root, s, "gt", "gt.txt"), fmt="mot15-2D", min_confidence=1)
        gt = gt[gt.index.get_level_values(0) > n // 2]
        accs.append(mm.utils.compare_to_groundtruth(gt, mm.io.loadtxt(os.path.join(out_dir, f"{s}.txt"), fmt="mot15-2D"), "iou", distth=0.5))
    mh = mm.metrics.create()
    return mh.compute_many(accs, names=seqs, metrics=["mota", "idf1"], generate_overall=True).loc["OVERALL"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/MOT17/train")
    ap.add_argument("--output", default="out/transtrack_mot17_half")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    res_dir = os.path.join(args.output, "val")
    if rank == 0:
        os.makedirs(res_dir, exist_ok=True)

    seqs = sorted(s for s in os.listdir(args.root) if "FRCNN" in s)
    dataset = AdjacentFrames(args.root, seqs)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=6, collate_fn=collate, drop_last=True)

    model = TransTrack().cuda()
    model = DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 15)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for it, (prev, cur, tp, tc) in enumerate(loader):
            prev, cur = prev.cuda(non_blocking=True), cur.cuda(non_blocking=True)
            tp = [{k: v.cuda() for k, v in t.items()} for t in tp]
            tc = [{k: v.cuda() for k, v in t.items()} for t in tc]
            loss = compute_loss(model(prev, cur), tp, tc)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            if it % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l)
                logger.info("epoch %d it %d/%d loss %.4f", epoch, it, len(loader), l.item() / world)
        scheduler.step()
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.output, "checkpoint.pth"))
        if (epoch + 1) % args.eval_every == 0:
            summary = evaluate(model, args.root, seqs, res_dir, rank, world)
            if rank == 0:
                logger.info("epoch %d val-half MOTA %.3f IDF1 %.3f", epoch, summary["mota"], summary["idf1"])
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
