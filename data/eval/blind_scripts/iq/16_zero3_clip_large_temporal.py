"""CLIP ViT-L/14@336 + temporal transformer for text-video retrieval, DeepSpeed ZeRO-3.

    deepspeed --num_gpus 8 16_zero3_clip_large_temporal.py --ds_config configs/zero3_bf16.json \
        --data_root /data/msrvtt --output_dir /ckpt/vitl336_tt
configs/zero3_bf16.json:
    {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "bf16": {"enabled": true},
     "zero_optimization": {"stage": 3, "overlap_comm": true, "stage3_gather_16bit_weights_on_model_save": true},
     "gradient_clipping": 1.0}
"""
import argparse
import json
import math
import os
import random

import deepspeed
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as distnn
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from transformers import CLIPModel, CLIPTokenizerFast


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", default="/data/msrvtt")
    ap.add_argument("--clip_name", default="openai/clip-vit-large-patch14-336")
    ap.add_argument("--output_dir", default="/ckpt/vitl336_tt")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--head_lr", type=float, default=1e-4)
    ap.add_argument("--local_rank", type=int, default=-1)
    ap = deepspeed.add_config_arguments(ap)
    return ap.parse_args()


class MSRVTT(Dataset):
    def __init__(self, root, split, frames, tok):
        self.video_dir = os.path.join(root, "videos")
        self.frames, self.tok, self.train = frames, tok, split == "train"
        if self.train:
            keep = set(pd.read_csv(os.path.join(root, "MSRVTT_train.9k.csv"))["video_id"])
            with open(os.path.join(root, "MSRVTT_data.json")) as f:
                self.items = [(s["video_id"], s["caption"]) for s in json.load(f)["sentences"] if s["video_id"] in keep]
        else:
            df = pd.read_csv(os.path.join(root, "MSRVTT_JSFUSION_test.csv"))
            self.items = list(zip(df["video_id"], df["sentence"]))
        self.tf = T.Compose([T.Resize(336, antialias=True), T.CenterCrop(336),
                             T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, cap = self.items[i]
        vr = VideoReader(os.path.join(self.video_dir, vid + ".mp4"), ctx=cpu(0), num_threads=1)
        e = np.linspace(0, len(vr), self.frames + 1).astype(int)
        ids = [random.randint(a, max(a, b - 1)) for a, b in zip(e[:-1], e[1:])] if self.train else \
            ((e[:-1] + e[1:]) // 2).tolist()
        x = torch.from_numpy(vr.get_batch(ids).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        enc = self.tok(cap, padding="max_length", truncation=True, max_length=32, return_tensors="pt")
        return self.tf(x), enc.input_ids[0], enc.attention_mask[0], i


class TemporalCLIP(nn.Module):
    def __init__(self, name, frames, layers=4):
        super().__init__()
        self.clip = CLIPModel.from_pretrained(name)
        d = self.clip.config.projection_dim
        self.frame_pos = nn.Embedding(frames, d)
        self.temporal = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 12, 4 * d, batch_first=True), layers)
        nn.init.normal_(self.frame_pos.weight, std=0.01)

    def forward(self, video, input_ids, attention_mask):
        b, t = video.shape[:2]
        f = self.clip.get_image_features(pixel_values=video.flatten(0, 1)).view(b, t, -1)
        f = f + self.temporal(f + self.frame_pos(torch.arange(t, device=f.device)))
        v = F.normalize(f.mean(1), dim=-1)
        txt = F.normalize(self.clip.get_text_features(input_ids=input_ids, attention_mask=attention_mask), dim=-1)
        return v, txt


@torch.no_grad()
def evaluate(engine, loader, n, device):
    engine.eval()
    rows = []
    for x, ids, mask, idx in loader:
        v, t = engine(x.to(device, dtype=torch.bfloat16), ids.to(device), mask.to(device))
        rows.append(torch.cat([v.float(), t.float(), idx.to(device).float()[:, None]], 1))
    local = torch.cat(rows)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    allr = torch.cat(parts)
    d = (local.shape[1] - 1) // 2
    table = torch.zeros(n, 2 * d, device=device)
    table[allr[:, -1].long()] = allr[:, :-1]
    sim = table[:, d:] @ table[:, :d].t()
    r = (sim > sim.diag()[:, None]).sum(1).float()
    engine.train()
    return {"R@1": 100 * (r < 1).float().mean().item(), "R@5": 100 * (r < 5).float().mean().item(),
            "R@10": 100 * (r < 10).float().mean().item(), "MdR": r.median().item() + 1}


def main():
    args = parse_args()
    deepspeed.init_distributed()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank = dist.get_rank()
    random.seed(rank)

    with open(args.deepspeed_config) as f:
        ds_cfg = json.load(f)
    micro_bs = ds_cfg["train_micro_batch_size_per_gpu"]

    tok = CLIPTokenizerFast.from_pretrained(args.clip_name)
    train_set = MSRVTT(args.data_root, "train", args.frames, tok)
    test_set = MSRVTT(args.data_root, "test", args.frames, tok)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, micro_bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, micro_bs, sampler=DistributedSampler(test_set, shuffle=False), num_workers=8)

    model = TemporalCLIP(args.clip_name, args.frames)
    groups = [{"params": [p for n, p in model.named_parameters() if n.startswith("clip.")], "lr": args.lr},
              {"params": [p for n, p in model.named_parameters() if not n.startswith("clip.")], "lr": args.head_lr}]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.2, betas=(0.9, 0.98), eps=1e-6)
    total = len(train_loader) * args.epochs // ds_cfg.get("gradient_accumulation_steps", 1)
    warm = int(0.1 * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: s / max(1, warm) if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    engine, optimizer, _, sched = deepspeed.initialize(args=args, model=model, optimizer=optimizer, lr_scheduler=sched)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for it, (x, ids, mask, _) in enumerate(train_loader):
            x = x.to(device, dtype=torch.bfloat16, non_blocking=True)
            v, t = engine(x, ids.to(device), mask.to(device))
            v_all = torch.cat(distnn.all_gather(v.float()))
            t_all = torch.cat(distnn.all_gather(t.float()))
            logit_scale = engine.module.clip.logit_scale.exp().float()
            logits = logit_scale * t_all @ v_all.t()
            y = torch.arange(len(logits), device=device)
            loss = 0.5 * (F.cross_entropy(logits, y) + F.cross_entropy(logits.t(), y))
            engine.backward(loss)
            engine.step()
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} "
                      f"scale {logit_scale.item():.2f}", flush=True)

        res = evaluate(engine, test_loader, len(test_set), device)
        if rank == 0:
            print(f"epoch {epoch} t2v {res}", flush=True)
        engine.save_checkpoint(args.output_dir, tag=f"epoch_{epoch}", client_state={"epoch": epoch, "t2v": res})
    engine.save_16bit_model(args.output_dir, "pytorch_model.bin")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
