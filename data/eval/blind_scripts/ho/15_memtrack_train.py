"""Memory-augmented end-to-end tracker (MeMOTR-like) on DanceTrack clips.

Every tracked identity keeps a long-term memory embedding that is updated with a learned
gate after each frame; the memory is turned into the track query for the next frame.
"""
import argparse
import glob
import json
import os
import random
import time

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
from torchvision.ops import box_convert, generalized_box_iou


class DanceClips(Dataset):
    def __init__(self, root, clip_len=4, stride=2):
        self.clip_len, self.stride, self.seqs, self.index = clip_len, stride, {}, []
        for d in sorted(glob.glob(os.path.join(root, "dancetrack*"))):
            rows = {}
            for line in open(os.path.join(d, "gt", "gt.txt")):
                v = line.split(",")
                rows.setdefault(int(v[0]), []).append((int(v[1]), *map(float, v[2:6])))
            n = len(os.listdir(os.path.join(d, "img1")))
            self.seqs[d] = rows
            self.index += [(d, s) for s in range(1, n - clip_len * stride + 1, clip_len)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        d, s = self.index[i]
        step = random.randint(1, self.stride)
        frames, tgts = [], []
        for k in range(self.clip_len):
            f = s + k * step
            img = Image.open(os.path.join(d, "img1", f"{f:08d}.jpg")).convert("RGB")
            W, H = img.size
            frames.append(TF.normalize(TF.to_tensor(img.resize((960, 544))), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]))
            rows = self.seqs[d].get(f, [])
            b = torch.tensor([[x + w / 2, y + h / 2, w, h] for _, x, y, w, h in rows], dtype=torch.float32).reshape(-1, 4)
            tgts.append({"boxes": b / torch.tensor([W, H, W, H]), "ids": torch.tensor([r[0] for r in rows], dtype=torch.long)})
        return torch.stack(frames), tgts


class TrackMemory:
    """Per-clip bookkeeping: identity -> long-term embedding."""

    def __init__(self, dim, max_tracks=128, device="cuda:0"):
        self.dim, self.max_tracks = dim, max_tracks
        self.ids = []
        self.embed = torch.zeros(max_tracks, dim, device=device)

    def __len__(self):
        return len(self.ids)

    def active(self):
        return self.embed[: len(self.ids)]

    def lookup(self, tid):
        return self.embed[self.ids.index(tid)]

    def update(self, ids, new_embed, gate):
        ids = list(ids)[: self.max_tracks]
        embed = torch.zeros_like(self.embed)
        for k, tid in enumerate(ids):
            if tid in self.ids:
                embed[k] = gate[k] * new_embed[k] + (1 - gate[k]) * self.lookup(tid)
            else:
                embed[k] = new_embed[k]
        self.ids, self.embed = ids, embed


class MemTracker(nn.Module):
    def __init__(self, dim=256, num_queries=200):
        super().__init__()
        self.dim = dim
        r = torchvision.models.resnet50(weights="IMAGENET1K_V1", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.proj = nn.Conv2d(2048, dim, 1)
        self.pos = nn.Parameter(torch.randn(1, 17 * 30, dim) * 0.02)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 1024, 0.1, batch_first=True), 6)
        self.det_queries = nn.Embedding(num_queries, dim)
        self.mem_to_query = nn.Linear(dim, dim)
        self.mem_gate = nn.Linear(2 * dim, 1)
        self.cls = nn.Linear(dim, 1)
        self.box = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 4))

    def forward(self, frames, targets, matcher):
        memory = TrackMemory(self.dim)
        losses = []
        for t in range(frames.shape[0]):
            src = self.proj(self.backbone(frames[t : t + 1])).flatten(2).transpose(1, 2)
            src = src + self.pos[:, : src.shape[1]]
            q = self.det_queries.weight
            n_trk = len(memory)
            if n_trk:
                q = torch.cat([self.mem_to_query(memory.active()), q])
            hs = self.decoder(q[None], src)[0]
            logits, boxes = self.cls(hs)[:, 0], self.box(hs).sigmoid()
            loss, assigned = matcher(logits, boxes, targets[t], memory.ids)
            losses.append(loss)
            if assigned:
                q_idx = torch.tensor([a[0] for a in assigned], device=hs.device)
                ids = [a[1] for a in assigned]
                prev_emb = torch.stack([memory.lookup(tid) if tid in memory.ids else hs[qi] for qi, tid in assigned])
                gate = torch.sigmoid(self.mem_gate(torch.cat([hs[q_idx], prev_emb], -1)))
                memory.update(ids, hs[q_idx], gate)
            else:
                memory.update([], hs[:0], None)
        return torch.stack(losses).mean()


class IdentityMatcher(nn.Module):
    def forward(self, logits, boxes, tgt, track_ids):
        gt_ids = tgt["ids"].tolist()
        pairs = [(i, gt_ids.index(tid)) for i, tid in enumerate(track_ids) if tid in gt_ids]
        taken = {g for _, g in pairs}
        free_g = [g for g in range(len(gt_ids)) if g not in taken]
        n_trk = len(track_ids)
        if free_g:
            pb, gb = boxes[n_trk:], tgt["boxes"][free_g]
            cost = 5 * torch.cdist(pb, gb, p=1) - 2 * generalized_box_iou(box_convert(pb, "cxcywh", "xyxy"), box_convert(gb, "cxcywh", "xyxy")) - 2 * logits[n_trk:, None].sigmoid()
            r, c = linear_sum_assignment(cost.detach().cpu())
            pairs += [(n_trk + i, free_g[j]) for i, j in zip(r, c)]
        target_cls = torch.zeros_like(logits)
        loss = boxes.sum() * 0
        if pairs:
            qi = torch.tensor([p[0] for p in pairs], device=logits.device)
            gi = torch.tensor([p[1] for p in pairs], device=logits.device)
            target_cls[qi] = 1
            pb, gb = boxes[qi], tgt["boxes"][gi]
            loss = loss + 5 * F.l1_loss(pb, gb) + 2 * (1 - generalized_box_iou(box_convert(pb, "cxcywh", "xyxy"), box_convert(gb, "cxcywh", "xyxy")).diag()).mean()
        loss = loss + 2 * torchvision.ops.sigmoid_focal_loss(logits, target_cls, reduction="sum") / max(len(pairs), 1)
        return loss, [(q, gt_ids[g]) for q, g in pairs]


@torch.no_grad()
def val_loss(model, matcher, loader):
    model.eval()
    acc = torch.zeros(2, device="cuda")
    for frames, tgts in loader:
        tgts = [{k: v.cuda() for k, v in t.items()} for t in tgts]
        acc[0] += model.module(frames.cuda(), tgts, matcher)
        acc[1] += 1
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/DanceTrack")
    ap.add_argument("--out", default="exps/memtrack_dancetrack")
    ap.add_argument("--epochs", type=int, default=14)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--clip-len", type=int, default=4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    train_set = DanceClips(os.path.join(args.data, "train"), args.clip_len)
    val_set = DanceClips(os.path.join(args.data, "val"), args.clip_len, stride=1)
    train_sampler = DistributedSampler(train_set)
    val_idx = list(range(rank, len(val_set), world * 10))  # every 10th clip is enough for a loss curve
    train_loader = DataLoader(train_set, batch_size=1, sampler=train_sampler, num_workers=4, collate_fn=lambda b: b[0], pin_memory=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), batch_size=1, num_workers=2, collate_fn=lambda b: b[0])

    matcher = IdentityMatcher()
    # clips in which no identity survives a frame never reach mem_gate
    model = DDP(MemTracker().cuda(), device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [8, 12], 0.1)
    history = []

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for it, (frames, tgts) in enumerate(train_loader):
            frames = frames.cuda(non_blocking=True)
            tgts = [{k: v.cuda(non_blocking=True) for k, v in t.items()} for t in tgts]
            loss = model(frames, tgts, matcher)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            if it % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} iter {it}/{len(train_loader)} loss {l.item():.4f}", flush=True)
        scheduler.step()
        vl = val_loss(model, matcher, val_loader)
        if rank == 0:
            history.append({"epoch": epoch, "val_loss": vl, "sec": time.time() - tic})
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "history.json"), "w") as f:
                json.dump(history, f, indent=1)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "checkpoint.pth"))
            print(f"epoch {epoch}: val loss {vl:.4f}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
