"""CLIP4Clip (seqTransf) on top of the Hugging Face CLIP checkpoint.

torchrun --nproc_per_node=4 02_clip4clip_seqtransf_hf.py \
    --train_json data/msrvtt/train_9k.json --test_json data/msrvtt/test_1k.json \
    --video_root data/msrvtt/frames --batch_size 32 --accum 2
"""
import argparse
import json
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision import transforms
from transformers import CLIPModel, CLIPTokenizer, get_cosine_schedule_with_warmup


class FrameFolderDataset(Dataset):
    """Each video is a folder of pre-extracted JPEG frames (1 fps); annotations map video -> captions."""

    def __init__(self, ann_file, video_root, tokenizer, max_frames=12, max_words=32, train=True):
        with open(ann_file) as f:
            ann = json.load(f)
        self.items = []
        for entry in ann:
            caps = entry["caption"] if isinstance(entry["caption"], list) else [entry["caption"]]
            if train:
                self.items.extend((entry["video"], c) for c in caps)
            else:
                self.items.append((entry["video"], caps[0]))
        self.video_root = video_root
        self.tok = tokenizer
        self.max_frames = max_frames
        self.max_words = max_words
        self.train = train
        self.tf = transforms.Compose([
            transforms.Resize(224, interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
        ])

    def __len__(self):
        return len(self.items)

    def _frame_ids(self, n):
        if n <= self.max_frames:
            return list(range(n))
        if self.train:
            seg = np.linspace(0, n, self.max_frames + 1).astype(int)
            return [random.randrange(seg[i], seg[i + 1]) for i in range(self.max_frames)]
        return np.linspace(0, n - 1, self.max_frames).astype(int).tolist()

    def __getitem__(self, idx):
        video, caption = self.items[idx]
        folder = os.path.join(self.video_root, video)
        files = sorted(os.listdir(folder))
        ids = self._frame_ids(len(files))
        frames = torch.stack([self.tf(Image.open(os.path.join(folder, files[i])).convert("RGB")) for i in ids])
        mask = torch.zeros(self.max_frames, dtype=torch.long)
        mask[: len(ids)] = 1
        if len(ids) < self.max_frames:
            frames = torch.cat([frames, frames.new_zeros(self.max_frames - len(ids), *frames.shape[1:])])
        enc = self.tok(caption, padding="max_length", truncation=True, max_length=self.max_words, return_tensors="pt")
        return {"frames": frames, "frame_mask": mask, "input_ids": enc.input_ids[0],
                "attention_mask": enc.attention_mask[0], "index": idx}


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.rank, ctx.bs = dist.get_rank(), x.shape[0]
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return torch.cat(out, 0)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.bs:(ctx.rank + 1) * ctx.bs]


class CLIP4Clip(nn.Module):
    def __init__(self, name, max_frames, temporal_layers=4):
        super().__init__()
        self.clip = CLIPModel.from_pretrained(name)
        width = self.clip.config.projection_dim
        self.frame_pos = nn.Embedding(max_frames, width)
        layer = nn.TransformerEncoderLayer(width, nhead=8, dim_feedforward=width * 4, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.temporal = nn.TransformerEncoder(layer, temporal_layers)
        nn.init.zeros_(self.frame_pos.weight)

    def encode_text(self, input_ids, attention_mask):
        return F.normalize(self.clip.get_text_features(input_ids=input_ids, attention_mask=attention_mask), dim=-1)

    def encode_video(self, frames, frame_mask):
        b, t = frames.shape[:2]
        x = self.clip.get_image_features(pixel_values=frames.flatten(0, 1)).view(b, t, -1)
        pos = self.frame_pos(torch.arange(t, device=x.device))
        x = x + self.temporal(x + pos, src_key_padding_mask=frame_mask == 0)  # residual as in CLIP4Clip
        m = frame_mask.unsqueeze(-1).to(x.dtype)
        x = (x * m).sum(1) / m.sum(1).clamp(min=1.0)
        return F.normalize(x, dim=-1)

    def forward(self, frames, frame_mask, input_ids, attention_mask):
        v = self.encode_video(frames, frame_mask)
        t = self.encode_text(input_ids, attention_mask)
        return v, t, self.clip.logit_scale.exp()


def contrastive_loss(v, t, scale):
    v, t = AllGather.apply(v), AllGather.apply(t)
    logits = scale * t @ v.t()
    target = torch.arange(len(logits), device=logits.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))


@torch.no_grad()
def evaluate(model, loader, n_items, device):
    net = model.module
    net.eval()
    feats_v, feats_t, index = [], [], []
    for b in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            feats_v.append(net.encode_video(b["frames"].to(device), b["frame_mask"].to(device)).float())
            feats_t.append(net.encode_text(b["input_ids"].to(device), b["attention_mask"].to(device)).float())
        index.append(b["index"].to(device))
    local = torch.cat([torch.cat(feats_v), torch.cat(feats_t)], dim=1)
    idx = torch.cat(index)
    world = dist.get_world_size()
    all_local = [torch.empty_like(local) for _ in range(world)]
    all_idx = [torch.empty_like(idx) for _ in range(world)]
    dist.all_gather(all_local, local)
    dist.all_gather(all_idx, idx)
    # the sampler pads the last shard with repeated items; writing by index drops the copies
    full = torch.zeros(n_items, local.shape[1], device=device)
    full[torch.cat(all_idx)] = torch.cat(all_local)
    d = local.shape[1] // 2
    sim = full[:, d:] @ full[:, :d].t()
    ranks = (sim > sim.diag().unsqueeze(1)).sum(1).float()
    net.train()
    return {"R1": (ranks < 1).float().mean().item() * 100, "R5": (ranks < 5).float().mean().item() * 100,
            "R10": (ranks < 10).float().mean().item() * 100, "MdR": ranks.median().item() + 1}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_json", required=True)
    ap.add_argument("--test_json", required=True)
    ap.add_argument("--video_root", required=True)
    ap.add_argument("--clip", default="openai/clip-vit-base-patch32")
    ap.add_argument("--max_frames", type=int, default=12)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr_clip", type=float, default=1e-7)
    ap.add_argument("--lr_new", type=float, default=1e-4)
    ap.add_argument("--out", default="checkpoints/clip4clip_seqtransf")
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(0)

    tok = CLIPTokenizer.from_pretrained(args.clip)
    train_ds = FrameFolderDataset(args.train_json, args.video_root, tok, args.max_frames, train=True)
    test_ds = FrameFolderDataset(args.test_json, args.video_root, tok, args.max_frames, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    test_sampler = DistributedSampler(test_ds, shuffle=False)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, 64, sampler=test_sampler, num_workers=8, pin_memory=True)

    model = CLIP4Clip(args.clip, args.max_frames).to(device)
    clip_params = [p for n, p in model.named_parameters() if n.startswith("clip.")]
    new_params = [p for n, p in model.named_parameters() if not n.startswith("clip.")]
    opt = torch.optim.AdamW([{"params": clip_params, "lr": args.lr_clip},
                             {"params": new_params, "lr": args.lr_new}], weight_decay=0.2)
    steps = math.ceil(len(train_dl) / args.accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.1 * steps), steps)

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        sched.load_state_dict(ckpt["sched"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, b in enumerate(train_dl):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            sync = (it + 1) % args.accum == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx, torch.autocast("cuda", dtype=torch.bfloat16):
                v, t, scale = model(b["frames"], b["frame_mask"], b["input_ids"], b["attention_mask"])
                loss = contrastive_loss(v.float(), t.float(), scale) / args.accum
            loss.backward()
            if sync:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    model.module.clip.logit_scale.clamp_(0, 4.6052)
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it}/{len(train_dl)} loss {loss.item() * args.accum:.4f}", flush=True)

        res = evaluate(model, test_dl, len(test_ds), device)
        if rank == 0:
            print(f"epoch {epoch} t2v {res}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optim": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "t2v": res},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
