"""Step-based video-text contrastive pretraining on WebVid-10M, initialised from OpenAI CLIP ViT-B/16.

Videos are read straight from the tar-extracted mp4 tree; a small fraction of WebVid files
are corrupt or zero-length, so the dataset reports a per-sample ok flag instead of raising.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        09_webvid10m_clip_pretrain_steps.py --max_steps 60000 --out /shared/exp/wv10m_b16
"""
import argparse
import math
import os
import random
import time

import numpy as np
import open_clip
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

p = argparse.ArgumentParser()
p.add_argument("--csv", default="/shared/webvid/results_10M_train.csv")
p.add_argument("--video_root", default="/shared/webvid/videos")
p.add_argument("--frames", type=int, default=8)
p.add_argument("--batch_size", type=int, default=48)
p.add_argument("--max_steps", type=int, default=60000)
p.add_argument("--warmup_steps", type=int, default=2000)
p.add_argument("--lr", type=float, default=5e-6)
p.add_argument("--save_every", type=int, default=5000)
p.add_argument("--out", default="/shared/exp/wv10m_b16")
p.add_argument("--workers", type=int, default=10)
args = p.parse_args()

MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


class WebVid(Dataset):
    def __init__(self, csv_path, root, frames, tokenizer):
        df = pd.read_csv(csv_path, usecols=["videoid", "name", "page_dir"])
        self.paths = [os.path.join(root, d, f"{v}.mp4") for v, d in zip(df.videoid, df.page_dir)]
        self.caps = df.name.astype(str).tolist()
        self.frames = frames
        self.tok = tokenizer
        self.tf = T.Compose([T.RandomResizedCrop(224, scale=(0.5, 1.0), antialias=True), T.Normalize(MEAN, STD)])

    def __len__(self):
        return len(self.paths)

    def load(self, path):
        vr = VideoReader(path, ctx=cpu(0), num_threads=1, width=320, height=180)
        n = len(vr)
        if n < 1:
            raise ValueError("empty video")
        cuts = np.linspace(0, n, self.frames + 1).astype(int)
        ids = [random.randint(a, max(a, b - 1)) for a, b in zip(cuts[:-1], cuts[1:])]
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        return self.tf(x)

    def __getitem__(self, i):
        tokens = self.tok([self.caps[i]])[0]
        try:
            return self.load(self.paths[i]), tokens, True
        except Exception:
            return torch.zeros(self.frames, 3, 224, 224), tokens, False


class VideoCLIP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.clip = open_clip.create_model("ViT-B-16", pretrained="openai")

    def forward(self, video, tokens):
        b, t = video.shape[:2]
        v = self.clip.encode_image(video.flatten(0, 1), normalize=True).view(b, t, -1).mean(1)
        return F.normalize(v, dim=-1), self.clip.encode_text(tokens, normalize=True), self.clip.logit_scale.exp()


def gather_keep_grad(x):
    world = dist.get_world_size()
    xs = [torch.zeros_like(x) for _ in range(world)]
    dist.all_gather(xs, x)
    xs[dist.get_rank()] = x
    return torch.cat(xs)


def lr_at(step):
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def save(model, opt, sched, step, epoch):
    path = os.path.join(args.out, f"step_{step:07d}.pt")
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "step": step, "epoch": epoch}, path + ".partial")
    os.replace(path + ".partial", path)
    print(f"saved {path}", flush=True)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(0)

    tokenizer = open_clip.get_tokenizer("ViT-B-16")
    ds = WebVid(args.csv, args.video_root, args.frames, tokenizer)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)

    model = DDP(VideoCLIP().to(device), device_ids=[local_rank], gradient_as_bucket_view=True)
    decay, no_decay = [], []
    for n, prm in model.named_parameters():
        (no_decay if prm.ndim < 2 or "logit_scale" in n else decay).append(prm)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    scaler = torch.cuda.amp.GradScaler()

    step, epoch, n_skipped = 0, 0, 0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    t_last = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for video, tokens, ok in loader:
            if not ok.all():
                n_skipped += 1
                continue
            video = video.to(device, non_blocking=True)
            tokens = tokens.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                v, t, scale = model(video, tokens)
                v_all, t_all = gather_keep_grad(v), gather_keep_grad(t)
                logits = scale * v_all @ t_all.t()
                labels = torch.arange(logits.shape[0], device=device)
                loss = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            with torch.no_grad():
                model.module.clip.logit_scale.clamp_(0, math.log(100))
            step += 1

            if step % 100 == 0 and rank == 0:
                dt = (time.time() - t_last) / 100
                t_last = time.time()
                print(f"step {step}/{args.max_steps} ep {epoch} loss {loss.item():.4f} scale {scale.item():.1f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {dt:.2f}s/it "
                      f"{args.batch_size * world / dt:.0f} clips/s skipped {n_skipped}", flush=True)
            if step % args.save_every == 0 and rank == 0:
                save(model, opt, sched, step, epoch)
            if step >= args.max_steps:
                break
        epoch += 1

    if rank == 0:
        save(model, opt, sched, step, epoch)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
