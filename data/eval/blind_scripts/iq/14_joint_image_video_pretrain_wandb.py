"""Joint image-video contrastive pretraining (WebVid-2M clips + CC3M images as 1-frame videos).

Batches alternate between the two sources: even steps video, odd steps image.

    torchrun --nproc_per_node=8 14_joint_image_video_pretrain_wandb.py \
        --webvid_csv /data/webvid/results_2M_train.csv --cc3m_tsv /data/cc3m/train.tsv --run_name joint_b32
"""
import argparse
import math
import os
import random

import numpy as np
import open_clip
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from decord import VideoReader, cpu
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--webvid_csv", required=True)
    ap.add_argument("--webvid_dir", default="/data/webvid/videos")
    ap.add_argument("--cc3m_tsv", required=True)
    ap.add_argument("--cc3m_dir", default="/data/cc3m/images")
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--video_bs", type=int, default=32)
    ap.add_argument("--image_bs", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--run_name", default="joint_b32")
    ap.add_argument("--ckpt_dir", default="/checkpoints/joint")
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class WebVidClips(Dataset):
    def __init__(self, csv_file, root, frames, tok):
        df = pd.read_csv(csv_file)
        self.paths = [os.path.join(root, str(d), f"{v}.mp4") for v, d in zip(df["videoid"], df["page_dir"])]
        self.caps = df["name"].astype(str).tolist()
        self.frames, self.tok = frames, tok
        self.tf = T.Compose([T.RandomResizedCrop(224, scale=(0.5, 1.0), antialias=True), T.Normalize(MEAN, STD)])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        try:
            vr = VideoReader(self.paths[i], ctx=cpu(0), num_threads=1)
        except Exception:
            return self[random.randrange(len(self))]
        cuts = np.linspace(0, len(vr), self.frames + 1).astype(int)
        ids = [random.randint(a, max(a, b - 1)) for a, b in zip(cuts[:-1], cuts[1:])]
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        return self.tf(x), self.tok([self.caps[i]])[0]


class CC3MImages(Dataset):
    def __init__(self, tsv, root, tok):
        df = pd.read_csv(tsv, sep="\t", names=["caption", "file"])
        self.items = list(zip(df["file"], df["caption"]))
        self.root, self.tok = root, tok
        self.tf = T.Compose([T.RandomResizedCrop(224, scale=(0.5, 1.0)), T.ToTensor(), T.Normalize(MEAN, STD)])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        f, cap = self.items[i]
        try:
            img = Image.open(os.path.join(self.root, f)).convert("RGB")
        except Exception:
            return self[random.randrange(len(self))]
        return self.tf(img).unsqueeze(0), self.tok([cap])[0]


class VideoCLIP(nn.Module):
    def __init__(self, frames):
        super().__init__()
        self.clip = open_clip.create_model("ViT-B-32", pretrained="laion2b_s34b_b79k")
        width = self.clip.visual.output_dim
        self.time_embed = nn.Parameter(torch.zeros(frames, width))

    def forward(self, x, tokens):
        b, t = x.shape[:2]
        f = self.clip.encode_image(x.flatten(0, 1)).view(b, t, -1) + self.time_embed[:t]
        v = F.normalize(f.mean(1), dim=-1)
        return v, self.clip.encode_text(tokens, normalize=True), self.clip.logit_scale.exp()


def gather_cat(x):
    parts = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    parts[dist.get_rank()] = x
    return torch.cat(parts)


def contrastive(v, t, scale):
    v, t = gather_cat(v), gather_cat(t)
    logits = scale * v @ t.t()
    y = torch.arange(len(logits), device=logits.device)
    return (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y)) / 2


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(100 + rank)
    torch.manual_seed(100)

    wandb.init(project="video-language-pretrain", name=args.run_name, config=vars(args))

    tok = open_clip.get_tokenizer("ViT-B-32")
    vid_ds = WebVidClips(args.webvid_csv, args.webvid_dir, args.frames, tok)
    img_ds = CC3MImages(args.cc3m_tsv, args.cc3m_dir, tok)
    vid_sampler = DistributedSampler(vid_ds, shuffle=True)
    img_sampler = DistributedSampler(img_ds, shuffle=True)
    vid_loader = DataLoader(vid_ds, args.video_bs, sampler=vid_sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True, persistent_workers=True)
    img_loader = DataLoader(img_ds, args.image_bs, sampler=img_sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True, persistent_workers=True)
    steps_per_epoch = 2 * min(len(vid_loader), len(img_loader))

    model = DDP(VideoCLIP(args.frames).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.98))
    total = steps_per_epoch * args.epochs
    warm = int(0.05 * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    scaler = torch.cuda.amp.GradScaler()

    step = 0
    for epoch in range(args.epochs):
        vid_sampler.set_epoch(epoch)
        img_sampler.set_epoch(epoch)
        model.train()
        for (xv, tv), (xi, ti) in zip(vid_loader, img_loader):
            for kind, x, tokens in (("video", xv, tv), ("image", xi, ti)):
                x, tokens = x.to(device, non_blocking=True), tokens.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    v, t, scale = model(x, tokens)
                    loss = contrastive(v, t, scale)
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                sched.step()
                with torch.no_grad():
                    model.module.clip.logit_scale.clamp_(0, math.log(100))
                step += 1
                if step % 20 == 0:
                    wandb.log({f"loss/{kind}": loss.item(), "grad_norm": gnorm.item(), "logit_scale": scale.item(),
                               "lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        if rank == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
            path = os.path.join(args.ckpt_dir, f"{args.run_name}_ep{epoch}.pt")
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}, path)
            print(f"saved {path}", flush=True)
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
