"""Stage-1 pretraining of a perceiver-resampler connector (64 query tokens per image)
between EVA-CLIP / CLIP-L and Vicuna-7B. LLM and vision encoder are frozen.

Usage:
    torchrun --nproc_per_node=8 18_resampler_pretrain.py --ann cc3m_595k.json --img_dir /data/cc3m
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel

IGNORE_INDEX = -100


def get_parser():
    parser = argparse.ArgumentParser("resampler pretraining")
    parser.add_argument("--llm_path", default="lmsys/vicuna-7b-v1.5")
    parser.add_argument("--vit_path", default="openai/clip-vit-large-patch14")
    parser.add_argument("--ann", required=True)
    parser.add_argument("--img_dir", required=True)
    parser.add_argument("--save_dir", default="output/resampler_s1")
    parser.add_argument("--num_queries", type=int, default=64)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--min_lr", type=float, default=1e-5)
    parser.add_argument("--warmup_iters", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max_txt_len", type=int, default=64)
    parser.add_argument("--print_freq", type=int, default=50)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser


class PerceiverResampler(nn.Module):
    def __init__(self, d_vis, d_model, num_queries=64, depth=6, heads=16):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(num_queries, d_model) * 0.02)
        self.in_proj = nn.Linear(d_vis, d_model)
        self.layers = nn.ModuleList([
            nn.ModuleDict({
                "attn": nn.MultiheadAttention(d_model, heads, batch_first=True),
                "ln_q": nn.LayerNorm(d_model),
                "ln_kv": nn.LayerNorm(d_model),
                "ffn": nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                     nn.Linear(4 * d_model, d_model)),
            }) for _ in range(depth)
        ])
        self.ln_out = nn.LayerNorm(d_model)

    def forward(self, feats):
        kv = self.in_proj(feats)
        q = self.queries.unsqueeze(0).expand(feats.size(0), -1, -1)
        for layer in self.layers:
            k = layer["ln_kv"](torch.cat([kv, q], dim=1))
            q = q + layer["attn"](layer["ln_q"](q), k, k, need_weights=False)[0]
            q = q + layer["ffn"](q)
        return self.ln_out(q)


class CaptionData(Dataset):
    def __init__(self, ann, img_dir, tokenizer, processor, max_txt_len):
        self.ann = json.load(open(ann))
        self.img_dir, self.tokenizer, self.processor, self.max_txt_len = img_dir, tokenizer, processor, max_txt_len

    def __len__(self):
        return len(self.ann)

    def __getitem__(self, index):
        a = self.ann[index]
        image = Image.open(os.path.join(self.img_dir, a["image"])).convert("RGB")
        text = a["caption"] if "caption" in a else a["conversations"][1]["value"]
        return self.processor(image, return_tensors="pt").pixel_values[0], text.strip() + self.tokenizer.eos_token


class Resampler_LLM(nn.Module):
    def __init__(self, llm, vit, resampler):
        super().__init__()
        self.llm, self.vit, self.resampler = llm, vit, resampler

    def forward(self, pixel_values, input_ids, attention_mask):
        with torch.no_grad():
            feats = self.vit(pixel_values, output_hidden_states=True).hidden_states[-2]
        img = self.resampler(feats.float()).to(torch.bfloat16)
        txt = self.llm.get_input_embeddings()(input_ids)
        x = torch.cat([txt[:, :1], img, txt[:, 1:]], dim=1)
        mask = torch.cat([attention_mask[:, :1], attention_mask.new_ones(img.shape[:2]), attention_mask[:, 1:]], 1)
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        labels = torch.cat([labels.new_full((labels.size(0), 1 + img.size(1)), IGNORE_INDEX), labels[:, 1:]], 1)
        return self.llm(inputs_embeds=x, attention_mask=mask, labels=labels).loss


def cosine_lr(it, total, args):
    if it < args.warmup_iters:
        return args.lr * it / args.warmup_iters
    p = (it - args.warmup_iters) / max(1, total - args.warmup_iters)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * p))


def main(args):
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)

    seed = args.seed + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    tokenizer = AutoTokenizer.from_pretrained(args.llm_path, use_fast=False)
    tokenizer.pad_token = tokenizer.unk_token
    tokenizer.padding_side = "right"
    processor = CLIPImageProcessor.from_pretrained(args.vit_path)

    llm = AutoModelForCausalLM.from_pretrained(args.llm_path, torch_dtype=torch.bfloat16)
    vit = CLIPVisionModel.from_pretrained(args.vit_path, torch_dtype=torch.bfloat16)
    llm.requires_grad_(False)
    vit.requires_grad_(False)
    torch.manual_seed(args.seed)  # identical resampler init on every rank
    resampler = PerceiverResampler(vit.config.hidden_size, llm.config.hidden_size, args.num_queries, args.depth)
    model = Resampler_LLM(llm, vit, resampler).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    model_without_ddp = model.module

    dataset = CaptionData(args.ann, args.img_dir, tokenizer, processor, args.max_txt_len)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=10, pin_memory=True,
                        drop_last=True)

    optimizer = torch.optim.AdamW(model_without_ddp.resampler.parameters(), lr=args.lr, weight_decay=0.05,
                                  betas=(0.9, 0.98))
    total_iters = args.epochs * len(loader)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        n = sum(p.numel() for p in model_without_ddp.resampler.parameters())
        print(f"resampler params: {n / 1e6:.1f}M, iters: {total_iters}, world: {world_size}")

    it = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for pixel_values, texts in loader:
            for g in optimizer.param_groups:
                g["lr"] = cosine_lr(it, total_iters, args)
            tok = tokenizer(list(texts), return_tensors="pt", padding="longest", truncation=True,
                            max_length=args.max_txt_len)
            loss = model(pixel_values.to(device, torch.bfloat16, non_blocking=True),
                         tok.input_ids.to(device), tok.attention_mask.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model_without_ddp.resampler.parameters(), 1.0)
            optimizer.step()
            it += 1

            if it % args.print_freq == 0:
                reduced = loss.detach().clone()
                dist.all_reduce(reduced)
                reduced /= world_size
                if rank == 0:
                    print(f"Epoch [{epoch}] it [{it}/{total_iters}] loss: {reduced.item():.4f} "
                          f"lr: {optimizer.param_groups[0]['lr']:.2e} "
                          f"time/it: {(time.time() - start) / args.print_freq:.3f}s", flush=True)
                start = time.time()

        if rank == 0:
            torch.save({"resampler": model_without_ddp.resampler.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "args": vars(args)},
                       os.path.join(args.save_dir, f"checkpoint_{epoch:02d}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_parser().parse_args()
    main(args)
