"""Text-video retrieval on an in-house clip collection.

Layout: <root>/<clip_id>.mp4 with one or more captions in <root>/<clip_id>.txt (one per line).
There is no official split, so 5% of the clips are held out for validation.

    torchrun --nproc_per_node=4 15_caption_folder_retrieval.py --root /mnt/datasets/product_clips \
        --out /mnt/exp/product_clips_b16
"""
import argparse
import glob
import logging
import math
import os
import random

import clip
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

log = logging.getLogger("retrieval")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backbone", default="ViT-B/16")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--val_frac", type=float, default=0.05)
    ap.add_argument("--batch_size", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def read_captions(path):
    with open(path, encoding="utf-8") as f:
        return [l.strip() for l in f if l.strip()]


class ClipCaptions(Dataset):
    def __init__(self, root, clip_ids, frames, train):
        self.root, self.ids, self.frames, self.train = root, clip_ids, frames, train
        self.caps = {c: read_captions(os.path.join(root, c + ".txt")) for c in clip_ids}
        aug = [T.RandomResizedCrop(224, scale=(0.7, 1.0), antialias=True)] if train else \
            [T.Resize(224, antialias=True), T.CenterCrop(224)]
        self.tf = T.Compose(aug + [T.Normalize((0.48145466, 0.4578275, 0.40821073),
                                               (0.26862954, 0.26130258, 0.27577711))])

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        cid = self.ids[i]
        vr = VideoReader(os.path.join(self.root, cid + ".mp4"), ctx=cpu(0), num_threads=1)
        n = len(vr)
        b = np.linspace(0, n, self.frames + 1).astype(int)
        if self.train:
            ids = [random.randint(lo, max(lo, hi - 1)) for lo, hi in zip(b[:-1], b[1:])]
            cap = random.choice(self.caps[cid])
        else:
            ids = ((b[:-1] + b[1:]) // 2).tolist()
            cap = self.caps[cid][0]
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        return self.tf(x), clip.tokenize(cap, truncate=True)[0], i


class Retriever(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.clip, _ = clip.load(backbone, device="cpu", jit=False)
        self.clip.float()

    def encode_video(self, x):
        b, t = x.shape[:2]
        f = F.normalize(self.clip.encode_image(x.flatten(0, 1)), dim=-1).view(b, t, -1)
        return F.normalize(f.mean(1), dim=-1)

    def encode_text(self, tok):
        return F.normalize(self.clip.encode_text(tok), dim=-1)

    def forward(self, x, tok):
        return self.encode_video(x), self.encode_text(tok), self.clip.logit_scale.exp()


class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.slice = slice(dist.get_rank() * x.shape[0], (dist.get_rank() + 1) * x.shape[0])
        buf = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(buf, x)
        return torch.cat(buf)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.slice]


@torch.no_grad()
def validate(net, loader, n, device):
    net.eval()
    rows = []
    for x, tok, idx in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            v, t = net.encode_video(x.to(device)), net.encode_text(tok.to(device))
        rows.append(torch.cat([idx.to(device).float()[:, None], v.float(), t.float()], dim=1))
    local = torch.cat(rows)
    buf = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(buf, local)
    allr = torch.cat(buf)
    d = (local.shape[1] - 1) // 2
    V = torch.zeros(n, d, device=device)
    Tt = torch.zeros(n, d, device=device)
    V[allr[:, 0].long()] = allr[:, 1:1 + d]
    Tt[allr[:, 0].long()] = allr[:, 1 + d:]
    sim = Tt @ V.t()
    r = (sim > sim.diag()[:, None]).sum(1).float()
    net.train()
    return {"R@1": 100 * (r < 1).float().mean().item(), "R@5": 100 * (r < 5).float().mean().item(),
            "R@10": 100 * (r < 10).float().mean().item(), "MdR": r.median().item() + 1}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    # different augmentation / caption draws on every rank
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    clip_ids = sorted(os.path.basename(p)[:-4] for p in glob.glob(os.path.join(args.root, "*.mp4")))
    clip_ids = [c for c in clip_ids if os.path.exists(os.path.join(args.root, c + ".txt"))]
    random.shuffle(clip_ids)
    n_val = int(len(clip_ids) * args.val_frac)
    val_ids, train_ids = clip_ids[:n_val], clip_ids[n_val:]
    log.info("%d clips: %d train / %d val", len(clip_ids), len(train_ids), len(val_ids))

    train_set = ClipCaptions(args.root, train_ids, args.frames, train=True)
    val_set = ClipCaptions(args.root, val_ids, args.frames, train=False)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, 32, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=args.workers)

    model = DDP(Retriever(args.backbone).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.2, betas=(0.9, 0.98), eps=1e-6)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "val_ids.txt"), "w") as f:
            f.write("\n".join(val_ids))
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (x, tok, _) in enumerate(train_loader):
            x, tok = x.to(device, non_blocking=True), tok.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                v, t, s = model(x, tok)
            v, t = Gather.apply(v.float()), Gather.apply(t.float())
            logits = s * t @ v.t()
            y = torch.arange(len(logits), device=device)
            loss = (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if it % 50 == 0:
                log.info("epoch %d it %d/%d loss %.4f", epoch, it, len(train_loader), loss.item())

        res = validate(model.module, val_loader, len(val_set), device)
        log.info("epoch %d val %s", epoch, res)
        if rank == 0 and res["R@1"] > best:
            best = res["R@1"]
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "val": res},
                       os.path.join(args.out, "best.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
