#!/usr/bin/env python
"""Fine-tune an OpenCLIP image-text model for text-to-video retrieval on MSR-VTT.

Frames are sampled uniformly (CLIP4Clip style), encoded independently and mean-pooled.
In-batch negatives are gathered from all ranks.

    torchrun --nproc_per_node=8 01_openclip_msrvtt_meanp.py --data_root /data/msrvtt
"""
import argparse
import json
import logging
import math
import os
import random
import time
from collections import defaultdict

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import open_clip
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

logger = logging.getLogger("vclip")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", default="data/msrvtt")
    p.add_argument("--train_csv", default="MSRVTT_train.9k.csv")
    p.add_argument("--test_csv", default="MSRVTT_JSFUSION_test.csv")
    p.add_argument("--caption_json", default="MSRVTT_data.json")
    p.add_argument("--video_dir", default="videos/all")
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--pretrained", default="openai")
    p.add_argument("--num_frames", type=int, default=12)
    p.add_argument("--batch_size", type=int, default=32, help="per GPU")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--output_dir", default="runs/openclip_msrvtt")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def build_transform(size, train):
    norm = T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
    if train:
        return T.Compose([T.Resize(size, antialias=True), T.RandomResizedCrop(size, scale=(0.6, 1.0), antialias=True), norm])
    return T.Compose([T.Resize(size, antialias=True), T.CenterCrop(size), norm])


def sample_frames(path, num_frames, train):
    vr = VideoReader(path, ctx=cpu(0), num_threads=1)
    n = len(vr)
    edges = np.linspace(0, n, num_frames + 1).astype(int)
    if train:
        idx = [random.randint(a, max(a, b - 1)) for a, b in zip(edges[:-1], edges[1:])]
    else:
        idx = [(a + max(a, b - 1)) // 2 for a, b in zip(edges[:-1], edges[1:])]
    frames = vr.get_batch(idx).asnumpy()
    return torch.from_numpy(frames).permute(0, 3, 1, 2).float().div_(255.0)


class MSRVTTPairs(Dataset):
    """(video, caption) pairs; train uses every caption, test uses the JSFusion 1k-A sentences."""

    def __init__(self, root, csv_name, caption_json, video_dir, tokenizer, num_frames, train):
        df = pd.read_csv(os.path.join(root, csv_name))
        self.video_dir = os.path.join(root, video_dir)
        self.tokenizer = tokenizer
        self.num_frames = num_frames
        self.train = train
        self.transform = build_transform(224, train)
        if train:
            vids = set(df["video_id"].tolist())
            caps = defaultdict(list)
            with open(os.path.join(root, caption_json)) as f:
                for s in json.load(f)["sentences"]:
                    if s["video_id"] in vids:
                        caps[s["video_id"]].append(s["caption"])
            self.items = [(v, c) for v in sorted(caps) for c in caps[v]]
        else:
            self.items = list(zip(df["video_id"].tolist(), df["sentence"].tolist()))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, cap = self.items[i]
        frames = sample_frames(os.path.join(self.video_dir, vid + ".mp4"), self.num_frames, self.train)
        tokens = self.tokenizer([cap])[0]
        return self.transform(frames), tokens, i


class VideoCLIP(nn.Module):
    def __init__(self, clip_model):
        super().__init__()
        self.clip = clip_model

    def encode_video(self, video):
        b, t = video.shape[:2]
        feats = self.clip.encode_image(video.flatten(0, 1))
        feats = F.normalize(feats, dim=-1).view(b, t, -1).mean(1)
        return F.normalize(feats, dim=-1)

    def encode_text(self, tokens):
        return F.normalize(self.clip.encode_text(tokens), dim=-1)

    def forward(self, video, tokens):
        return self.encode_video(video), self.encode_text(tokens), self.clip.logit_scale.exp()


def gather_features(x):
    """all_gather that keeps the gradient of the local slice."""
    out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    out[dist.get_rank()] = x
    return torch.cat(out)


def gather_varlen(x):
    n = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.cat([x, x.new_zeros((max_n - x.shape[0],) + x.shape[1:])])
    buf = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(buf, padded)
    return torch.cat([b[: int(s.item())] for b, s in zip(buf, sizes)])


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    vids, txts, idxs = [], [], []
    for video, tokens, idx in loader:
        video, tokens = video.to(device, non_blocking=True), tokens.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            vids.append(model.module.encode_video(video).float())
            txts.append(model.module.encode_text(tokens).float())
        idxs.append(idx.to(device))
    v_local, t_local, i_local = torch.cat(vids), torch.cat(txts), torch.cat(idxs)

    v_all = gather_varlen(v_local)
    i_all = gather_varlen(i_local)
    v_all = v_all[i_all.argsort()]

    sim = t_local @ v_all.t()
    gt = sim.gather(1, i_local[:, None])
    rank = (sim > gt).sum(1)
    hits = [(rank < k).sum().item() for k in (1, 5, 10)]
    counts = torch.tensor(hits + [rank.float().add(1).sum().item(), len(rank)], dtype=torch.float64)
    dist.all_reduce(counts)
    n = counts[-1].item()
    model.train()
    return {"R@1": 100 * counts[0].item() / n, "R@5": 100 * counts[1].item() / n,
            "R@10": 100 * counts[2].item() / n, "MeanR": counts[3].item() / n}


def main():
    args = parse_args()
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(levelname)s %(message)s")

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    clip_model, _, _ = open_clip.create_model_and_transforms(args.model, pretrained=args.pretrained)
    tokenizer = open_clip.get_tokenizer(args.model)
    model = VideoCLIP(clip_model).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_set = MSRVTTPairs(args.data_root, args.train_csv, args.caption_json, args.video_dir,
                            tokenizer, args.num_frames, train=True)
    test_set = MSRVTTPairs(args.data_root, args.test_csv, args.caption_json, args.video_dir,
                           tokenizer, args.num_frames, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    test_shard = Subset(test_set, list(range(rank, len(test_set), world)))
    test_loader = DataLoader(test_shard, batch_size=64, num_workers=args.workers, pin_memory=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embedding" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embedding" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    total = len(train_loader) * args.epochs
    warm = int(args.warmup * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm))))
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    best_r1, step = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for video, tokens, _ in train_loader:
            video, tokens = video.to(device, non_blocking=True), tokens.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                v, t, scale = model(video, tokens)
                v_all, t_all = gather_features(v), gather_features(t)
                logits = scale * t_all @ v_all.t()
                labels = torch.arange(logits.shape[0], device=device)
                loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            sched.step()
            with torch.no_grad():
                model.module.clip.logit_scale.clamp_(0, math.log(100))
            step += 1
            if step % 50 == 0:
                logger.info("ep %d step %d/%d loss %.4f scale %.2f lr %.2e %.2fs/it", epoch, step, total,
                            loss.item(), scale.item(), sched.get_last_lr()[0], (time.time() - t0) / 50)
                t0 = time.time()

        metrics = evaluate(model, test_loader, device)
        logger.info("epoch %d test %s", epoch, json.dumps(metrics))
        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "epoch": epoch, "metrics": metrics}
            torch.save(state, os.path.join(args.output_dir, "last.pt"))
            if metrics["R@1"] > best_r1:
                best_r1 = metrics["R@1"]
                torch.save(state, os.path.join(args.output_dir, "best.pt"))
        dist.barrier()

    logger.info("best R@1 %.2f", best_r1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
