"""LLaVA-style stage 1: train the vision->language projector on caption data.

The CLIP vision tower and the LLM are frozen; only the 2-layer MLP projector is trained.
Data is a JSON list of {"image": path, "caption": str} (e.g. LCS-558K / CC3M subset).
"""
import argparse
import json
import os
import random
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor,
                          CLIPVisionModel, get_cosine_schedule_with_warmup)

IGNORE_INDEX = -100
IMAGE_PLACEHOLDER = "<image>"


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-json", required=True)
    ap.add_argument("--image-folder", required=True)
    ap.add_argument("--vision-tower", default="openai/clip-vit-large-patch14-336")
    ap.add_argument("--llm", default="lmsys/vicuna-7b-v1.5")
    ap.add_argument("--output-dir", default="checkpoints/llava-v1.5-7b-pretrain")
    ap.add_argument("--per-device-batch", type=int, default=32)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--warmup-ratio", type=float, default=0.03)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--num-workers", type=int, default=4)
    ap.add_argument("--save-steps", type=int, default=2000)
    return ap.parse_args()


class CaptionData(Dataset):
    def __init__(self, json_path, image_folder, processor, tokenizer, max_len):
        with open(json_path) as f:
            self.items = json.load(f)
        self.image_folder = image_folder
        self.processor = processor
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        item = self.items[idx]
        image = Image.open(os.path.join(self.image_folder, item["image"])).convert("RGB")
        pixel_values = self.processor(image, return_tensors="pt")["pixel_values"][0]
        # plain pretraining template: <image>\n{caption}</s>
        text = item["caption"].strip() + self.tokenizer.eos_token
        ids = self.tokenizer(text, add_special_tokens=False, truncation=True,
                             max_length=self.max_len)["input_ids"]
        input_ids = torch.tensor([self.tokenizer.bos_token_id] + ids)
        labels = input_ids.clone()
        labels[0] = IGNORE_INDEX
        return pixel_values, input_ids, labels


def collate(batch, pad_id):
    pixels, ids, labels = zip(*batch)
    max_len = max(x.shape[0] for x in ids)
    input_ids = torch.full((len(ids), max_len), pad_id, dtype=torch.long)
    label_t = torch.full((len(ids), max_len), IGNORE_INDEX, dtype=torch.long)
    attn = torch.zeros((len(ids), max_len), dtype=torch.long)
    for i, (x, y) in enumerate(zip(ids, labels)):
        input_ids[i, : x.shape[0]] = x
        label_t[i, : y.shape[0]] = y
        attn[i, : x.shape[0]] = 1
    return torch.stack(pixels), input_ids, label_t, attn


class MLPProjector(nn.Module):
    def __init__(self, vision_dim, llm_dim):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(vision_dim, llm_dim), nn.GELU(), nn.Linear(llm_dim, llm_dim))

    def forward(self, x):
        return self.net(x)


def build_inputs(llm, image_embeds, input_ids, labels, attn):
    """Prepend projected image tokens after BOS: [BOS] [IMG x N] text..."""
    tok_embeds = llm.get_input_embeddings()(input_ids)
    b, n_img, _ = image_embeds.shape
    embeds = torch.cat([tok_embeds[:, :1], image_embeds.to(tok_embeds.dtype), tok_embeds[:, 1:]], dim=1)
    img_labels = torch.full((b, n_img), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    new_labels = torch.cat([labels[:, :1], img_labels, labels[:, 1:]], dim=1)
    img_attn = torch.ones((b, n_img), dtype=attn.dtype, device=attn.device)
    new_attn = torch.cat([attn[:, :1], img_attn, attn[:, 1:]], dim=1)
    return embeds, new_labels, new_attn


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    random.seed(42)
    torch.manual_seed(42)

    tokenizer = AutoTokenizer.from_pretrained(args.llm, use_fast=False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token

    llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16, device_map="auto")
    llm.requires_grad_(False)
    llm.eval()

    vision = CLIPVisionModel.from_pretrained(args.vision_tower, torch_dtype=torch.bfloat16).to(device)
    vision.requires_grad_(False)
    vision.eval()
    processor = CLIPImageProcessor.from_pretrained(args.vision_tower)

    projector = MLPProjector(vision.config.hidden_size, llm.config.hidden_size).to(device)
    projector = DDP(projector, device_ids=[local_rank])

    dataset = CaptionData(args.data_json, args.image_folder, processor, tokenizer, args.max_len)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=42)
    loader = DataLoader(dataset, batch_size=args.per_device_batch, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=True, drop_last=True,
                        collate_fn=partial(collate, pad_id=tokenizer.pad_token_id))

    optimizer = torch.optim.AdamW(projector.parameters(), lr=args.lr, weight_decay=0.0)
    updates_per_epoch = len(loader) // args.grad_accum
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_updates), total_updates)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{len(dataset)} samples, {total_updates} updates, world={world}", flush=True)

    global_step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        projector.train()
        running = 0.0
        for it, (pixels, input_ids, labels, attn) in enumerate(loader):
            pixels = pixels.to(device, dtype=torch.bfloat16, non_blocking=True)
            input_ids = input_ids.to(device)
            labels = labels.to(device)
            attn = attn.to(device)

            with torch.no_grad():
                # penultimate layer, drop CLS (LLaVA-1.5 "patch" features)
                feats = vision(pixels, output_hidden_states=True).hidden_states[-2][:, 1:]

            with torch.autocast("cuda", dtype=torch.bfloat16):
                image_embeds = projector(feats.float())
                embeds, full_labels, full_attn = build_inputs(llm, image_embeds, input_ids, labels, attn)
                out = llm(inputs_embeds=embeds, attention_mask=full_attn, labels=full_labels)
                loss = out.loss / args.grad_accum

            sync_now = (it + 1) % args.grad_accum == 0
            if sync_now:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(projector.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
            else:
                with projector.no_sync():
                    loss.backward()
            running += loss.item()

            if sync_now and global_step % 10 == 0:
                avg = torch.tensor(running / 10, device=device)
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                running = 0.0
                if rank == 0:
                    print(f"epoch {epoch} step {global_step}/{total_updates} "
                          f"loss {avg.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)

            if sync_now and global_step % args.save_steps == 0 and rank == 0:
                torch.save(projector.module.state_dict(),
                           os.path.join(args.output_dir, f"mm_projector_step{global_step}.bin"))

    if rank == 0:
        torch.save(projector.module.state_dict(), os.path.join(args.output_dir, "mm_projector.bin"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
