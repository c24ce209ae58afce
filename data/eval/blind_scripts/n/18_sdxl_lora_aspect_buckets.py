#!/usr/bin/env python
# SDXL LoRA with aspect-ratio bucketing (kohya-like buckets, 64px steps, ~1MP area), plain DDP.
#   torchrun --nproc_per_node=4 18_sdxl_lora_aspect_buckets.py --data_dir ./dataset --output_dir ./out_sdxl_lora
import argparse
import math
import os
import random
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from PIL import Image
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.utils import convert_state_dict_to_diffusers

BASE = "stabilityai/stable-diffusion-xl-base-1.0"


def make_buckets(max_area=1024 * 1024, min_side=512, max_side=2048, step=64):
    buckets = set()
    w = min_side
    while w <= max_side:
        h = min(max_side, (max_area // w) // step * step)
        if h >= min_side:
            buckets.add((w, h))
            buckets.add((h, w))
        w += step
    return sorted(buckets)


class BucketDataset(Dataset):
    def __init__(self, root, buckets):
        self.items = []
        for p in sorted(Path(root).rglob("*")):
            if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp"):
                txt = p.with_suffix(".txt")
                cap = txt.read_text(encoding="utf-8").strip() if txt.exists() else ""
                with Image.open(p) as im:
                    w, h = im.size
                ar = w / h
                bucket = min(buckets, key=lambda b: abs(b[0] / b[1] - ar))
                self.items.append((str(p), cap, bucket, (h, w)))
        self.to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, cap, (bw, bh), orig = self.items[i]
        img = Image.open(path).convert("RGB")
        scale = max(bw / img.width, bh / img.height)
        img = img.resize((math.ceil(img.width * scale), math.ceil(img.height * scale)), Image.BICUBIC)
        left, top = (img.width - bw) // 2, (img.height - bh) // 2
        img = img.crop((left, top, left + bw, top + bh))
        if random.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        return {"pixel_values": self.to_tensor(img), "caption": cap, "original_size": orig, "crop": (top, left),
                "target_size": (bh, bw)}


class BucketBatchSampler:
    """Each rank takes its slice of the dataset, then groups its images by bucket."""

    def __init__(self, dataset, batch_size, rank, world, seed=0):
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.by_bucket = defaultdict(list)
        for idx in range(rank, len(dataset), world):
            self.by_bucket[dataset.items[idx][2]].append(idx)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = random.Random(self.seed + self.epoch)
        batches = []
        for idxs in self.by_bucket.values():
            idxs = idxs[:]
            rng.shuffle(idxs)
            batches += [idxs[i : i + self.batch_size] for i in range(0, len(idxs), self.batch_size)]
        rng.shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


def collate(examples):
    return {
        "pixel_values": torch.stack([e["pixel_values"] for e in examples]),
        "captions": [e["caption"] for e in examples],
        "time_ids": torch.tensor([list(e["original_size"]) + list(e["crop"]) + list(e["target_size"]) for e in examples],
                                 dtype=torch.float32),
    }


@torch.no_grad()
def encode_prompt(captions, tokenizers, text_encoders, device):
    embeds, pooled = [], None
    for tok, te in zip(tokenizers, text_encoders):
        ids = tok(captions, padding="max_length", max_length=tok.model_max_length, truncation=True,
                  return_tensors="pt").input_ids.to(device)
        out = te(ids, output_hidden_states=True)
        pooled = out[0]
        embeds.append(out.hidden_states[-2])
    return torch.cat(embeds, dim=-1), pooled


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--rank_dim", type=int, default=32)
    ap.add_argument("--save_every", type=int, default=1)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    tok1 = CLIPTokenizer.from_pretrained(BASE, subfolder="tokenizer")
    tok2 = CLIPTokenizer.from_pretrained(BASE, subfolder="tokenizer_2")
    te1 = CLIPTextModel.from_pretrained(BASE, subfolder="text_encoder", torch_dtype=torch.bfloat16).to(device)
    te2 = CLIPTextModelWithProjection.from_pretrained(BASE, subfolder="text_encoder_2", torch_dtype=torch.bfloat16).to(device)
    vae = AutoencoderKL.from_pretrained("madebyollin/sdxl-vae-fp16-fix", torch_dtype=torch.float32).to(device)
    unet = UNet2DConditionModel.from_pretrained(BASE, subfolder="unet", torch_dtype=torch.bfloat16)
    sched = DDPMScheduler.from_pretrained(BASE, subfolder="scheduler")
    for m in (te1, te2, vae, unet):
        m.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=args.rank_dim, lora_alpha=args.rank_dim, init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    for p in unet.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    unet.enable_gradient_checkpointing()
    unet.to(device)
    ddp_unet = DDP(unet, device_ids=[local_rank])

    ds = BucketDataset(args.data_dir, make_buckets())
    bsampler = BucketBatchSampler(ds, args.batch_size, rank, world)
    dl = DataLoader(ds, batch_sampler=bsampler, collate_fn=collate, num_workers=4, pin_memory=True)

    params = [p for p in unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-2)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{len(ds)} images, {len(bsampler.by_bucket)} buckets on rank 0, {len(dl)} batches/epoch", flush=True)

    step = 0
    for epoch in range(args.epochs):
        bsampler.set_epoch(epoch)
        ddp_unet.train()
        for batch in dl:
            with torch.no_grad():
                lat = vae.encode(batch["pixel_values"].to(device)).latent_dist.sample() * vae.config.scaling_factor
                prompt_embeds, pooled = encode_prompt(batch["captions"], (tok1, tok2), (te1, te2), device)
            lat = lat.to(torch.bfloat16)
            noise = torch.randn_like(lat)
            t = torch.randint(0, sched.config.num_train_timesteps, (lat.shape[0],), device=device).long()
            noisy = sched.add_noise(lat, noise, t)
            cond = {"text_embeds": pooled, "time_ids": batch["time_ids"].to(device, torch.bfloat16)}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = ddp_unet(noisy, t, prompt_embeds, added_cond_kwargs=cond).sample
            loss = F.mse_loss(pred.float(), noise.float())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

        if (epoch + 1) % args.save_every == 0:
            if rank == 0:
                sd = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
                save_file({k: v.to(torch.float16).contiguous() for k, v in sd.items()},
                          os.path.join(args.output_dir, f"lora_e{epoch + 1:03d}.safetensors"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
