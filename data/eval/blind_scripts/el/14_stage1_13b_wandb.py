"""Stage 1 (feature alignment) for the 13B LLaVA variant, logged to Weights & Biases.

    torchrun --nproc_per_node 8 14_stage1_13b_wandb.py --data_path /data/blip_laion_cc_sbu_558k.json \
        --image_folder /data/558k_images --wandb_project vlm-stage1 --run_name s1-13b-mlp2x
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel,
                          get_cosine_schedule_with_warmup)

IGNORE_INDEX = -100


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", default="lmsys/vicuna-13b-v1.5")
    parser.add_argument("--vision_tower", default="openai/clip-vit-large-patch14-336")
    parser.add_argument("--mm_vision_select_layer", type=int, default=-2)
    parser.add_argument("--data_path", required=True)
    parser.add_argument("--image_folder", required=True)
    parser.add_argument("--output_dir", default="checkpoints/llava-13b-pretrain")
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--warmup_ratio", type=float, default=0.03)
    parser.add_argument("--model_max_length", type=int, default=2048)
    parser.add_argument("--logging_steps", type=int, default=1)
    parser.add_argument("--save_steps", type=int, default=24000)
    parser.add_argument("--wandb_project", default=None)
    parser.add_argument("--run_name", default=None)
    return parser.parse_args()


class PretrainDataset(Dataset):
    def __init__(self, data_path, image_folder, tokenizer, image_processor, max_len):
        self.list_data = json.load(open(data_path, "r"))
        self.image_folder = image_folder
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.max_len = max_len

    def __len__(self):
        return len(self.list_data)

    def __getitem__(self, i):
        source = self.list_data[i]
        image = Image.open(os.path.join(self.image_folder, source["image"])).convert("RGB")
        image = self.image_processor.preprocess(image, return_tensors="pt")["pixel_values"][0]
        caption = source["conversations"][1]["value"]
        input_ids = self.tokenizer(caption + "\n", add_special_tokens=True, truncation=True,
                                   max_length=self.max_len).input_ids
        labels = list(input_ids)
        labels[0] = IGNORE_INDEX
        return dict(input_ids=torch.tensor(input_ids), labels=torch.tensor(labels), image=image)


class DataCollatorForPretrain:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, instances):
        input_ids = nn.utils.rnn.pad_sequence([x["input_ids"] for x in instances], batch_first=True,
                                              padding_value=self.tokenizer.pad_token_id)
        labels = nn.utils.rnn.pad_sequence([x["labels"] for x in instances], batch_first=True,
                                           padding_value=IGNORE_INDEX)
        return dict(input_ids=input_ids, labels=labels, attention_mask=input_ids.ne(self.tokenizer.pad_token_id),
                    images=torch.stack([x["image"] for x in instances]))


class LlavaPretrainModel(nn.Module):
    def __init__(self, llm, vision_tower, select_layer):
        super().__init__()
        self.llm = llm
        self.vision_tower = vision_tower
        self.select_layer = select_layer
        h = llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(vision_tower.config.hidden_size, h), nn.GELU(),
                                          nn.Linear(h, h))

    def forward(self, input_ids, labels, attention_mask, images):
        with torch.no_grad():
            out = self.vision_tower(images, output_hidden_states=True)
            feats = out.hidden_states[self.select_layer][:, 1:]
        image_embeds = self.mm_projector(feats)
        tok_embeds = self.llm.get_input_embeddings()(input_ids)
        B, N = image_embeds.shape[:2]
        inputs_embeds = torch.cat([tok_embeds[:, :1], image_embeds, tok_embeds[:, 1:]], dim=1)
        attention_mask = torch.cat([attention_mask[:, :1], attention_mask.new_ones(B, N), attention_mask[:, 1:]], 1)
        labels = torch.cat([labels[:, :1], labels.new_full((B, N), IGNORE_INDEX), labels[:, 1:]], 1)
        return self.llm(inputs_embeds=inputs_embeds, attention_mask=attention_mask, labels=labels)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()

    if args.wandb_project:
        wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, use_fast=False,
                                              model_max_length=args.model_max_length)
    tokenizer.pad_token = tokenizer.unk_token
    image_processor = CLIPImageProcessor.from_pretrained(args.vision_tower)

    llm = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, torch_dtype=torch.bfloat16)
    llm.requires_grad_(False)
    vision_tower = CLIPVisionModel.from_pretrained(args.vision_tower, torch_dtype=torch.bfloat16)
    vision_tower.requires_grad_(False)
    model = LlavaPretrainModel(llm, vision_tower, args.mm_vision_select_layer)
    model.mm_projector.to(torch.bfloat16)
    model = DDP(model.cuda(local_rank), device_ids=[local_rank])

    dataset = PretrainDataset(args.data_path, args.image_folder, tokenizer, image_processor,
                              args.model_max_length)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=42)
    loader = DataLoader(dataset, batch_size=args.per_device_train_batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, collate_fn=DataCollatorForPretrain(tokenizer))

    optimizer = torch.optim.AdamW(model.module.mm_projector.parameters(), lr=args.learning_rate, weight_decay=0.0)
    max_steps = len(loader) // args.gradient_accumulation_steps
    scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(max_steps * args.warmup_ratio), max_steps)

    if rank == 0:
        print(f"{len(dataset)} samples, global batch "
              f"{args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size}, {max_steps} steps")

    sampler.set_epoch(0)
    model.train()
    global_step, running, t0 = 0, 0.0, time.time()
    for i, batch in enumerate(loader):
        batch = {k: v.cuda(local_rank, non_blocking=True) for k, v in batch.items()}
        batch["images"] = batch["images"].to(torch.bfloat16)
        last_micro = (i + 1) % args.gradient_accumulation_steps == 0
        ctx = model.no_sync() if not last_micro else torch.enable_grad()
        with ctx:
            loss = model(**batch).loss / args.gradient_accumulation_steps
            loss.backward()
        running += loss.item()
        if not last_micro:
            continue
        grad_norm = torch.nn.utils.clip_grad_norm_(model.module.mm_projector.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        global_step += 1

        if global_step % args.logging_steps == 0:
            stats = torch.tensor([running, grad_norm.item()], device=f"cuda:{local_rank}")
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            if args.wandb_project:
                wandb.log({"train/loss": stats[0].item(), "train/grad_norm": stats[1].item(),
                           "train/lr": scheduler.get_last_lr()[0],
                           "perf/sec_per_step": (time.time() - t0) / args.logging_steps}, step=global_step)
            if rank == 0 and global_step % 50 == 0:
                print(f"step {global_step}/{max_steps} loss {stats[0].item():.4f}", flush=True)
            t0 = time.time()
        running = 0.0

        if global_step % args.save_steps == 0 and rank == 0:
            os.makedirs(args.output_dir, exist_ok=True)
            torch.save({f"model.mm_projector.{k}": v for k, v in model.module.mm_projector.state_dict().items()},
                       os.path.join(args.output_dir, f"mm_projector-{global_step}.bin"))

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        torch.save({f"model.mm_projector.{k}": v for k, v in model.module.mm_projector.state_dict().items()},
                   os.path.join(args.output_dir, "mm_projector.bin"))
    if args.wandb_project:
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
