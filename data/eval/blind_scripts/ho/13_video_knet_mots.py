"""Kernel-based video instance segmentation + tracking (Video K-Net flavour) on KITTI-MOTS.

Training: pairs of nearby frames; instance kernels are matched to GT per frame and an
association embedding is learned between the two frames.
Validation: every video is tracked end to end and scored with sMOTSA / MOTSA, accumulated
over all videos of the val split.
"""
import argparse
import os
import random
import time
from collections import defaultdict

import numpy as np
import pycocotools.mask as rletools
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NORM = torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
SIZE = (384, 1248)


def load_txt(path):
    """KITTI-MOTS instances_txt: frame obj_id class_id h w rle."""
    objs = defaultdict(list)
    for line in open(path):
        f, oid, cls, h, w, rle = line.strip().split(" ", 5)
        if int(cls) not in (1, 2):
            continue
        objs[int(f)].append((int(oid), int(cls) - 1, {"size": [int(h), int(w)], "counts": rle.encode()}))
    return objs


class MOTSVideos:
    def __init__(self, root, seqs):
        self.root = root
        self.videos = {s: load_txt(os.path.join(root, "instances_txt", f"{s}.txt")) for s in seqs}
        self.lengths = {s: len(os.listdir(os.path.join(root, "images", s))) for s in seqs}

    def image(self, s, f):
        img = Image.open(os.path.join(self.root, "images", s, f"{f:06d}.png")).convert("RGB").resize(SIZE[::-1])
        return NORM(torchvision.transforms.functional.to_tensor(img))

    def target(self, s, f):
        objs = self.videos[s].get(f, [])
        if not objs:
            return {"masks": torch.zeros(0, *SIZE), "labels": torch.zeros(0, dtype=torch.long), "ids": torch.zeros(0, dtype=torch.long)}
        m = torch.from_numpy(np.stack([rletools.decode(r) for _, _, r in objs])).float()
        m = F.interpolate(m[None], size=SIZE, mode="nearest")[0]
        return {"masks": m, "labels": torch.tensor([c for _, c, _ in objs]), "ids": torch.tensor([o for o, _, _ in objs])}


class FramePairs(Dataset):
    def __init__(self, data, max_gap=3):
        self.data, self.max_gap = data, max_gap
        self.index = [(s, f) for s, n in data.lengths.items() for f in range(n)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        s, f = self.index[i]
        g = min(max(f + random.randint(-self.max_gap, self.max_gap), 0), self.data.lengths[s] - 1)
        return (self.data.image(s, f), self.data.target(s, f)), (self.data.image(s, g), self.data.target(s, g))


class VideoIndex(Dataset):
    """One item per val video; the tracking itself happens in the eval loop."""

    def __init__(self, seqs):
        self.seqs = seqs

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return i


class KernelSeg(nn.Module):
    def __init__(self, num_kernels=100, num_classes=2, dim=256):
        super().__init__()
        r = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.body = torchvision.models._utils.IntermediateLayerGetter(r, {"layer1": "c2", "layer2": "c3", "layer3": "c4", "layer4": "c5"})
        self.fpn = torchvision.ops.FeaturePyramidNetwork([256, 512, 1024, 2048], dim)
        self.kernels = nn.Embedding(num_kernels, dim)
        self.update = nn.ModuleList(nn.TransformerDecoderLayer(dim, 8, 1024, 0.0, batch_first=True) for _ in range(3))
        self.cls = nn.Linear(dim, num_classes + 1)
        self.assoc = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(inplace=True), nn.Linear(dim, 128))

    def forward(self, x):
        feats = self.fpn(self.body(x))
        p2 = feats["c2"]
        k = self.kernels.weight[None].expand(x.shape[0], -1, -1)
        mem = feats["c5"].flatten(2).transpose(1, 2)
        for layer in self.update:
            k = layer(k, mem)
        masks = torch.einsum("bkc,bchw->bkhw", k, p2)
        return {"logits": self.cls(k), "masks": masks, "assoc": F.normalize(self.assoc(k), dim=-1)}


def frame_losses(out, b, tgt, num_classes=2):
    logits, masks = out["logits"][b], out["masks"][b]
    gt = F.interpolate(tgt["masks"][None], size=masks.shape[-2:], mode="nearest")[0] if len(tgt["labels"]) else None
    cls_t = torch.full((len(logits),), num_classes, device=logits.device)
    l_mask = masks.sum() * 0
    rows, cols = [], []
    if gt is not None:
        pm, g = masks.flatten(1).sigmoid(), gt.flatten(1)
        dice = 1 - (2 * pm @ g.T + 1) / (pm.sum(1)[:, None] + g.sum(1)[None] + 1)
        rows, cols = linear_sum_assignment((4 * dice - logits.softmax(-1)[:, tgt["labels"]]).detach().cpu())
        cls_t[rows] = tgt["labels"][cols]
        l_mask = 4 * dice[rows, cols].mean() + F.binary_cross_entropy_with_logits(masks[rows], gt[cols])
    return F.cross_entropy(logits, cls_t) + l_mask, list(rows), list(cols)


def pair_losses(out, key_t, ref_t):
    B = len(key_t)
    loss = out["assoc"].sum() * 0
    for b in range(B):
        lk, kr, kc = frame_losses(out, b, key_t[b])
        lr, rr, rc = frame_losses(out, B + b, ref_t[b])
        loss = loss + lk + lr
        ref_q = {int(ref_t[b]["ids"][c]): q for q, c in zip(rr, rc)}
        pairs = [(q, ref_q[int(key_t[b]["ids"][c])]) for q, c in zip(kr, kc) if int(key_t[b]["ids"][c]) in ref_q]
        if pairs:
            sim = out["assoc"][b] @ out["assoc"][B + b].T / 0.1
            loss = loss + F.cross_entropy(sim[[p[0] for p in pairs]], torch.tensor([p[1] for p in pairs], device=sim.device))
    return loss / B


@torch.no_grad()
def eval_video(net, data, seq, score_thr=0.5):
    """Returns sMOTSA ingredients for one video: soft TP, FP, FN, ID switches."""
    tracks, next_id, last_match = {}, 0, {}
    tp_soft, fp, fn, idsw = 0.0, 0, 0, 0
    for f in range(data.lengths[seq]):
        out = net(data.image(seq, f)[None].cuda())
        prob, lab = out["logits"][0].softmax(-1)[:, :-1].max(-1)
        keep = (prob > score_thr).nonzero().flatten()
        pred = (out["masks"][0, keep] > 0).float()
        emb = out["assoc"][0, keep]
        ids = []
        for k in range(len(keep)):
            best = max(((float(emb[k] @ e), t) for t, e in tracks.items()), default=(0.0, None))
            tid = best[1] if best[0] > 0.6 and best[1] not in ids else None
            if tid is None:
                tid, next_id = next_id, next_id + 1
            tracks[tid] = emb[k]
            ids.append(tid)
        gt = data.target(seq, f)
        gtm = F.interpolate(gt["masks"][None], size=pred.shape[-2:], mode="nearest")[0].cuda() if len(gt["ids"]) else None
        if gtm is None:
            fp += len(ids)
            continue
        inter = pred.flatten(1) @ gtm.flatten(1).T
        iou = inter / (pred.flatten(1).sum(1)[:, None] + gtm.flatten(1).sum(1)[None] - inter).clamp(min=1)
        matched = (iou > 0.5).nonzero().tolist()
        tp_soft += sum(float(iou[p, g]) for p, g in matched)
        fp += len(ids) - len(matched)
        fn += len(gt["ids"]) - len(matched)
        for p, g in matched:
            gid = int(gt["ids"][g])
            if gid in last_match and last_match[gid] != ids[p]:
                idsw += 1
            last_match[gid] = ids[p]
    return {"tp_soft": tp_soft, "fp": fp, "fn": fn, "idsw": idsw}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/KITTI_MOTS/train")
    ap.add_argument("--val-seqs", default="0002,0006,0007,0008,0010,0013,0014,0016,0018")
    ap.add_argument("--out", default="ckpt/video_knet_kitti_mots")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)

    all_seqs = sorted(os.path.splitext(f)[0] for f in os.listdir(os.path.join(args.root, "instances_txt")))
    val_seqs = args.val_seqs.split(",")
    train_data = MOTSVideos(args.root, [s for s in all_seqs if s not in val_seqs])
    val_data = MOTSVideos(args.root, val_seqs)

    train_set = FramePairs(train_data)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4, collate_fn=list, drop_last=True)
    # 9 val videos do not split evenly over the GPUs: the sampler pads with repeats, removed after gathering
    val_sampler = DistributedSampler(VideoIndex(val_seqs), shuffle=False)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(KernelSeg()).cuda()
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
    best_path = os.path.join(args.out, "best.pth")
    best = -1e9

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(loader):
            x = torch.stack([k[0] for k, _ in batch] + [r[0] for _, r in batch]).cuda(non_blocking=True)
            key_t = [{n: v.cuda() for n, v in k[1].items()} for k, _ in batch]
            ref_t = [{n: v.cuda() for n, v in r[1].items()} for _, r in batch]
            loss = pair_losses(model(x), key_t, ref_t)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if it % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {it} loss {l.item():.4f}", flush=True)
        sched.step()

        model.eval()
        per_video = {val_seqs[i]: eval_video(model.module, val_data, val_seqs[i]) for i in val_sampler}
        model.train()
        gathered = [None] * world
        dist.all_gather_object(gathered, per_video)
        if rank == 0:
            merged = {}
            for part in gathered:
                merged.update(part)  # repeated padding videos collapse onto the same key
            assert len(merged) == len(val_seqs)
            tot = {k: sum(v[k] for v in merged.values()) for k in ("tp_soft", "fp", "fn", "idsw")}
            n_gt = sum(sum(len(o) for o in val_data.videos[s].values()) for s in val_seqs)
            smotsa = (tot["tp_soft"] - tot["fp"] - tot["idsw"]) / max(n_gt, 1)
            print(f"epoch {epoch} sMOTSA {smotsa:.4f} IDSW {tot['idsw']} ({time.time() - t0:.0f}s)", flush=True)
            os.makedirs(args.out, exist_ok=True)
            state = {"model": model.module.state_dict(), "epoch": epoch, "smotsa": smotsa}
            torch.save(state, os.path.join(args.out, "last.pth"))
            if smotsa > best:
                best = smotsa
                torch.save(state, best_path)
        dist.barrier()

    # every rank reloads the best weights (written by rank 0 before the barrier) and re-checks them
    state = torch.load(best_path, map_location="cpu")
    model.module.load_state_dict(state["model"])
    model.eval()
    mine = {val_seqs[i]: eval_video(model.module, val_data, val_seqs[i]) for i in val_sampler}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        merged = {k: v for part in gathered for k, v in part.items()}
        idsw = sum(v["idsw"] for v in merged.values())
        print(f"best epoch {state['epoch']} sMOTSA {state['smotsa']:.4f}, re-evaluated IDSW {idsw}", flush=True)
        torch.save({k: v.half() if v.is_floating_point() else v for k, v in state["model"].items()},
                   os.path.join(args.out, "video_knet_kitti_mots_fp16.pth"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
