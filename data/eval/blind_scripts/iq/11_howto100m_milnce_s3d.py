"""MIL-NCE video-text pretraining on HowTo100M (S3D video tower, DistilBERT text tower).

Each training clip comes with its K temporally closest ASR captions, all treated as positives.
Negatives are the clips / captions of every rank.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node01:29500 \
        11_howto100m_milnce_s3d.py --batch_size 64 --epochs 150 --output /nfs/exp/milnce_s3d
"""
import argparse
import json
import math
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import S3D_Weights, s3d
from transformers import AutoModel, AutoTokenizer

MEAN = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
STD = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)

parser = argparse.ArgumentParser()
parser.add_argument("--train_csv", default="/nfs/howto100m/HowTo100M_v1.csv")
parser.add_argument("--caption_json", default="/nfs/howto100m/caption.json")
parser.add_argument("--video_root", default="/nfs/howto100m/videos")
parser.add_argument("--num_frames", type=int, default=32)
parser.add_argument("--fps", type=int, default=10)
parser.add_argument("--num_candidates", type=int, default=4)
parser.add_argument("--batch_size", type=int, default=64, help="clips per GPU")
parser.add_argument("--epochs", type=int, default=150)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--warmup_steps", type=int, default=5000)
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--output", default="/nfs/exp/milnce_s3d")
parser.add_argument("--workers", type=int, default=16)
parser.add_argument("--resume", action="store_true")


class HowToClips(Dataset):
    def __init__(self, csv_file, caption_json, video_root, num_frames, fps, num_candidates):
        self.videos = pd.read_csv(csv_file)["video_id"].tolist()
        with open(caption_json) as f:
            self.captions = json.load(f)
        self.videos = [v for v in self.videos if v in self.captions]
        self.video_root, self.num_frames, self.fps, self.k = video_root, num_frames, fps, num_candidates

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        vid = self.videos[i]
        cap = self.captions[vid]
        n = len(cap["text"])
        j = random.randrange(n)
        lo, hi = max(0, j - self.k // 2), min(n, j - self.k // 2 + self.k)
        lo = max(0, hi - self.k)
        texts = [cap["text"][m] for m in range(lo, hi)]
        texts += [texts[-1]] * (self.k - len(texts))
        start, end = cap["start"][lo], cap["end"][hi - 1]

        vr = VideoReader(os.path.join(self.video_root, vid + ".mp4"), ctx=cpu(0), num_threads=1, width=256,
                         height=256)
        native = vr.get_avg_fps()
        duration = self.num_frames / self.fps
        t0 = random.uniform(start, max(start, end - duration))
        times = t0 + np.arange(self.num_frames) / self.fps
        ids = np.clip((times * native).astype(int), 0, len(vr) - 1)
        x = torch.from_numpy(vr.get_batch(ids.tolist()).asnumpy()).float() / 255.0   # T H W C
        y0, x0 = random.randint(0, 32), random.randint(0, 32)
        x = x[:, y0:y0 + 224, x0:x0 + 224].permute(3, 0, 1, 2)                      # C T H W
        if random.random() < 0.5:
            x = x.flip(-1)
        return (x - MEAN) / STD, texts


def collate(batch):
    videos = torch.stack([b[0] for b in batch])
    texts = [t for b in batch for t in b[1]]
    return videos, texts


class MILNCEModel(nn.Module):
    def __init__(self, dim=512):
        super().__init__()
        self.video = s3d(weights=S3D_Weights.KINETICS400_V1)
        self.video.classifier = nn.Identity()
        self.video_proj = nn.Linear(1024, dim)
        self.text = AutoModel.from_pretrained("distilbert-base-uncased")
        self.text_proj = nn.Linear(768, dim)

    def forward(self, video, ids, mask):
        v = self.video.features(video).mean(dim=(2, 3, 4))
        t = self.text(input_ids=ids, attention_mask=mask).last_hidden_state
        t = (t * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return self.video_proj(v), self.text_proj(t)


def all_gather_grad(x):
    out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    out[dist.get_rank()] = x
    return torch.cat(out)


def milnce_loss(v, t, k):
    # v: [N, D], t: [N*k, D]
    sim = v @ t.t()                                  # N x N*k
    sim = sim.view(v.shape[0], v.shape[0], k)        # clip i vs candidate set j
    pos = torch.logsumexp(sim.diagonal(dim1=0, dim2=1).t(), dim=1)
    neg = torch.logsumexp(torch.cat([sim.flatten(1), sim.permute(1, 0, 2).flatten(1)], dim=1), dim=1)
    return (neg - pos).mean()


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1 + rank)

    tokenizer = AutoTokenizer.from_pretrained("distilbert-base-uncased")
    dataset = HowToClips(args.train_csv, args.caption_json, args.video_root, args.num_frames, args.fps,
                         args.num_candidates)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=collate, pin_memory=True, drop_last=True, persistent_workers=True)

    model = MILNCEModel().to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    total_steps = len(dataset) // args.batch_size * args.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, s / args.warmup_steps) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))

    start_epoch = 0
    ckpt_path = os.path.join(args.output, "checkpoint.pth.tar")
    if args.resume and os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["state_dict"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch = ck["epoch"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running = 0.0
        for i, (video, texts) in enumerate(loader):
            enc = tokenizer(texts, padding=True, truncation=True, max_length=24, return_tensors="pt")
            video = video.to(device, non_blocking=True)
            ids, mask = enc.input_ids.to(device), enc.attention_mask.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                v, t = model(video, ids, mask)
            v, t = all_gather_grad(v.float()), all_gather_grad(t.float())
            loss = milnce_loss(v, t, args.num_candidates)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += loss.item()
            if rank == 0 and (i + 1) % 100 == 0:
                print(f"epoch {epoch} [{i + 1}/{len(loader)}] loss {running / 100:.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
                running = 0.0

        if rank == 0:
            os.makedirs(args.output, exist_ok=True)
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       ckpt_path)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
