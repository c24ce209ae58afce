#!/usr/bin/env python3
# VATEX text-video retrieval with the OpenAI CLIP package.
# One caption per video is drawn at random for each training sample; the test split is
# scored with all 10 English captions of every video (10*N queries x N videos).
#
#   torchrun --standalone --nproc_per_node=8 03_vatex_clip_multicap.py --cfg configs/vatex_b16.yaml
import argparse
import json
import os
import random
import time

import clip
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import Compose, Normalize, Resize, CenterCrop, InterpolationMode

DEFAULTS = dict(
    ann_dir="data/vatex/annotations",
    video_dir="data/vatex/videos",
    backbone="ViT-B/16",
    num_frames=12,
    batch_size=24,
    epochs=8,
    lr=2e-6,
    head_lr=1e-4,
    weight_decay=0.2,
    warmup_epochs=1,
    num_workers=10,
    out_dir="output/vatex_b16",
    eval_every=1,
)


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    ap.add_argument("--opts", nargs="*", default=[])
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.cfg:
        with open(a.cfg) as f:
            cfg.update(yaml.safe_load(f) or {})
    for kv in a.opts:
        k, v = kv.split("=", 1)
        cfg[k] = type(cfg[k])(v) if k in cfg else v
    return argparse.Namespace(**cfg)


PREPROC = Compose([
    Resize(224, interpolation=InterpolationMode.BICUBIC, antialias=True),
    CenterCrop(224),
    Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
])


def read_clip(path, n, jitter):
    vr = VideoReader(path, ctx=cpu(0))
    total = len(vr)
    bounds = np.linspace(0, total, n + 1)
    if jitter:
        ids = [int(random.uniform(bounds[i], bounds[i + 1])) for i in range(n)]
    else:
        ids = [int((bounds[i] + bounds[i + 1]) / 2) for i in range(n)]
    ids = [min(i, total - 1) for i in ids]
    x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
    return PREPROC(x)


class VatexDataset(Dataset):
    def __init__(self, cfg, split):
        with open(os.path.join(cfg.ann_dir, f"vatex_{split}.json")) as f:
            self.ann = [a for a in json.load(f) if os.path.exists(os.path.join(cfg.video_dir, a["videoID"] + ".mp4"))]
        self.cfg = cfg
        self.train = split == "train"

    def __len__(self):
        return len(self.ann)

    def __getitem__(self, i):
        a = self.ann[i]
        video = read_clip(os.path.join(self.cfg.video_dir, a["videoID"] + ".mp4"), self.cfg.num_frames, self.train)
        caps = a["enCap"]
        if self.train:
            return video, clip.tokenize(random.choice(caps), truncate=True)[0]
        return video, clip.tokenize(caps[:10], truncate=True), i


class VideoTextModel(nn.Module):
    def __init__(self, backbone, num_frames):
        super().__init__()
        self.clip, _ = clip.load(backbone, device="cpu", jit=False)
        self.clip.float()
        dim = self.clip.text_projection.shape[1]
        self.frame_pos = nn.Parameter(torch.zeros(num_frames, dim))
        self.frame_attn = nn.Sequential(nn.Linear(dim, dim // 4), nn.GELU(), nn.Linear(dim // 4, 1))

    def encode_video(self, video):
        b, t = video.shape[:2]
        f = self.clip.encode_image(video.flatten(0, 1)).view(b, t, -1) + self.frame_pos[:t]
        w = self.frame_attn(f).softmax(dim=1)
        return F.normalize((w * f).sum(1), dim=-1)

    def encode_text(self, tokens):
        return F.normalize(self.clip.encode_text(tokens), dim=-1)

    def forward(self, video, tokens):
        return self.encode_video(video), self.encode_text(tokens), self.clip.logit_scale.exp()


def all_gather_with_grad(x):
    xs = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(xs, x)
    xs[dist.get_rank()] = x
    return torch.cat(xs, 0)


def t2v_metrics(sim, caps_per_video):
    # sim: [num_videos * caps, num_videos]
    gt = torch.arange(sim.shape[1], device=sim.device).repeat_interleave(caps_per_video)
    ranks = (sim > sim[torch.arange(len(gt)), gt][:, None]).sum(1).float()
    return {f"R@{k}": 100.0 * (ranks < k).float().mean().item() for k in (1, 5, 10)} | {
        "MdR": ranks.median().item() + 1, "MnR": ranks.mean().item() + 1}


@torch.no_grad()
def evaluate(model, loader, num_items, device):
    net = model.module
    net.eval()
    out = []
    for video, tokens, idx in loader:
        v = net.encode_video(video.to(device))
        t = net.encode_text(tokens.to(device).flatten(0, 1)).view(tokens.shape[0], tokens.shape[1], -1)
        out.append((idx, v.cpu(), t.cpu()))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    vids = torch.zeros(num_items, out[0][1].shape[-1])
    txts = torch.zeros(num_items, 10, out[0][1].shape[-1])
    for shard in gathered:
        for idx, v, t in shard:
            vids[idx], txts[idx] = v, t
    net.train()
    sim = txts.flatten(0, 1).to(device) @ vids.to(device).t()
    return t2v_metrics(sim, 10)


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0
    torch.manual_seed(1234)
    np.random.seed(1234 + rank)
    random.seed(1234 + rank)

    train_ds = VatexDataset(cfg, "train")
    test_ds = VatexDataset(cfg, "test")
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.num_workers,
                              pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=16, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=cfg.num_workers, pin_memory=True)

    model = VideoTextModel(cfg.backbone, cfg.num_frames).to(device)
    backbone = [p for n, p in model.named_parameters() if n.startswith("clip.")]
    head = [p for n, p in model.named_parameters() if not n.startswith("clip.")]
    optimizer = torch.optim.AdamW([{"params": backbone, "lr": cfg.lr}, {"params": head, "lr": cfg.head_lr}],
                                  weight_decay=cfg.weight_decay)
    iters_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=[cfg.lr, cfg.head_lr], total_steps=cfg.epochs * iters_per_epoch,
        pct_start=cfg.warmup_epochs / cfg.epochs, anneal_strategy="cos")
    model = DistributedDataParallel(model, device_ids=[local_rank])
    scaler = torch.cuda.amp.GradScaler()

    if is_main:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(vars(cfg), f, indent=2)

    best = -1.0
    for epoch in range(cfg.epochs):
        model.train()
        tic = time.time()
        for it, (video, tokens) in enumerate(train_loader):
            video = video.to(device, non_blocking=True)
            tokens = tokens.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                v, t, scale = model(video, tokens)
                v, t = all_gather_with_grad(v), all_gather_with_grad(t)
                logits = scale * v @ t.t()
                target = torch.arange(logits.shape[0], device=device)
                loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            model.module.clip.logit_scale.data.clamp_(max=np.log(100))
            if is_main and it % 50 == 0:
                print(f"[{epoch}][{it}/{iters_per_epoch}] loss={loss.item():.4f} "
                      f"T={scale.item():.1f} {(time.time() - tic) / (it + 1):.3f}s/it", flush=True)

        if (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs:
            res = evaluate(model, test_loader, len(test_ds), device)
            if is_main:
                print(f"epoch {epoch}: {res}", flush=True)
                if res["R@1"] > best:
                    best = res["R@1"]
                    torch.save({"epoch": epoch, "state_dict": model.module.state_dict(), "metrics": res},
                               os.path.join(cfg.out_dir, "best.pth"))
            dist.barrier()

    if is_main:
        print(f"done, best t2v R@1 = {best:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
