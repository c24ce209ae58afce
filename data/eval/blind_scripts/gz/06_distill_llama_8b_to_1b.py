#!/usr/bin/env python3
# Distil Llama-3.1-8B-Instruct into a 1B student on a chat corpus.
# Forward KL on the full vocabulary + a small CE term on the reference answer.
#
#   torchrun --standalone --nproc_per_node=8 06_distill_llama_8b_to_1b.py \
#       --train_file data/ultrachat_200k_train.jsonl --output_dir out/distil-1b
import argparse
import json
import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

logger = logging.getLogger("distil")


def parse_args():
    parser = argparse.ArgumentParser(description="KD of an 8B teacher into a 1B student")
    parser.add_argument("--teacher_name", type=str, default="meta-llama/Llama-3.1-8B-Instruct")
    parser.add_argument("--student_name", type=str, default="meta-llama/Llama-3.2-1B")
    parser.add_argument("--train_file", type=str, required=True)
    parser.add_argument("--output_dir", type=str, default="out/distil-1b")
    parser.add_argument("--max_seq_length", type=int, default=2048)
    parser.add_argument("--per_device_batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--warmup_steps", type=int, default=200)
    parser.add_argument("--kd_temperature", type=float, default=1.0)
    parser.add_argument("--kd_weight", type=float, default=0.9)
    parser.add_argument("--save_steps", type=int, default=1000)
    parser.add_argument("--logging_steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=17)
    return parser.parse_args()


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class ChatDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        self.examples = []
        with open(path) as f:
            for line in f:
                msgs = json.loads(line)["messages"]
                ids = tokenizer.apply_chat_template(msgs, tokenize=True)[:max_len]
                # only the assistant turns are supervised
                prefix = tokenizer.apply_chat_template(msgs[:-1], tokenize=True, add_generation_prompt=True)
                labels = [-100] * min(len(prefix), len(ids)) + ids[len(prefix):]
                self.examples.append((ids, labels[:max_len]))

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, idx):
        return self.examples[idx]


class PadCollator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        L = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), L), self.pad_id)
        labels = torch.full((len(batch), L), -100)
        attn = torch.zeros((len(batch), L), dtype=torch.long)
        for i, (ids, lab) in enumerate(batch):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            labels[i, :len(lab)] = torch.tensor(lab)
            attn[i, :len(ids)] = 1
        return {"input_ids": input_ids, "attention_mask": attn, "labels": labels}


def distillation_loss(student_logits, teacher_logits, labels, temperature, kd_weight):
    s = student_logits[:, :-1, :].float()
    t = teacher_logits[:, :-1, :].float()
    tgt = labels[:, 1:]
    mask = (tgt != -100).float()
    s_logp = F.log_softmax(s / temperature, dim=-1)
    t_prob = F.softmax(t / temperature, dim=-1)
    kd = (t_prob * (torch.log(t_prob + 1e-9) - s_logp)).sum(-1)
    kd = (kd * mask).sum() / mask.sum().clamp(min=1) * temperature ** 2
    ce = F.cross_entropy(s.reshape(-1, s.size(-1)), tgt.reshape(-1), ignore_index=-100)
    return kd_weight * kd + (1 - kd_weight) * ce, kd.detach(), ce.detach()


def save(model, tokenizer, out_dir, tag):
    path = os.path.join(out_dir, tag)
    os.makedirs(path, exist_ok=True)
    model.module.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    logger.info("saved %s", path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed)

    logging.basicConfig(format="%(asctime)s [%(levelname)s] %(message)s",
                        level=logging.INFO if rank == 0 else logging.WARNING)

    tokenizer = AutoTokenizer.from_pretrained(args.student_name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    # the teacher only runs forward passes: bf16, no grads
    teacher = AutoModelForCausalLM.from_pretrained(
        args.teacher_name, torch_dtype=torch.bfloat16, device_map="auto")
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    student = AutoModelForCausalLM.from_pretrained(args.student_name, torch_dtype=torch.bfloat16)
    student.to(device)
    student = DDP(student, device_ids=[local_rank])

    dataset = ChatDataset(args.train_file, tokenizer, args.max_seq_length)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.per_device_batch_size, sampler=sampler,
                        collate_fn=PadCollator(tokenizer.pad_token_id), num_workers=2, pin_memory=True)

    optimizer = torch.optim.AdamW(student.parameters(), lr=args.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    updates_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    total_updates = updates_per_epoch * args.num_train_epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, total_updates)

    writer = SummaryWriter(os.path.join(args.output_dir, "tb")) if rank == 0 else None
    logger.info("dataset %d examples, %d updates, world size %d", len(dataset), total_updates, world_size)

    global_step = 0
    student.train()
    for epoch in range(args.num_train_epochs):
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.no_grad():
                t_out = teacher(input_ids=batch["input_ids"].to(teacher.device),
                                attention_mask=batch["attention_mask"].to(teacher.device))
                teacher_logits = t_out.logits.to(device)

            s_out = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            loss, kd, ce = distillation_loss(s_out.logits, teacher_logits, batch["labels"],
                                             args.kd_temperature, args.kd_weight)
            (loss / args.gradient_accumulation_steps).backward()

            if (i + 1) % args.gradient_accumulation_steps != 0 and (i + 1) != len(loader):
                continue
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1

            if global_step % args.logging_steps == 0:
                logs = torch.stack([loss.detach().float(), kd.float(), ce.float()])
                dist.all_reduce(logs)
                logs /= world_size
                if rank == 0:
                    writer.add_scalar("train/loss", logs[0].item(), global_step)
                    writer.add_scalar("train/kd", logs[1].item(), global_step)
                    writer.add_scalar("train/ce", logs[2].item(), global_step)
                    writer.add_scalar("train/lr", scheduler.get_last_lr()[0], global_step)
                    logger.info("epoch %d step %d loss %.4f kd %.4f ce %.4f", epoch, global_step,
                                logs[0].item(), logs[1].item(), logs[2].item())

            if global_step % args.save_steps == 0:
                if rank == 0:
                    save(student, tokenizer, args.output_dir, f"checkpoint-{global_step}")
                dist.barrier()

    if rank == 0:
        save(student, tokenizer, args.output_dir, "final")
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
