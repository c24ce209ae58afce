"""QDTrack-style quasi-dense similarity learning on DanceTrack.

Faster R-CNN detector + an embedding head trained with a multi-positive contrastive loss
between RoIs of a key frame and a reference frame. Parsed annotations are cached as a
pickle next to the data so the slow gt.txt / seqinfo.ini parsing happens once.
"""
import argparse
import configparser
import glob
import os
import pickle
import random
import time

import motmetrics as mm
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.detection import fasterrcnn_resnet50_fpn
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.ops import MultiScaleRoIAlign, box_iou
from torchvision.transforms.functional import to_tensor


def parse_split(split_dir):
    db = {}
    for seq_dir in sorted(glob.glob(os.path.join(split_dir, "*"))):
        ini = configparser.ConfigParser()
        ini.read(os.path.join(seq_dir, "seqinfo.ini"))
        n = int(ini["Sequence"]["seqLength"])
        frames = {f: [] for f in range(1, n + 1)}
        gt_file = os.path.join(seq_dir, "gt", "gt.txt")
        if os.path.exists(gt_file):
            for line in open(gt_file):
                f, tid, x, y, w, h = [float(v) for v in line.split(",")[:6]]
                frames[int(f)].append((int(tid), x, y, x + w, y + h))
        db[os.path.basename(seq_dir)] = {"dir": seq_dir, "length": n, "frames": frames}
    return db


def load_annotations(split_dir):
    cache_file = os.path.join(split_dir, ".qdtrack_cache.pkl")
    if os.path.exists(cache_file):
        with open(cache_file, "rb") as f:
            return pickle.load(f)
    db = parse_split(split_dir)
    with open(cache_file, "wb") as f:
        pickle.dump(db, f)
    return db


class KeyRefFrames(Dataset):
    def __init__(self, db, ref_range=10):
        self.db, self.ref_range = db, ref_range
        self.index = [(s, f) for s, v in db.items() for f in range(1, v["length"] + 1) if v["frames"][f]]

    def __len__(self):
        return len(self.index)

    def _load(self, seq, f):
        v = self.db[seq]
        img = to_tensor(Image.open(os.path.join(v["dir"], "img1", f"{f:08d}.jpg")).convert("RGB"))
        rows = v["frames"][f]
        return img, {"boxes": torch.tensor([r[1:] for r in rows], dtype=torch.float32).reshape(-1, 4),
                     "labels": torch.ones(len(rows), dtype=torch.int64),
                     "ids": torch.tensor([r[0] for r in rows], dtype=torch.int64)}

    def __getitem__(self, i):
        seq, f = self.index[i]
        n = self.db[seq]["length"]
        cands = [r for r in range(max(1, f - self.ref_range), min(n, f + self.ref_range) + 1) if r != f and self.db[seq]["frames"][r]]
        r = random.choice(cands) if cands else f
        return self._load(seq, f), self._load(seq, r)


class QDTrack(nn.Module):
    def __init__(self, emb_dim=256):
        super().__init__()
        self.det = fasterrcnn_resnet50_fpn(weights="DEFAULT", min_size=800, max_size=1440)
        self.det.roi_heads.box_predictor = FastRCNNPredictor(1024, 2)
        self.roi = MultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2)
        convs = []
        for _ in range(4):
            convs += [nn.Conv2d(256, 256, 3, padding=1), nn.GroupNorm(32, 256), nn.ReLU(inplace=True)]
        self.embed = nn.Sequential(*convs, nn.Flatten(), nn.Linear(256 * 49, 1024), nn.ReLU(inplace=True), nn.Linear(1024, emb_dim))

    @staticmethod
    def sample_rois(gt_boxes, n=64, jitter=0.1):
        wh = (gt_boxes[:, 2:] - gt_boxes[:, :2]).repeat(1, 2)
        noise = (torch.rand(len(gt_boxes), n // max(len(gt_boxes), 1) + 1, 4, device=gt_boxes.device) * 2 - 1) * jitter
        return torch.cat([gt_boxes, (gt_boxes[:, None] + noise * wh[:, None]).reshape(-1, 4)])

    def embed_rois(self, feats, boxes, sizes):
        return self.embed(self.roi(feats, boxes, sizes))

    def forward(self, key_imgs, key_tgts, ref_imgs, ref_tgts):
        images, targets = self.det.transform(key_imgs, key_tgts)
        feats = self.det.backbone(images.tensors)
        proposals, rpn_losses = self.det.rpn(images, feats, targets)
        _, roi_losses = self.det.roi_heads(feats, proposals, images.image_sizes, targets)
        ref_images, ref_targets = self.det.transform(ref_imgs, ref_tgts)
        ref_feats = self.det.backbone(ref_images.tensors)
        key_rois = [self.sample_rois(t["boxes"]) for t in targets]
        key_emb = self.embed_rois(feats, key_rois, images.image_sizes).split([len(r) for r in key_rois])
        ref_emb = self.embed_rois(ref_feats, [t["boxes"] for t in ref_targets], ref_images.image_sizes).split([len(t["boxes"]) for t in ref_targets])
        loss_emb = loss_aux = torch.cat(key_emb).sum() * 0.0
        for rois, ke, re_, kt, rt in zip(key_rois, key_emb, ref_emb, targets, ref_targets):
            iou, gi = box_iou(rois, kt["boxes"]).max(1)
            pos = iou > 0.7
            roi_ids = torch.where(pos, kt["ids"][gi], torch.full_like(gi, -1))
            tgt = (roi_ids[:, None] == rt["ids"][None]).float()
            sim = ke @ re_.T
            valid = tgt.sum(1) > 0
            if valid.any():
                # multi-positive cross entropy: log(1 + sum_neg sum_pos exp(neg - pos))
                s, t = sim[valid], tgt[valid]
                pos_s = s.masked_fill(t == 0, float("inf"))
                neg_s = s.masked_fill(t == 1, float("-inf"))
                diff = neg_s[:, None, :] - pos_s[:, :, None]
                loss_emb = loss_emb + torch.logsumexp(F.pad(diff.flatten(1), (0, 1), value=0.0), 1).mean()
                cos = F.normalize(ke[valid], dim=1) @ F.normalize(re_, dim=1).T
                loss_aux = loss_aux + F.mse_loss(cos, t)
        n = len(targets)
        return {**rpn_losses, **roi_losses, "loss_emb": 0.25 * loss_emb / n, "loss_aux": loss_aux / n}


@torch.no_grad()
def track_seq(model, seq, out_file, det_thr=0.5, match_thr=0.5, memo=0.8):
    tracks, next_id, rows = {}, 1, []
    for f in range(1, seq["length"] + 1):
        x = to_tensor(Image.open(os.path.join(seq["dir"], "img1", f"{f:08d}.jpg")).convert("RGB")).cuda()
        images, _ = model.det.transform([x])
        feats = model.det.backbone(images.tensors)
        props, _ = model.det.rpn(images, feats)
        dets, _ = model.det.roi_heads(feats, props, images.image_sizes)
        dets = model.det.transform.postprocess(dets, images.image_sizes, [x.shape[-2:]])[0]
        keep = dets["scores"] > det_thr
        boxes = dets["boxes"][keep]
        if len(boxes) == 0:
            continue
        scale = images.image_sizes[0][0] / x.shape[-2]
        emb = model.embed_rois(feats, [boxes * scale], images.image_sizes)
        ids = list(tracks)
        if ids:
            mem = torch.stack([tracks[i] for i in ids])
            bisoft = ((emb @ mem.T).softmax(1) + (emb @ mem.T).softmax(0)) / 2
        for k in range(len(boxes)):
            tid = None
            if ids:
                score, j = bisoft[k].max(0)
                if score > match_thr and ids[j] not in [r[1] for r in rows if r[0] == f]:
                    tid = ids[j]
            if tid is None:
                tid, next_id = next_id, next_id + 1
                tracks[tid] = emb[k]
            else:
                tracks[tid] = memo * tracks[tid] + (1 - memo) * emb[k]
            rows.append((f, tid, *boxes[k].tolist()))
    with open(out_file, "w") as fh:
        for f, tid, x1, y1, x2, y2 in rows:
            fh.write(f"{f},{tid},{x1:.2f},{y1:.2f},{x2 - x1:.2f},{y2 - y1:.2f},1,-1,-1,-1\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/datasets/DanceTrack")
    ap.add_argument("--out", default="runs/qdtrack_dancetrack")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.01)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    train_db = load_annotations(os.path.join(args.data, "train"))
    val_db = load_annotations(os.path.join(args.data, "val"))
    dataset = KeyRefFrames(train_db)
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=6,
                        collate_fn=lambda b: list(zip(*b)), pin_memory=True, drop_last=True)

    model = DDP(QDTrack().cuda(), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [6 * len(loader)], 0.1)
    res_dir = os.path.join(args.out, "val_results")
    os.makedirs(res_dir, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for it, (keys, refs) in enumerate(loader):
            ki = [k[0].cuda(non_blocking=True) for k in keys]
            kt = [{n: v.cuda() for n, v in k[1].items()} for k in keys]
            ri = [r[0].cuda(non_blocking=True) for r in refs]
            rt = [{n: v.cuda() for n, v in r[1].items()} for r in refs]
            losses = model(ki, kt, ri, rt)
            loss = sum(losses.values())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if it % 100 == 0:
                vals = torch.stack([torch.as_tensor(v, device="cuda").float().detach() for v in losses.values()])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep{epoch} {it}/{len(loader)} " + " ".join(f"{k}={v:.3f}" for k, v in zip(losses, vals.tolist())), flush=True)
        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.out, f"epoch_{epoch + 1}.pth"))
            print(f"epoch {epoch + 1} done in {time.time() - tic:.0f}s", flush=True)

        model.eval()
        names = sorted(val_db)
        for s in names[rank::world]:
            track_seq(model.module, val_db[s], os.path.join(res_dir, f"{s}.txt"))
        dist.barrier()
        if rank == 0:
            accs = []
            for s in names:
                gt = mm.io.loadtxt(os.path.join(val_db[s]["dir"], "gt", "gt.txt"), fmt="mot15-2D")
                ts = mm.io.loadtxt(os.path.join(res_dir, f"{s}.txt"), fmt="mot15-2D")
                accs.append(mm.utils.compare_to_groundtruth(gt, ts, "iou", distth=0.5))
            summ = mm.metrics.create().compute_many(accs, names=names, metrics=["mota", "idf1", "num_switches"], generate_overall=True)
            print(mm.io.render_summary(summ, formatters=mm.metrics.create().formatters, namemap=mm.io.motchallenge_metric_names))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
