#!/usr/bin/env python3
"""Stage-2 full fine-tuning (LLM + projector) with a plain DeepSpeed engine.

We moved off the HF Trainer for this stage to control the per-module learning
rates and the eval loop ourselves; the ZeRO-2 settings are the ones from
LLaVA's scripts/zero2.json.

    deepspeed --num_gpus 8 09_stage2_full_ds_zero2.py --train data/mix665k.json \
        --val data/val_2k.json --image_root /data/llava --projector runs/stage1/mm_projector.bin
"""
import argparse
import copy
import json
import math
import os
import random

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel,
                          get_cosine_schedule_with_warmup)

IGNORE_INDEX = -100

ZERO2_CONFIG = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
    },
}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--llm", default="lmsys/vicuna-7b-v1.5")
    p.add_argument("--vision", default="openai/clip-vit-large-patch14-336")
    p.add_argument("--projector", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--image_root", required=True)
    p.add_argument("--out", default="runs/stage2-full-7b")
    p.add_argument("--micro_batch", type=int, default=16)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--projector_lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--eval_steps", type=int, default=500)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def vicuna_encode(conv, tok, max_len):
    ids = [tok.bos_token_id]
    labels = [IGNORE_INDEX]
    for turn in conv:
        v = turn["value"].replace("<image>", "").strip()
        if turn["from"] == "human":
            t = tok("USER: " + v + " ASSISTANT:", add_special_tokens=False).input_ids
            ids += t
            labels += [IGNORE_INDEX] * len(t)
        else:
            t = tok(v + "</s>", add_special_tokens=False).input_ids
            ids += t
            labels += copy.copy(t)
    return ids[:max_len], labels[:max_len]


class ConvData(Dataset):
    def __init__(self, path, root, tok, proc, max_len):
        self.data = [r for r in json.load(open(path)) if "image" in r]
        self.root, self.tok, self.proc, self.max_len = root, tok, proc, max_len

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        r = self.data[i]
        ids, labels = vicuna_encode(r["conversations"], self.tok, self.max_len)
        img = Image.open(os.path.join(self.root, r["image"])).convert("RGB")
        return ids, labels, self.proc(img, return_tensors="pt").pixel_values[0]


class PadCollate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        L = max(len(b[0]) for b in batch)
        ids = torch.full((len(batch), L), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), L), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for i, (x, y, _) in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            labels[i, : len(y)] = torch.tensor(y)
            mask[i, : len(x)] = 1
        return ids, mask, labels, torch.stack([b[2] for b in batch])


class LlavaVicuna(nn.Module):
    def __init__(self, llm, vision):
        super().__init__()
        self.llm, self.vision = llm, vision
        d = llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(vision.config.hidden_size, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, ids, mask, labels, pixels):
        with torch.no_grad():
            f = self.vision(pixels, output_hidden_states=True).hidden_states[-2][:, 1:]
        img = self.mm_projector(f)
        txt = self.llm.get_input_embeddings()(ids)
        x = torch.cat([txt[:, :1], img, txt[:, 1:]], 1)
        m = torch.cat([mask[:, :1], mask.new_ones(img.shape[:2]), mask[:, 1:]], 1)
        y = torch.cat([labels[:, :1], labels.new_full(img.shape[:2], IGNORE_INDEX), labels[:, 1:]], 1)
        return self.llm(inputs_embeds=x, attention_mask=m, labels=y).loss


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    tot = torch.zeros(2, device=engine.device)
    for ids, mask, labels, px in loader:
        loss = engine(ids.to(engine.device), mask.to(engine.device), labels.to(engine.device),
                      px.to(engine.device, torch.bfloat16))
        n = (labels[:, 1:] != IGNORE_INDEX).sum().item()
        tot += torch.tensor([loss.item() * n, n], device=engine.device)
    dist.all_reduce(tot)
    engine.train()
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank = dist.get_rank()
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.llm, use_fast=False)
    tok.pad_token = tok.unk_token
    proc = CLIPImageProcessor.from_pretrained(args.vision)
    llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16)
    llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vision = CLIPVisionModel.from_pretrained(args.vision, torch_dtype=torch.bfloat16).requires_grad_(False)
    model = LlavaVicuna(llm, vision)
    sd = torch.load(args.projector, map_location="cpu")
    model.mm_projector.load_state_dict({k.replace("mm_projector.", ""): v for k, v in sd.items()})

    train_ds = ConvData(args.train, args.image_root, tok, proc, args.max_len)
    val_ds = ConvData(args.val, args.image_root, tok, proc, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler, num_workers=8,
                              pin_memory=True, collate_fn=PadCollate(tok.pad_token_id), drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.micro_batch, num_workers=4,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                            collate_fn=PadCollate(tok.pad_token_id))

    ds_config = copy.deepcopy(ZERO2_CONFIG)
    ds_config["train_micro_batch_size_per_gpu"] = args.micro_batch
    ds_config["gradient_accumulation_steps"] = args.grad_accum
    ds_config["bf16"]["enabled"] = True
    ds_config["fp16"]["enabled"] = False
    ds_config["gradient_clipping"] = 1.0

    groups = [
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("mm_projector")],
         "lr": args.lr},
        {"params": [p for p in model.mm_projector.parameters()], "lr": args.projector_lr},
    ]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0, betas=(0.9, 0.999))
    steps = args.epochs * math.ceil(len(train_loader) / args.grad_accum)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * steps), steps)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=ds_config)

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for i, (ids, mask, labels, px) in enumerate(train_loader):
            loss = engine(ids.to(engine.device), mask.to(engine.device), labels.to(engine.device),
                          px.to(engine.device, torch.bfloat16))
            engine.backward(loss)
            engine.step()
            gstep = engine.global_steps
            if rank == 0 and (i + 1) % (10 * args.grad_accum) == 0:
                print(f"epoch {epoch} step {gstep}/{steps} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}",
                      flush=True)
            if (i + 1) % (args.eval_steps * args.grad_accum) == 0:
                val_loss = evaluate(engine, val_loader)
                if rank == 0:
                    print(f"step {gstep} val_loss {val_loss:.4f}", flush=True)
                engine.save_checkpoint(args.out, tag=f"step{gstep}", client_state={"val_loss": val_loss})
                if val_loss < best and rank == 0:
                    best = val_loss
                    torch.save(engine.module.mm_projector.state_dict(), os.path.join(args.out, "mm_projector_best.bin"))

    engine.save_checkpoint(args.out, tag="final")
    if rank == 0:
        engine.module.llm.save_pretrained(os.path.join(args.out, "llm"))
        tok.save_pretrained(os.path.join(args.out, "llm"))
        torch.save(engine.module.mm_projector.state_dict(), os.path.join(args.out, "mm_projector.bin"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
