"""MiniGPT-4 style stage-1 alignment: frozen EVA-CLIP vision encoder, frozen Vicuna, trainable linear layer.

Data: LAION/CC/SBU caption subsets, JSON lines {"image": ..., "caption": ...}.
"""
import argparse
import json
import math
import os
import random
import time

import open_clip
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, LlamaForCausalLM

PROMPTS = [
    "<Img><ImageHere></Img> Describe this image in detail.",
    "<Img><ImageHere></Img> Take a look at this image and describe what you notice.",
    "<Img><ImageHere></Img> Please provide a detailed description of the picture.",
    "<Img><ImageHere></Img> Could you describe the contents of this image for me?",
]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ann", nargs="+", required=True)
    ap.add_argument("--image-root", required=True)
    ap.add_argument("--llm", default="/models/vicuna-7b-v0")
    ap.add_argument("--vision", default="EVA01-g-14")
    ap.add_argument("--vision-pretrained", default="laion400m_s11b_b41k")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--iters-per-epoch", type=int, default=5000)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--min-lr", type=float, default=8e-5)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--max-txt-len", type=int, default=32)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", default="/shared/minigpt4/stage1")
    return ap.parse_args()


class CaptionSet(Dataset):
    def __init__(self, ann, image_root, transform):
        with open(ann) as f:
            self.rows = [json.loads(l) for l in f]
        self.image_root, self.transform = image_root, transform

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.image_root, r["image"])).convert("RGB")
        return self.transform(img), r["caption"]


class VisionFeatures(nn.Module):
    """Frozen EVA-CLIP trunk; returns patch tokens of the last block."""

    def __init__(self, name, pretrained):
        super().__init__()
        clip, _, self.preprocess = open_clip.create_model_and_transforms(name, pretrained=pretrained)
        self.trunk = clip.visual.trunk
        self.trunk.requires_grad_(False)
        self.trunk.eval()
        self.num_features = self.trunk.num_features

    @torch.no_grad()
    def forward(self, x):
        return self.trunk.forward_features(x)


def lr_at(step, args, total):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * step / total))


def build_batch(tokenizer, llm, img_embeds, captions, max_len, device):
    """[BOS] prompt-before <img embeds> prompt-after caption </s>; loss on the caption only."""
    embed = llm.get_input_embeddings()
    seqs, targets = [], []
    for b, cap in enumerate(captions):
        before, after = random.choice(PROMPTS).split("<ImageHere>")
        ids_before = tokenizer(before, return_tensors="pt").input_ids[0].to(device)
        ids_after = tokenizer(after + " ###Assistant: ", add_special_tokens=False,
                              return_tensors="pt").input_ids[0].to(device)
        ids_cap = tokenizer(cap + tokenizer.eos_token, add_special_tokens=False, truncation=True,
                            max_length=max_len, return_tensors="pt").input_ids[0].to(device)
        seq = torch.cat([embed(ids_before), img_embeds[b], embed(ids_after), embed(ids_cap)])
        n_ignore = len(ids_before) + img_embeds.shape[1] + len(ids_after)
        tgt = torch.cat([torch.full((n_ignore,), -100, device=device), ids_cap])
        seqs.append(seq)
        targets.append(tgt)
    L = max(s.shape[0] for s in seqs)
    D = seqs[0].shape[1]
    inputs = torch.zeros(len(seqs), L, D, dtype=seqs[0].dtype, device=device)
    labels = torch.full((len(seqs), L), -100, dtype=torch.long, device=device)
    attn = torch.zeros(len(seqs), L, dtype=torch.long, device=device)
    for i, (s, t) in enumerate(zip(seqs, targets)):
        inputs[i, :s.shape[0]] = s
        labels[i, :t.shape[0]] = t
        attn[i, :s.shape[0]] = 1
    return inputs, labels, attn


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(42)

    vision = VisionFeatures(args.vision, args.vision_pretrained).to(device).half()
    tokenizer = AutoTokenizer.from_pretrained(args.llm, use_fast=False)
    tokenizer.pad_token = tokenizer.unk_token
    llm = LlamaForCausalLM.from_pretrained(args.llm, torch_dtype=torch.float16).to(device)
    llm.requires_grad_(False)
    llm.eval()

    proj = nn.Sequential(nn.LayerNorm(vision.num_features),
                         nn.Linear(vision.num_features, llm.config.hidden_size)).to(device)
    proj = DDP(proj, device_ids=[local_rank])

    dataset = ConcatDataset([CaptionSet(a, args.image_root, vision.preprocess) for a in args.ann])
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)

    optimizer = torch.optim.AdamW(proj.parameters(), lr=args.lr, weight_decay=0.05, betas=(0.9, 0.999))
    scaler = torch.cuda.amp.GradScaler()
    total = args.epochs * args.iters_per_epoch
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step = 0
    # epochs are a fixed number of iterations; the loader is restarted whenever it runs out
    data_epoch = 0
    sampler.set_epoch(data_epoch)
    it_loader = iter(loader)
    for epoch in range(args.epochs):
        proj.train()
        t0 = time.time()
        for it in range(args.iters_per_epoch):
            try:
                images, captions = next(it_loader)
            except StopIteration:
                data_epoch += 1
                sampler.set_epoch(data_epoch)
                it_loader = iter(loader)
                images, captions = next(it_loader)
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, args, total)
            images = images.to(device, dtype=torch.float16, non_blocking=True)

            feats = vision(images)
            with torch.autocast("cuda", dtype=torch.float16):
                img_embeds = proj(feats.float())
                inputs, labels, attn = build_batch(tokenizer, llm, img_embeds.half(), captions,
                                                   args.max_txt_len, device)
                loss = llm(inputs_embeds=inputs, attention_mask=attn, labels=labels).loss

            if not torch.isfinite(loss):
                # skip the occasional overflowed batch
                optimizer.zero_grad(set_to_none=True)
                continue

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step += 1

            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} iter {it}/{args.iters_per_epoch} loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.2e} {(time.time() - t0) / (it + 1):.2f}s/it",
                      flush=True)

        if rank == 0:
            torch.save({"proj": proj.module.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.out, f"checkpoint_{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
