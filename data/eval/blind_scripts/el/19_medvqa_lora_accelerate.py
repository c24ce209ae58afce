"""LoRA instruction tuning of our LLaVA-v1.5-7B checkpoint on in-house radiology VQA.

The annotation dump has no official split; we hold out a random 5% for validation.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
        19_medvqa_lora_accelerate.py --ann data/rad_vqa_all.json --images /data/rad_images
"""
import argparse
import functools
import json
import math
import os
import random

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import set_seed
from peft import LoraConfig, get_peft_model
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel,
                          get_cosine_schedule_with_warmup)

IGNORE_INDEX = -100
SYSTEM = "You are a helpful radiology assistant."


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--base_llm", default="liuhaotian/llava-v1.5-7b-llm")  # LLM weights exported from stage 2
    p.add_argument("--projector", default="checkpoints/llava-v1.5-7b/mm_projector.bin")
    p.add_argument("--vision", default="openai/clip-vit-large-patch14-336")
    p.add_argument("--ann", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--output_dir", default="runs/rad-lora")
    p.add_argument("--val_ratio", type=float, default=0.05)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


class RadVQA(Dataset):
    def __init__(self, rows, images, tok, proc, max_len, train):
        self.rows, self.images, self.tok, self.proc, self.max_len, self.train = rows, images, tok, proc, max_len, train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.images, r["image"])).convert("RGB")
        if self.train and r.get("flip_ok", False) and random.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        q = self.tok(f"{SYSTEM} USER: {r['question']} ASSISTANT:", add_special_tokens=True).input_ids
        a = self.tok(" " + r["answer"] + "</s>", add_special_tokens=False).input_ids
        ids = (q + a)[: self.max_len]
        labels = ([IGNORE_INDEX] * len(q) + a)[: self.max_len]
        return {"input_ids": ids, "labels": labels, "pixel_values": self.proc(img, return_tensors="pt").pixel_values[0]}


def collate(batch, pad_id):
    L = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), L), pad_id)
    labels = torch.full((len(batch), L), IGNORE_INDEX)
    mask = torch.zeros(len(batch), L, dtype=torch.long)
    for i, b in enumerate(batch):
        n = len(b["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(b["input_ids"]), torch.tensor(b["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask,
            "pixel_values": torch.stack([b["pixel_values"] for b in batch])}


class LlavaRad(nn.Module):
    def __init__(self, llm, vision):
        super().__init__()
        self.llm, self.vision = llm, vision
        d = llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(vision.config.hidden_size, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, input_ids, labels, attention_mask, pixel_values):
        with torch.no_grad():
            f = self.vision(pixel_values.to(self.vision.dtype), output_hidden_states=True).hidden_states[-2][:, 1:]
        img = self.mm_projector(f)
        txt = self.llm.get_input_embeddings()(input_ids)
        x = torch.cat([txt[:, :1], img.to(txt.dtype), txt[:, 1:]], 1)
        m = torch.cat([attention_mask[:, :1], attention_mask.new_ones(img.shape[:2]), attention_mask[:, 1:]], 1)
        y = torch.cat([labels[:, :1], labels.new_full(img.shape[:2], IGNORE_INDEX), labels[:, 1:]], 1)
        return self.llm(inputs_embeds=x, attention_mask=m, labels=y)


def main():
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, log_with="tensorboard",
                              project_dir=args.output_dir)
    set_seed(args.seed, device_specific=True)

    with open(args.ann) as f:
        records = json.load(f)
    random.shuffle(records)
    n_val = int(len(records) * args.val_ratio)
    val_rows, train_rows = records[:n_val], records[n_val:]
    accelerator.print(f"train {len(train_rows)} / val {len(val_rows)}")

    tok = AutoTokenizer.from_pretrained(args.base_llm, use_fast=False)
    tok.pad_token = tok.unk_token
    proc = CLIPImageProcessor.from_pretrained(args.vision)
    llm = AutoModelForCausalLM.from_pretrained(args.base_llm, torch_dtype=torch.bfloat16)
    llm = get_peft_model(llm, LoraConfig(r=64, lora_alpha=128, lora_dropout=0.05, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    vision = CLIPVisionModel.from_pretrained(args.vision, torch_dtype=torch.bfloat16).requires_grad_(False)
    model = LlavaRad(llm, vision)
    model.mm_projector.load_state_dict(
        {k.split("mm_projector.")[-1]: v for k, v in torch.load(args.projector, map_location="cpu").items()})

    col = functools.partial(collate, pad_id=tok.pad_token_id)
    train_loader = DataLoader(RadVQA(train_rows, args.images, tok, proc, args.max_len, True),
                              batch_size=args.batch_size, shuffle=True, num_workers=6, collate_fn=col)
    val_loader = DataLoader(RadVQA(val_rows, args.images, tok, proc, args.max_len, False),
                            batch_size=args.batch_size, num_workers=4, collate_fn=col)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    steps = args.epochs * math.ceil(len(train_loader) / args.grad_accum)
    scheduler = accelerator.prepare(get_cosine_schedule_with_warmup(optimizer, int(0.05 * steps), steps))
    accelerator.init_trackers("rad-lora", config=vars(args))

    best, gstep = float("inf"), 0
    for epoch in range(args.epochs):
        model.train()
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                gstep += 1
                if gstep % 10 == 0:
                    accelerator.log({"train/loss": accelerator.reduce(loss.detach(), "mean").item()}, step=gstep)

        model.eval()
        tot, cnt = 0.0, 0
        for batch in val_loader:
            with torch.no_grad():
                l = model(**batch).loss
            l = accelerator.gather_for_metrics(l.detach().repeat(batch["input_ids"].size(0)))
            tot += l.sum().item()
            cnt += l.numel()
        val_loss = tot / max(cnt, 1)
        accelerator.log({"val/loss": val_loss}, step=gstep)
        accelerator.print(f"epoch {epoch} val_loss {val_loss:.4f}")

        if val_loss < best:
            best = val_loss
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                unwrapped = accelerator.unwrap_model(model)
                unwrapped.llm.save_pretrained(os.path.join(args.output_dir, "best"))
                torch.save(unwrapped.mm_projector.state_dict(), os.path.join(args.output_dir, "best", "mm_projector.bin"))

    accelerator.end_training()


if __name__ == "__main__":
    main()
