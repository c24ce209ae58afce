"""CLIP4Clip-style (mean pooling) text-to-video retrieval fine-tuning on MSR-VTT.

Frames are pre-extracted at 1 fps into <frames_dir>/<video_id>/%05d.jpg.

    torchrun --nproc_per_node=4 02_msrvtt_clip_meanpool.py --config configs/msrvtt_9k.yaml
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms
from transformers import CLIPModel, CLIPTokenizer

DEFAULTS = dict(
    clip_name="openai/clip-vit-base-patch32",
    anno_train="data/msrvtt/train_9k.json",
    anno_test="data/msrvtt/test_1k.json",
    frames_dir="data/msrvtt/frames_1fps",
    num_frames=12,
    max_words=32,
    batch_size=32,  # per GPU
    epochs=5,
    lr=1e-7,
    head_lr=1e-4,
    warmup_ratio=0.1,
    num_workers=8,
    output_dir="runs/msrvtt_meanpool",
    seed=42,
)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--checkpoint", default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["eval_only"] = args.eval_only
    cfg["checkpoint"] = args.checkpoint
    return argparse.Namespace(**cfg)


class MSRVTT(Dataset):
    def __init__(self, anno, frames_dir, tokenizer, num_frames, max_words, train):
        with open(anno) as f:
            rows = json.load(f)
        if train:
            # one item per (video, caption) pair
            self.items = [(r["video_id"], c) for r in rows for c in r["captions"]]
        else:
            self.items = [(r["video_id"], r["captions"][0]) for r in rows]
        self.frames_dir = frames_dir
        self.tok = tokenizer
        self.num_frames = num_frames
        self.max_words = max_words
        self.train = train
        self.tf = transforms.Compose([
            transforms.Resize(224, interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize(CLIP_MEAN, CLIP_STD),
        ])

    def __len__(self):
        return len(self.items)

    def _sample(self, n):
        if n <= self.num_frames:
            return list(range(n))
        if self.train:
            edges = np.linspace(0, n, self.num_frames + 1).astype(int)
            return [random.randrange(a, max(a + 1, b)) for a, b in zip(edges[:-1], edges[1:])]
        return np.linspace(0, n - 1, self.num_frames).round().astype(int).tolist()

    def __getitem__(self, i):
        vid, caption = self.items[i]
        vdir = os.path.join(self.frames_dir, vid)
        files = sorted(os.listdir(vdir))
        idx = self._sample(len(files))
        frames = torch.zeros(self.num_frames, 3, 224, 224)
        mask = torch.zeros(self.num_frames, dtype=torch.bool)
        for j, k in enumerate(idx):
            frames[j] = self.tf(Image.open(os.path.join(vdir, files[k])).convert("RGB"))
            mask[j] = True
        t = self.tok(caption, padding="max_length", truncation=True,
                     max_length=self.max_words, return_tensors="pt")
        return frames, mask, t["input_ids"][0], t["attention_mask"][0]


class MeanPoolCLIP(nn.Module):
    def __init__(self, clip_name):
        super().__init__()
        self.clip = CLIPModel.from_pretrained(clip_name)
        self.logit_scale = self.clip.logit_scale

    def encode_video(self, frames, mask):
        b, t = frames.shape[:2]
        feats = self.clip.get_image_features(pixel_values=frames.flatten(0, 1)).view(b, t, -1)
        feats = F.normalize(feats, dim=-1)
        m = mask.unsqueeze(-1).to(feats.dtype)
        return F.normalize((feats * m).sum(1) / m.sum(1).clamp(min=1.0), dim=-1)

    def encode_text(self, input_ids, attention_mask):
        return F.normalize(self.clip.get_text_features(input_ids=input_ids,
                                                       attention_mask=attention_mask), dim=-1)

    def forward(self, frames, mask, input_ids, attention_mask):
        return (self.encode_video(frames, mask), self.encode_text(input_ids, attention_mask),
                self.logit_scale.exp().clamp(max=100))


def contrastive_loss(v, t, scale):
    # gather with autograd so every rank sees the global batch as negatives
    all_v = torch.cat(dist_fn.all_gather(v), 0)
    all_t = torch.cat(dist_fn.all_gather(t), 0)
    rank = dist.get_rank()
    labels = torch.arange(v.size(0), device=v.device) + rank * v.size(0)
    l_t2v = F.cross_entropy(scale * t @ all_v.t(), labels)
    l_v2t = F.cross_entropy(scale * v @ all_t.t(), labels)
    return (l_t2v + l_v2t) / 2


def recall_at_k(sim):
    # sim[i, j]: text i vs video j; ground truth on the diagonal
    order = torch.argsort(sim, dim=1, descending=True)
    gt = torch.arange(sim.size(0), device=sim.device).unsqueeze(1)
    ranks = (order == gt).float().argmax(dim=1) + 1
    out = {f"R@{k}": (ranks <= k).float().mean().item() * 100 for k in (1, 5, 10)}
    out["MdR"] = ranks.float().median().item()
    out["MnR"] = ranks.float().mean().item()
    return out


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    vids, txts = [], []
    for frames, mask, ids, att in loader:
        frames, mask = frames.to(device, non_blocking=True), mask.to(device)
        ids, att = ids.to(device), att.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            vids.append(model.module.encode_video(frames, mask).float())
            txts.append(model.module.encode_text(ids, att).float())
    vids, txts = torch.cat(vids), torch.cat(txts)
    sim = txts @ vids.t()
    t2v = recall_at_k(sim)
    v2t = recall_at_k(sim.t())
    model.train()
    return t2v, v2t


def main():
    cfg = load_config()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device(f"cuda:{local_rank}")

    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed)

    tokenizer = CLIPTokenizer.from_pretrained(cfg.clip_name)
    train_set = MSRVTT(cfg.anno_train, cfg.frames_dir, tokenizer, cfg.num_frames, cfg.max_words, True)
    test_set = MSRVTT(cfg.anno_test, cfg.frames_dir, tokenizer, cfg.num_frames, cfg.max_words, False)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed, drop_last=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=train_sampler,
                              num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=64, sampler=test_sampler,
                             num_workers=cfg.num_workers, pin_memory=True)

    model = MeanPoolCLIP(cfg.clip_name).to(device)
    if cfg.checkpoint:
        sd = torch.load(cfg.checkpoint, map_location="cpu")
        model.load_state_dict(sd["model"] if "model" in sd else sd)
    model = DDP(model, device_ids=[local_rank])

    writer = SummaryWriter(cfg.output_dir) if rank == 0 else None

    if cfg.eval_only:
        t2v, v2t = evaluate(model, test_loader, device)
        if rank == 0:
            print("t2v", t2v, "\nv2t", v2t)
        dist.destroy_process_group()
        return

    clip_params = [p for n, p in model.named_parameters() if "logit_scale" not in n]
    optimizer = torch.optim.AdamW([
        {"params": clip_params, "lr": cfg.lr},
        {"params": [model.module.logit_scale], "lr": cfg.head_lr, "weight_decay": 0.0},
    ], weight_decay=0.2)
    total = cfg.epochs * len(train_loader)
    warm = int(cfg.warmup_ratio * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: s / max(1, warm) if s < warm else 0.5 * (1 + np.cos(np.pi * (s - warm) / max(1, total - warm))))
    scaler = torch.cuda.amp.GradScaler()

    best_r1, step = 0.0, 0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for frames, mask, ids, att in train_loader:
            frames = frames.to(device, non_blocking=True)
            mask, ids, att = mask.to(device), ids.to(device), att.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                v, t, scale = model(frames, mask, ids, att)
            loss = contrastive_loss(v.float(), t.float(), scale.float())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/logit_scale", scale.item(), step)
                print(f"ep {epoch} it {step} loss {loss.item():.4f} "
                      f"{(time.time() - tic) / 50:.2f}s/it", flush=True)
                tic = time.time()

        t2v, v2t = evaluate(model, test_loader, device)
        if rank == 0:
            for k, v in t2v.items():
                writer.add_scalar(f"test/t2v_{k}", v, epoch)
            for k, v in v2t.items():
                writer.add_scalar(f"test/v2t_{k}", v, epoch)
            print(f"epoch {epoch} t2v {t2v} v2t {v2t}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch},
                       os.path.join(cfg.output_dir, f"epoch{epoch}.pt"))
            if t2v["R@1"] > best_r1:
                best_r1 = t2v["R@1"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch},
                           os.path.join(cfg.output_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
