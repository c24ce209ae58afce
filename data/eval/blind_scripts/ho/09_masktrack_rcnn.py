"""MaskTrack R-CNN on YouTube-VIS 2021: Mask R-CNN + a tracking head on RoI features.

A key frame and a reference frame are sampled from the same video. The tracking head
classifies every key-frame instance as one of the reference instances or "new".
Backbone and FPN are fully fine-tuned (all stages, BatchNorm included) on the video data.
"""
import argparse
import json
import os
import random
import time

import numpy as np
import pycocotools.mask as mask_util
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from pycocotools.ytvos import YTVOS
from pycocotools.ytvoseval import YTVOSeval
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.detection import MaskRCNN
from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
from torchvision.ops import MultiScaleRoIAlign
from torchvision.transforms.functional import to_tensor


class PairDataset(Dataset):
    def __init__(self, root, ann_file, ref_range=5):
        self.api = YTVOS(ann_file)
        self.root, self.ref_range = root, ref_range
        self.cat_ids = sorted(self.api.getCatIds())
        self.frames = []
        for vid in sorted(self.api.getVidIds()):
            n = self.api.loadVids(vid)[0]["length"]
            self.frames += [(vid, t) for t in range(n)]

    def __len__(self):
        return len(self.frames)

    def load(self, vid, t, flip):
        v = self.api.loadVids(vid)[0]
        img = Image.open(os.path.join(self.root, v["file_names"][t])).convert("RGB")
        boxes, labels, masks, ids = [], [], [], []
        for a in self.api.loadAnns(self.api.getAnnIds(vidIds=[vid])):
            if a["bboxes"][t] is None:
                continue
            x, y, w, h = a["bboxes"][t]
            if w < 2 or h < 2:
                continue
            seg = a["segmentations"][t]
            rle = mask_util.frPyObjects(seg, v["height"], v["width"]) if isinstance(seg["counts"], list) else seg
            boxes.append([x, y, x + w, y + h])
            labels.append(self.cat_ids.index(a["category_id"]) + 1)
            masks.append(mask_util.decode(rle))
            ids.append(a["id"])
        x = to_tensor(img)
        boxes = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
        masks = torch.from_numpy(np.stack(masks)) if masks else torch.zeros(0, v["height"], v["width"], dtype=torch.uint8)
        if flip:
            x, masks = x.flip(-1), masks.flip(-1)
            boxes = torch.stack([v["width"] - boxes[:, 2], boxes[:, 1], v["width"] - boxes[:, 0], boxes[:, 3]], 1)
        return x, {"boxes": boxes, "labels": torch.tensor(labels, dtype=torch.int64), "masks": masks, "ids": torch.tensor(ids)}

    def __getitem__(self, i):
        vid, t = self.frames[i]
        n = self.api.loadVids(vid)[0]["length"]
        r = min(max(t + random.choice([d for d in range(-self.ref_range, self.ref_range + 1) if d != 0]), 0), n - 1)
        flip = random.random() < 0.5
        return self.load(vid, t, flip), self.load(vid, r, flip)


def collate(batch):
    return batch


class TrackHead(nn.Module):
    def __init__(self, in_ch=256, dim=1024):
        super().__init__()
        self.pool = MultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2)
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(in_ch * 49, dim), nn.ReLU(inplace=True), nn.Linear(dim, dim))

    def forward(self, feats, boxes, sizes):
        return self.fc(self.pool(feats, boxes, sizes))


class MaskTrackRCNN(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        backbone = resnet_fpn_backbone(backbone_name="resnet50", weights="IMAGENET1K_V1",
                                       norm_layer=nn.BatchNorm2d, trainable_layers=5)
        self.det = MaskRCNN(backbone, num_classes=num_classes + 1, min_size=360, max_size=640)
        self.track_head = TrackHead()

    def forward(self, key_imgs, key_tgts, ref_imgs, ref_tgts):
        images, targets = self.det.transform(key_imgs, key_tgts)
        feats = self.det.backbone(images.tensors)
        proposals, rpn_losses = self.det.rpn(images, feats, targets)
        _, roi_losses = self.det.roi_heads(feats, proposals, images.image_sizes, targets)
        ref_images, ref_targets = self.det.transform(ref_imgs, ref_tgts)
        ref_feats = self.det.backbone(ref_images.tensors)
        key_emb = self.track_head(feats, [t["boxes"] for t in targets], images.image_sizes)
        ref_emb = self.track_head(ref_feats, [t["boxes"] for t in ref_targets], ref_images.image_sizes)
        loss_track, n, k0, r0 = key_emb.sum() * 0, 0, 0, 0
        for kt, rt in zip(key_tgts, ref_tgts):
            nk, nr = len(kt["ids"]), len(rt["ids"])
            ke, re_ = key_emb[k0 : k0 + nk], ref_emb[r0 : r0 + nr]
            k0, r0 = k0 + nk, r0 + nr
            if nk == 0:
                continue
            logits = torch.cat([ke.new_zeros(nk, 1), ke @ re_.T], 1)
            match = (kt["ids"][:, None] == rt["ids"][None]).float()
            label = torch.where(match.any(1), match.argmax(1) + 1, torch.zeros_like(match[:, 0], dtype=torch.long))
            loss_track = loss_track + F.cross_entropy(logits, label)
            n += 1
        losses = {**rpn_losses, **roi_losses, "loss_track": loss_track / max(n, 1)}
        return losses


@torch.no_grad()
def infer_video(model, api, root, vid, score_thr=0.3):
    v = api.loadVids(vid)[0]
    tracks = []  # dicts: emb, score list, cat, masks per frame
    for t, fn in enumerate(v["file_names"]):
        x = to_tensor(Image.open(os.path.join(root, fn)).convert("RGB")).cuda()
        images, _ = model.det.transform([x])
        feats = model.det.backbone(images.tensors)
        props, _ = model.det.rpn(images, feats)
        dets, _ = model.det.roi_heads(feats, props, images.image_sizes)
        dets = model.det.transform.postprocess(dets, images.image_sizes, [x.shape[-2:]])[0]
        keep = dets["scores"] > score_thr
        if keep.sum() == 0:
            continue
        scale = images.image_sizes[0][0] / x.shape[-2]
        emb = model.track_head(feats, [dets["boxes"][keep] * scale], images.image_sizes)
        used = set()
        for i in range(int(keep.sum())):
            sims = [(float(emb[i] @ tr["emb"]), j) for j, tr in enumerate(tracks) if j not in used]
            best = max(sims, default=(0.0, -1))
            if best[1] >= 0 and best[0] > 0:
                tr = tracks[best[1]]
                used.add(best[1])
            else:
                tr = {"masks": {}, "scores": [], "cat": int(dets["labels"][keep][i])}
                tracks.append(tr)
                used.add(len(tracks) - 1)
            tr["emb"] = emb[i]
            tr["scores"].append(float(dets["scores"][keep][i]))
            tr["masks"][t] = (dets["masks"][keep][i, 0] > 0.5).cpu().numpy()
    out = []
    for tr in tracks:
        segs = []
        for t in range(v["length"]):
            m = tr["masks"].get(t)
            if m is None:
                segs.append(None)
                continue
            rle = mask_util.encode(np.asfortranarray(m.astype(np.uint8)))
            rle["counts"] = rle["counts"].decode()
            segs.append(rle)
        out.append({"video_id": vid, "category_id": sorted(api.getCatIds())[tr["cat"] - 1],
                    "score": float(np.mean(tr["scores"])), "segmentations": segs})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/ytvis21")
    ap.add_argument("--work-dir", default="work_dirs/masktrack_r50_ytvis21")
    ap.add_argument("--imgs-per-gpu", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=0.02)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.work_dir, exist_ok=True)

    img_root = os.path.join(args.root, "train", "JPEGImages")
    train_set = PairDataset(img_root, os.path.join(args.root, "annotations", "train_sub.json"))
    val_api = YTVOS(os.path.join(args.root, "annotations", "valid_sub.json"))
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.imgs_per_gpu, sampler=sampler, num_workers=4,
                        collate_fn=collate, drop_last=True)

    model = MaskTrackRCNN(len(train_set.cat_ids)).cuda()
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [8 * len(loader), 11 * len(loader)], 0.1)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(loader):
            key_imgs = [k[0].cuda(non_blocking=True) for k, _ in batch]
            key_tgts = [{n: v.cuda() for n, v in k[1].items()} for k, _ in batch]
            ref_imgs = [r[0].cuda(non_blocking=True) for _, r in batch]
            ref_tgts = [{n: v.cuda() for n, v in r[1].items()} for _, r in batch]
            losses = model(key_imgs, key_tgts, ref_imgs, ref_tgts)
            loss = sum(losses.values())
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            optimizer.step()
            scheduler.step()
            if it % 50 == 0:
                vals = torch.stack([v.detach() for v in losses.values()])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{epoch}][{it}/{len(loader)}] " + ", ".join(f"{k}: {v:.4f}" for k, v in zip(losses, vals.tolist())), flush=True)
        if rank == 0:
            print(f"epoch {epoch} took {time.time() - t0:.0f}s", flush=True)
            torch.save({"state_dict": model.module.state_dict(), "epoch": epoch}, os.path.join(args.work_dir, f"epoch_{epoch + 1}.pth"))

        model.eval()
        mine = []
        for vid in sorted(val_api.getVidIds())[rank::world]:
            mine += infer_video(model.module, val_api, img_root, vid)
        parts = [None] * world
        dist.all_gather_object(parts, mine)
        if rank == 0:
            results = [r for p in parts for r in p]
            with open(os.path.join(args.work_dir, f"results_ep{epoch + 1}.json"), "w") as f:
                json.dump(results, f)
            if results:
                ev = YTVOSeval(val_api, val_api.loadRes(results), "segm")
                ev.evaluate()
                ev.accumulate()
                ev.summarize()
                print(f"epoch {epoch} sub-val segm AP {ev.stats[0]:.4f}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
