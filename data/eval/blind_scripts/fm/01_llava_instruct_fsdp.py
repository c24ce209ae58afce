#!/usr/bin/env python
"""Fine-tune LLaVA-1.5 on visual instruction data with FSDP.

The CLIP vision tower stays frozen; the projector and the language model are
trained. Every decoder layer and every vision encoder layer is its own FSDP
unit; use_orig_params lets frozen and trainable weights share the root unit.
"""
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
from PIL import Image
from torch.distributed.fsdp import (
    FullyShardedDataParallel as FSDP,
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoProcessor, LlavaForConditionalGeneration, get_cosine_schedule_with_warmup
from transformers.models.clip.modeling_clip import CLIPEncoderLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

IGNORE_INDEX = -100


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llava-hf/llava-1.5-7b-hf")
    p.add_argument("--train-json", required=True)
    p.add_argument("--val-json", required=True)
    p.add_argument("--image-root", required=True)
    p.add_argument("--output-dir", default="checkpoints/llava-ft")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class InstructDataset(Dataset):
    def __init__(self, json_path, image_root, processor, max_length):
        with open(json_path) as f:
            self.records = json.load(f)
        self.image_root = image_root
        self.processor = processor
        self.max_length = max_length

    def __len__(self):
        return len(self.records)

    def __getitem__(self, idx):
        rec = self.records[idx]
        image = Image.open(os.path.join(self.image_root, rec["image"])).convert("RGB")
        prompt = f"USER: <image>\n{rec['question']} ASSISTANT:"
        full = f"{prompt} {rec['answer']}{self.processor.tokenizer.eos_token}"
        enc = self.processor(text=full, images=image, return_tensors="pt")
        prompt_len = self.processor(text=prompt, images=image, return_tensors="pt")["input_ids"].shape[1]
        input_ids = enc["input_ids"][0][: self.max_length]
        labels = input_ids.clone()
        labels[:prompt_len] = IGNORE_INDEX
        return {
            "input_ids": input_ids,
            "labels": labels,
            "pixel_values": enc["pixel_values"][0],
        }


def make_collate(pad_id):
    def collate(batch):
        max_len = max(b["input_ids"].numel() for b in batch)
        input_ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), max_len), IGNORE_INDEX, dtype=torch.long)
        attn = torch.zeros((len(batch), max_len), dtype=torch.long)
        for i, b in enumerate(batch):
            n = b["input_ids"].numel()
            input_ids[i, :n] = b["input_ids"]
            labels[i, :n] = b["labels"]
            attn[i, :n] = 1
        pixel_values = torch.stack([b["pixel_values"] for b in batch])
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attn, "pixel_values": pixel_values}

    return collate


def setup():
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), local_rank


def build_model(args):
    model = LlavaForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.float32)
    model.vision_tower.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    wrap_policy = functools.partial(
        transformer_auto_wrap_policy,
        transformer_layer_cls={LlamaDecoderLayer, CLIPEncoderLayer},
    )
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        mixed_precision=mp,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
        limit_all_gathers=True,
    )
    return model


def save_checkpoint(model, processor, step, args, rank):
    if rank != 0:
        return
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    out = os.path.join(args.output_dir, f"step_{step:07d}")
    os.makedirs(out, exist_ok=True)
    torch.save(state, os.path.join(out, "pytorch_model.bin"))
    processor.save_pretrained(out)
    print(f"saved {out}", flush=True)


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    total = torch.zeros(2, device="cuda")
    for batch in loader:
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        out = model(**batch)
        n_tok = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
        total[0] += out.loss.float() * n_tok
        total[1] += n_tok
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1].clamp(min=1)).item()


def main():
    args = parse_args()
    rank, world_size, local_rank = setup()
    torch.manual_seed(args.seed)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    processor = AutoProcessor.from_pretrained(args.model)
    pad_id = processor.tokenizer.pad_token_id or 0
    collate = make_collate(pad_id)

    train_ds = InstructDataset(args.train_json, args.image_root, processor, args.max_length)
    val_ds = InstructDataset(args.val_json, args.image_root, processor, args.max_length)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, collate_fn=collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.num_workers, collate_fn=collate, pin_memory=True)

    model = build_model(args)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    total_steps = args.epochs * len(train_loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    step = 0
    model.train()
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = (time.time() - t0) / args.log_every
                    print(f"epoch {epoch} step {step}/{total_steps} loss {l.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {dt:.2f}s/it", flush=True)
                t0 = time.time()

            if step % args.save_every == 0:
                save_checkpoint(model, processor, step, args, rank)

        val_loss = evaluate(model, val_loader)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} ppl {math.exp(min(val_loss, 20)):.2f}", flush=True)

    save_checkpoint(model, processor, step, args, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
