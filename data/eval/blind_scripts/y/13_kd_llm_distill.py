#!/usr/bin/env python
# Logit distillation of a 13B chat model into a 1.1B student (same tokenizer).
# The student trains with plain DDP; the teacher is frozen and only runs forward.
#
#   torchrun --nproc_per_node=8 distill_llm.py \
#       --teacher meta-llama/Llama-2-13b-chat-hf --student TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T \
#       --dataset HuggingFaceH4/ultrachat_200k --output_dir ckpts/tinyllama-distill
import argparse
import math
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_cosine_schedule_with_warmup


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--teacher", required=True)
    p.add_argument("--student", required=True)
    p.add_argument("--dataset", default="HuggingFaceH4/ultrachat_200k")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--seq_len", type=int, default=1024)
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--kd_weight", type=float, default=0.8)
    p.add_argument("--eval_every", type=int, default=250)
    p.add_argument("--save_every", type=int, default=1000)
    return p.parse_args()


@contextmanager
def main_process_first(rank):
    if rank != 0:
        dist.barrier()
    yield
    if rank == 0:
        dist.barrier()


def build_data(args, tokenizer, rank):
    def fmt(ex):
        text = tokenizer.apply_chat_template(ex["messages"], tokenize=False)
        ids = tokenizer(text, truncation=True, max_length=args.seq_len, padding="max_length")
        ids["labels"] = [t if m == 1 else -100 for t, m in zip(ids["input_ids"], ids["attention_mask"])]
        return ids

    with main_process_first(rank):
        raw = load_dataset(args.dataset)
        train = raw["train_sft"].map(fmt, remove_columns=raw["train_sft"].column_names, num_proc=16)
        val = raw["test_sft"].select(range(2000)).map(fmt, remove_columns=raw["test_sft"].column_names)
    return train, val


def distill_loss(s_logits, t_logits, labels, T, w):
    mask = (labels[:, 1:] != -100).float()
    s = s_logits[:, :-1].float()
    t = t_logits[:, :-1].float()
    kl = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True, reduction="none").sum(-1)
    kd = (kl * mask).sum() / mask.sum() * T * T
    ce = F.cross_entropy(s.reshape(-1, s.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)
    return w * kd + (1 - w) * ce, kd.detach(), ce.detach()


@torch.no_grad()
def evaluate(student, loader, device):
    student.eval()
    tot = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = student(**batch)
        n = (batch["labels"][:, 1:] != -100).sum()
        tot[0] += out.loss.float() * n
        tot[1] += n
    dist.all_reduce(tot)
    student.train()
    return math.exp((tot[0] / tot[1]).item())


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(args.student)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.unk_token
    train, val = build_data(args, tokenizer, rank)

    train_sampler = DistributedSampler(train, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train, batch_size=args.micro_batch, sampler=train_sampler,
                              collate_fn=default_data_collator, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val, batch_size=args.micro_batch,
                            sampler=DistributedSampler(val, shuffle=False, drop_last=True),
                            collate_fn=default_data_collator)

    teacher = AutoModelForCausalLM.from_pretrained(
        args.teacher, torch_dtype=torch.bfloat16, device_map="auto", attn_implementation="sdpa")
    teacher.eval()
    teacher.requires_grad_(False)

    student = AutoModelForCausalLM.from_pretrained(args.student, torch_dtype=torch.float32, attn_implementation="sdpa")
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    student.config.use_cache = False
    student.to(device)
    student = DDP(student, device_ids=[local_rank])

    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total_updates = args.epochs * len(train_loader) // args.grad_accum
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total_updates), total_updates)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{len(train)} train seqs, {total_updates} updates, global batch "
              f"{args.micro_batch * args.grad_accum * world}")

    update = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.no_grad():
                t_logits = teacher(input_ids=batch["input_ids"].to(teacher.device),
                                   attention_mask=batch["attention_mask"].to(teacher.device)).logits.to(device)
            last_micro = (i + 1) % args.grad_accum == 0
            with (student.no_sync() if not last_micro else torch.enable_grad()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    s_logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                loss, kd, ce = distill_loss(s_logits, t_logits, batch["labels"], args.temperature, args.kd_weight)
                (loss / args.grad_accum).backward()
            if not last_micro:
                continue

            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            update += 1

            if update % 10 == 0:
                logs = torch.stack([loss.detach(), kd, ce])
                dist.all_reduce(logs, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"upd {update}/{total_updates} loss {logs[0]:.4f} kd {logs[1]:.4f} ce {logs[2]:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e}", flush=True)
            if update % args.eval_every == 0:
                ppl = evaluate(student, val_loader, device)
                if rank == 0:
                    print(f"[eval] upd {update} student ppl {ppl:.3f}", flush=True)
            if update % args.save_every == 0:
                if rank == 0:
                    student.module.save_pretrained(os.path.join(args.output_dir, f"step_{update}"))
                    tokenizer.save_pretrained(os.path.join(args.output_dir, f"step_{update}"))
                dist.barrier()

    if rank == 0:
        student.module.save_pretrained(os.path.join(args.output_dir, "final"))
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
