#!/usr/bin/env python
"""Stage-1 feature alignment for our LLaVA-style model.

The CLIP vision tower and the language model stay frozen; only the 2-layer MLP
projector is trained on image-caption pairs (LCS-558K style json). We use the
"plain" template: image tokens followed by the caption, loss on the caption only.
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    CLIPImageProcessor,
    CLIPVisionModel,
    get_cosine_schedule_with_warmup,
)

IGNORE_INDEX = -100


def parse_args():
    p = argparse.ArgumentParser(description="LLaVA stage-1 projector pretraining")
    p.add_argument("--llm", default="lmsys/vicuna-7b-v1.5")
    p.add_argument("--vision_tower", default="openai/clip-vit-large-patch14-336")
    p.add_argument("--data_path", required=True)
    p.add_argument("--image_folder", required=True)
    p.add_argument("--output_dir", default="checkpoints/llava-v1.5-7b-pretrain")
    p.add_argument("--per_device_batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--select_layer", type=int, default=-2)
    p.add_argument("--num_workers", type=int, default=8)
    p.add_argument("--log_every", type=int, default=20)
    p.add_argument("--save_every", type=int, default=2000)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class CaptionDataset(Dataset):
    def __init__(self, data_path, image_folder, tokenizer, image_processor, max_len):
        with open(data_path) as f:
            self.records = json.load(f)
        self.image_folder = image_folder
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.max_len = max_len

    def __len__(self):
        return len(self.records)

    def __getitem__(self, idx):
        rec = self.records[idx]
        image = Image.open(os.path.join(self.image_folder, rec["image"])).convert("RGB")
        pixel_values = self.image_processor(image, return_tensors="pt")["pixel_values"][0]
        caption = rec["conversations"][1]["value"].strip()
        ids = self.tokenizer(caption + self.tokenizer.eos_token, add_special_tokens=False).input_ids
        ids = [self.tokenizer.bos_token_id] + ids[: self.max_len - 1]
        labels = [IGNORE_INDEX] + ids[1:]
        return {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "pixel_values": pixel_values,
        }


class Collator:
    def __init__(self, pad_token_id):
        self.pad_token_id = pad_token_id

    def __call__(self, batch):
        input_ids = nn.utils.rnn.pad_sequence(
            [b["input_ids"] for b in batch], batch_first=True, padding_value=self.pad_token_id
        )
        labels = nn.utils.rnn.pad_sequence(
            [b["labels"] for b in batch], batch_first=True, padding_value=IGNORE_INDEX
        )
        return {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": input_ids.ne(self.pad_token_id),
            "pixel_values": torch.stack([b["pixel_values"] for b in batch]),
        }


class LlavaForCausalLM(nn.Module):
    def __init__(self, llm, vision_tower, select_layer=-2):
        super().__init__()
        self.llm = llm
        self.vision_tower = vision_tower
        self.select_layer = select_layer
        vis_dim = vision_tower.config.hidden_size
        llm_dim = llm.config.hidden_size
        self.mm_projector = nn.Sequential(
            nn.Linear(vis_dim, llm_dim), nn.GELU(), nn.Linear(llm_dim, llm_dim)
        )

    @torch.no_grad()
    def encode_images(self, pixel_values):
        out = self.vision_tower(pixel_values.to(self.vision_tower.dtype), output_hidden_states=True)
        return out.hidden_states[self.select_layer][:, 1:]  # drop CLS

    def forward(self, input_ids, attention_mask, labels, pixel_values):
        image_embeds = self.mm_projector(self.encode_images(pixel_values))
        text_embeds = self.llm.get_input_embeddings()(input_ids)
        bsz, n_img = image_embeds.shape[:2]
        inputs_embeds = torch.cat([image_embeds.to(text_embeds.dtype), text_embeds], dim=1)
        attention_mask = torch.cat([attention_mask.new_ones(bsz, n_img), attention_mask], dim=1)
        labels = torch.cat([labels.new_full((bsz, n_img), IGNORE_INDEX), labels], dim=1)
        return self.llm(inputs_embeds=inputs_embeds, attention_mask=attention_mask, labels=labels)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.llm, use_fast=False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token
    image_processor = CLIPImageProcessor.from_pretrained(args.vision_tower)

    llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16)
    vision_tower = CLIPVisionModel.from_pretrained(args.vision_tower, torch_dtype=torch.bfloat16)
    llm.requires_grad_(False)
    vision_tower.requires_grad_(False)

    model = LlavaForCausalLM(llm, vision_tower, args.select_layer).to(device)
    model = DDP(model, device_ids=[local_rank])

    dataset = CaptionDataset(args.data_path, args.image_folder, tokenizer, image_processor, args.max_len)
    loader = DataLoader(
        dataset,
        batch_size=args.per_device_batch_size,
        shuffle=True,
        num_workers=args.num_workers,
        pin_memory=True,
        drop_last=True,
        collate_fn=Collator(tokenizer.pad_token_id),
    )

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    total_steps = args.epochs * len(loader)
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, math.ceil(args.warmup_ratio * total_steps), total_steps
    )

    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        n_train = sum(p.numel() for p in params)
        print(f"world_size={world_size} trainable params={n_train / 1e6:.1f}M steps={total_steps}")

    global_step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        model.train()
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % args.log_every == 0:
                loss_t = loss.detach().clone()
                dist.all_reduce(loss_t, op=dist.ReduceOp.AVG)
                if is_main:
                    elapsed = time.time() - t0
                    print(
                        f"epoch {epoch} step {global_step}/{total_steps} loss {loss_t.item():.4f} "
                        f"lr {scheduler.get_last_lr()[0]:.2e} {elapsed / args.log_every:.2f}s/it",
                        flush=True,
                    )
                    t0 = time.time()

            if global_step % args.save_every == 0 and is_main:
                torch.save(
                    model.module.mm_projector.state_dict(),
                    os.path.join(args.output_dir, f"mm_projector-{global_step}.bin"),
                )

    if is_main:
        torch.save(model.module.mm_projector.state_dict(), os.path.join(args.output_dir, "mm_projector.bin"))
        with open(os.path.join(args.output_dir, "config.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
