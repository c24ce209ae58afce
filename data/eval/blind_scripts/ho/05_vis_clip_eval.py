"""Clip-level video instance segmentation (SeqFormer-like) on OVIS.

OVIS has no public val annotations, so we hold out 60 videos of the train split
(data/ovis_sub_val.json, made once by tools/split_ovis.py) and report mask AP on them
with the YouTube-VIS API every few epochs.
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
import torchvision
import yaml
from PIL import Image
from pycocotools.ytvos import YTVOS
from pycocotools.ytvoseval import YTVOSeval
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NORM = torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


def read_frame(root, name, short=360):
    img = Image.open(os.path.join(root, name)).convert("RGB")
    scale = short / min(img.size)
    img = img.resize((int(img.width * scale), int(img.height * scale)), Image.BILINEAR)
    return NORM(torchvision.transforms.functional.to_tensor(img))


class OVISClips(Dataset):
    def __init__(self, img_root, ann_file, num_frames=5, samples_per_video=8):
        self.api = YTVOS(ann_file)
        self.img_root, self.num_frames = img_root, num_frames
        self.vids = sorted(self.api.getVidIds())
        self.cat_ids = sorted(self.api.getCatIds())
        self.items = [v for v in self.vids for _ in range(samples_per_video)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid = self.items[i]
        info = self.api.loadVids(vid)[0]
        n = info["length"]
        start = random.randint(0, max(n - self.num_frames * 2, 0))
        frame_ids = sorted(random.sample(range(start, min(start + self.num_frames * 2, n)), min(self.num_frames, n)))
        frames = torch.stack([read_frame(self.img_root, info["file_names"][t]) for t in frame_ids])
        anns = self.api.loadAnns(self.api.getAnnIds(vidIds=[vid]))
        masks, labels = [], []
        for a in anns:
            per_frame = []
            for t in frame_ids:
                seg = a["segmentations"][t]
                if seg is None:
                    per_frame.append(np.zeros((info["height"], info["width"]), np.uint8))
                else:
                    rle = mask_util.frPyObjects(seg, info["height"], info["width"]) if isinstance(seg["counts"], list) else seg
                    per_frame.append(mask_util.decode(rle))
            m = torch.from_numpy(np.stack(per_frame)).float()
            if m.sum() == 0:
                continue
            masks.append(F.interpolate(m[None], size=frames.shape[-2:], mode="nearest")[0])
            labels.append(self.cat_ids.index(a["category_id"]))
        masks = torch.stack(masks) if masks else torch.zeros(0, len(frame_ids), *frames.shape[-2:])
        return frames, {"masks": masks, "labels": torch.tensor(labels, dtype=torch.long)}


def first_item(batch):
    return batch[0]


class ClipVIS(nn.Module):
    def __init__(self, num_classes, num_queries=100, dim=256):
        super().__init__()
        r50 = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.body = torchvision.models._utils.IntermediateLayerGetter(r50, {"layer2": "c3", "layer4": "c5"})
        self.proj_c3 = nn.Conv2d(512, dim, 1)
        self.proj_c5 = nn.Conv2d(2048, dim, 1)
        self.queries = nn.Embedding(num_queries, dim)
        self.temporal_pos = nn.Embedding(36, dim)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 1024, 0.1, batch_first=True), 6)
        self.cls = nn.Linear(dim, num_classes + 1)
        self.mask_embed = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))

    def forward(self, frames):  # frames: T x 3 x H x W (one clip)
        feats = self.body(frames)
        c5 = self.proj_c5(feats["c5"])
        mask_feat = self.proj_c3(feats["c3"])
        T = frames.shape[0]
        mem = c5.flatten(2).transpose(1, 2) + self.temporal_pos.weight[:T, None, :]
        mem = mem.reshape(1, -1, mem.shape[-1])
        q = self.decoder(self.queries.weight[None], mem)[0]
        masks = torch.einsum("qc,tchw->qthw", self.mask_embed(q), mask_feat)
        return self.cls(q), masks


def clip_loss(logits, masks, tgt, num_classes, eos=0.1):
    gt = tgt["masks"]
    tgt_cls = torch.full((logits.shape[0],), num_classes, device=logits.device)
    l_mask = masks.sum() * 0
    if len(gt):
        gt = F.interpolate(gt, size=masks.shape[-2:], mode="nearest").flatten(1)
        pm = masks.flatten(1).sigmoid()
        dice = 1 - (2 * pm @ gt.T + 1) / (pm.sum(1)[:, None] + gt.sum(1)[None] + 1)
        cost = 5 * dice - 2 * logits.softmax(-1)[:, tgt["labels"]]
        r, c = linear_sum_assignment(cost.detach().cpu())
        tgt_cls[r] = tgt["labels"][c]
        src, dst = masks.flatten(1)[r], gt[c]
        l_mask = F.binary_cross_entropy_with_logits(src, dst) * 5 + dice[r, c].mean() * 5
    w = torch.ones(num_classes + 1, device=logits.device)
    w[-1] = eos
    return F.cross_entropy(logits, tgt_cls, w) * 2 + l_mask


@torch.no_grad()
def predict_video(model, api, img_root, vid, clip=36, topk=10):
    info = api.loadVids(vid)[0]
    names = info["file_names"]
    all_masks, all_logits = [], []
    for s in range(0, len(names), clip):
        frames = torch.stack([read_frame(img_root, n) for n in names[s : s + clip]]).cuda()
        logits, masks = model(frames)
        all_logits.append(logits.softmax(-1)[:, :-1])
        all_masks.append(F.interpolate(masks, size=(info["height"], info["width"]), mode="bilinear", align_corners=False) > 0)
    scores = torch.stack(all_logits).mean(0)
    masks = torch.cat(all_masks, 1).cpu().numpy()
    top = scores.flatten().topk(topk)
    out = []
    for score, idx in zip(top.values.tolist(), top.indices.tolist()):
        q, c = divmod(idx, scores.shape[1])
        segs = []
        for m in masks[q]:
            rle = mask_util.encode(np.asfortranarray(m.astype(np.uint8)))
            rle["counts"] = rle["counts"].decode("utf-8")
            segs.append(rle)
        out.append({"video_id": vid, "category_id": api.getCatIds()[c], "score": score, "segmentations": segs})
    return out


def evaluate(model, api, img_root, rank, world):
    model.eval()
    vids = sorted(api.getVidIds())[rank::world]
    results = []
    for vid in vids:
        results.extend(predict_video(model, api, img_root, vid))
    model.train()
    if not results:
        return 0.0
    dt = api.loadRes(results)
    ev = YTVOSeval(api, dt, "segm")
    ev.params.vidIds = vids
    ev.evaluate()
    ev.accumulate()
    ev.summarize()
    return float(ev.stats[0])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/ovis_r50_clip5.yaml")
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    out_dir = cfg["output_dir"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(cfg, f)

    img_root = os.path.join(cfg["ovis_root"], "train")
    train_set = OVISClips(img_root, cfg["train_ann"], cfg["num_frames"], cfg.get("samples_per_video", 8))
    val_api = YTVOS(cfg["val_ann"])
    num_classes = len(train_set.cat_ids)
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.get("seed", 0))
    loader = DataLoader(train_set, batch_size=1, sampler=sampler, num_workers=cfg.get("workers", 4),
                        collate_fn=first_item, pin_memory=True)

    torch.manual_seed(cfg.get("seed", 0))
    model = ClipVIS(num_classes, cfg.get("num_queries", 100)).cuda()
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, cfg["lr_drop"], 0.1)

    best_ap = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        t0, running = time.time(), torch.zeros(2, device="cuda")
        for i, (frames, tgt) in enumerate(loader):
            frames = frames.cuda(non_blocking=True)
            tgt = {k: v.cuda(non_blocking=True) for k, v in tgt.items()}
            logits, masks = model(frames)
            loss = clip_loss(logits, masks, tgt, num_classes)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            running += torch.stack([loss.detach(), torch.ones((), device="cuda")])
        scheduler.step()
        dist.all_reduce(running)
        if rank == 0:
            print(f"[epoch {epoch}] loss {running[0].item() / running[1].item():.4f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % cfg.get("eval_every", 2) == 0:
            ap = evaluate(model.module, val_api, img_root, rank, world)
            if rank == 0:
                print(f"[epoch {epoch}] sub-val mask AP {ap:.4f}", flush=True)
                with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
                    f.write(json.dumps({"epoch": epoch, "AP": ap}) + "\n")
                ckpt = {"model": model.module.state_dict(), "epoch": epoch, "ap": ap}
                torch.save(ckpt, os.path.join(out_dir, "last.pth"))
                if ap > best_ap:
                    best_ap = ap
                    torch.save(ckpt, os.path.join(out_dir, "best.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
