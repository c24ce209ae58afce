#!/usr/bin/env python
"""Sequence-level knowledge distillation (Kim & Rush, 2016) for a small chat model.

The teacher (Llama-3.1-70B-Instruct, served separately with vLLM) has already
answered every prompt; those answers are in `teacher_outputs.jsonl`. Here the
student is fine-tuned on (prompt, teacher answer) pairs with plain token CE.

    torchrun --nproc_per_node=4 15_seqkd_student_sft.py \
        --train data/teacher_outputs.jsonl --val data/teacher_outputs_val.jsonl
"""
import argparse
import json
import logging
import math
import os
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

log = logging.getLogger(__name__)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--student", default="HuggingFaceTB/SmolLM2-1.7B")
    p.add_argument("--train", default="data/teacher_outputs.jsonl")
    p.add_argument("--val", default="data/teacher_outputs_val.jsonl")
    p.add_argument("--out", default="ckpt/smollm2-seqkd")
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def read_pairs(path, tok, max_len):
    out = []
    with open(path) as f:
        for line in f:
            ex = json.loads(line)
            msgs = [{"role": "user", "content": ex["prompt"]}]
            prompt_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            answer_ids = tok(ex["teacher_response"], add_special_tokens=False).input_ids + [tok.eos_token_id]
            ids = (prompt_ids + answer_ids)[:max_len]
            labels = ([-100] * len(prompt_ids) + answer_ids)[:max_len]
            if any(l != -100 for l in labels):
                out.append({"input_ids": ids, "labels": labels})
    return out


def pad_batch(batch, pad_id):
    n = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    lab = torch.full((len(batch), n), -100, dtype=torch.long)
    att = torch.zeros((len(batch), n), dtype=torch.long)
    for i, b in enumerate(batch):
        k = len(b["input_ids"])
        ids[i, :k] = torch.tensor(b["input_ids"])
        lab[i, :k] = torch.tensor(b["labels"])
        att[i, :k] = 1
    return ids, att, lab


@torch.no_grad()
def val_loss(model, loader, device):
    model.eval()
    num = torch.zeros((), device=device, dtype=torch.float64)
    den = torch.zeros((), device=device, dtype=torch.float64)
    for ids, att, lab in loader:
        ids, att, lab = ids.to(device), att.to(device), lab.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids, attention_mask=att).logits
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), lab[:, 1:],
                                                ignore_index=-100, reduction="sum")
        num += nll
        den += (lab[:, 1:] != -100).sum()
    model.train()
    return (num / den).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")

    tok = AutoTokenizer.from_pretrained(args.student)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    train_pairs = read_pairs(args.train, tok, args.max_len)
    val_pairs = read_pairs(args.val, tok, args.max_len)
    collate = partial(pad_batch, pad_id=tok.pad_token_id)

    train_loader = DataLoader(train_pairs, batch_size=args.bs, shuffle=True, collate_fn=collate,
                              num_workers=2, pin_memory=True, drop_last=True)
    # every rank scores the (small) validation set; the numbers are identical on all ranks
    val_loader = DataLoader(val_pairs, batch_size=args.bs, shuffle=False, collate_fn=collate)

    model = AutoModelForCausalLM.from_pretrained(args.student, torch_dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "norm")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    steps_per_epoch = len(train_loader) // args.accum
    total = steps_per_epoch * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(args.warmup * total), total)
    log.info("train %d pairs, val %d pairs, %d steps/epoch, world %d",
             len(train_pairs), len(val_pairs), steps_per_epoch, world)

    best = float("inf")
    step = 0
    for epoch in range(args.epochs):
        t0 = time.time()
        for i, (ids, att, lab) in enumerate(train_loader):
            if i >= steps_per_epoch * args.accum:
                break
            ids, att, lab = ids.to(device), att.to(device), lab.to(device)
            sync = (i + 1) % args.accum == 0
            if sync:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
                (loss / args.accum).backward()
            else:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
                    (loss / args.accum).backward()
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 25 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                log.info("epoch %d step %d/%d loss %.4f lr %.2e (%.2fs/step)", epoch, step, total,
                         l.item(), sched.get_last_lr()[0], (time.time() - t0) / 25)
                t0 = time.time()

        vl = val_loss(model.module, val_loader, device)
        log.info("epoch %d val loss %.4f ppl %.2f", epoch, vl, math.exp(vl))
        if rank == 0 and vl < best:
            best = vl
            model.module.save_pretrained(args.out, safe_serialization=True)
            tok.save_pretrained(args.out)
            log.info("saved best model to %s", args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
