"""SigLIP-style sigmoid loss fine-tuning of a ViT-B/16 + text tower on a noisy
web image-text TSV (image URLs already downloaded to disk; some files are broken).

Sigmoid loss with the "all-gather" variant: every rank scores its local images
against the texts of all ranks.

    torchrun --nproc_per_node=8 05_siglip_sigmoid_loss.py --tsv /data/yfcc15m/yfcc15m_local.tsv \
        --image-root /data/yfcc15m/images --out runs/siglip_b16_yfcc
"""
import argparse
import math
import os

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, SiglipConfig, SiglipImageProcessor, SiglipModel


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--tsv", required=True)
    p.add_argument("--image-root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--init", default="google/siglip-base-patch16-224")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=1000)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--max-len", type=int, default=64)
    return p.parse_args()


class WebPairs(Dataset):
    def __init__(self, tsv, image_root, processor):
        df = pd.read_csv(tsv, sep="\t", usecols=["key", "caption"])
        self.keys = df["key"].astype(str).tolist()
        self.caps = df["caption"].fillna("").astype(str).tolist()
        self.root = image_root
        self.processor = processor

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        path = os.path.join(self.root, self.keys[i][:3], self.keys[i] + ".jpg")
        try:
            img = Image.open(path).convert("RGB")
        except (OSError, UnidentifiedImageError):
            return None
        if not self.caps[i].strip():
            return None
        pix = self.processor(img, return_tensors="pt")["pixel_values"][0]
        return pix, self.caps[i]


class Collator:
    def __init__(self, tokenizer, max_len):
        self.tok = tokenizer
        self.max_len = max_len

    def __call__(self, batch):
        batch = [b for b in batch if b is not None]
        pix = torch.stack([b[0] for b in batch])
        ids = self.tok([b[1] for b in batch], padding="max_length", truncation=True,
                       max_length=self.max_len, return_tensors="pt").input_ids
        return pix, ids


class GatherLayer(torch.autograd.Function):
    """all_gather that keeps the gradient for the local slice."""

    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        all_g = torch.stack(grads)
        dist.all_reduce(all_g)
        return all_g[dist.get_rank()]


def sigmoid_loss(img, txt, t, b, rank, world):
    """Pairwise sigmoid loss of the local images against all texts."""
    all_txt = torch.cat(GatherLayer.apply(txt), dim=0)
    logits = img @ all_txt.t() * t.exp() + b
    n = img.size(0)
    labels = -torch.ones_like(logits)
    labels[torch.arange(n), rank * n + torch.arange(n)] = 1.0
    return -F.logsigmoid(labels * logits).sum() / n


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    processor = SiglipImageProcessor.from_pretrained(args.init)
    tokenizer = AutoTokenizer.from_pretrained(args.init)
    model = SiglipModel.from_pretrained(args.init).to(device)
    model = DDP(model, device_ids=[local_rank])

    ds = WebPairs(args.tsv, args.image_root, processor)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=Collator(tokenizer, args.max_len), pin_memory=True, drop_last=True,
                        persistent_workers=True, prefetch_factor=4)

    no_decay = ("bias", "norm", "logit_scale", "logit_bias", "position_embedding")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([
        {"params": [p for n, p in params if not any(k in n for k in no_decay)], "weight_decay": args.wd},
        {"params": [p for n, p in params if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ], lr=args.lr, betas=(0.9, 0.95))
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup_steps) * 0.5 * (1 + math.cos(math.pi * s / total)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for pix, ids in loader:
            pix = pix.to(device, non_blocking=True)
            ids = ids.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=ids, pixel_values=pix, return_loss=False)
                img = F.normalize(out.image_embeds.float(), dim=-1)
                txt = F.normalize(out.text_embeds.float(), dim=-1)
            m = model.module
            loss = sigmoid_loss(img, txt, m.logit_scale, m.logit_bias, rank, world)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                stat = torch.tensor([loss.item(), pix.size(0)], device=device)
                dist.all_reduce(stat)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {stat[0].item() / world:.4f} "
                          f"global_bs {int(stat[1].item())} t={m.logit_scale.exp().item():.2f} "
                          f"b={m.logit_bias.item():.2f}", flush=True)

        if rank == 0:
            m = model.module
            m.save_pretrained(os.path.join(args.out, f"epoch_{epoch}"))
            processor.save_pretrained(os.path.join(args.out, f"epoch_{epoch}"))
            tokenizer.save_pretrained(os.path.join(args.out, f"epoch_{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
