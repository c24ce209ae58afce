"""LoRA fine-tuning of flan-t5-large for dialogue summarization (SAMSum) with DDP + bf16.

    torchrun --nproc_per_node=8 15_lora_t5_summarize.py --output_dir ckpt/flan_t5_l_samsum_lora
"""
import argparse
import logging
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from datasets import load_dataset
from peft import LoraConfig, TaskType, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, get_scheduler

log = logging.getLogger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name", default="google/flan-t5-large")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_source_len", type=int, default=512)
    ap.add_argument("--max_target_len", type=int, default=128)
    ap.add_argument("--per_device_batch", type=int, default=8)
    ap.add_argument("--grad_accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lora_r", type=int, default=16)
    ap.add_argument("--lora_alpha", type=int, default=32)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def preprocess(tokenizer, args):
    def fn(batch):
        inputs = ["summarize: " + d for d in batch["dialogue"]]
        enc = tokenizer(inputs, max_length=args.max_source_len, truncation=True)
        labels = tokenizer(text_target=batch["summary"], max_length=args.max_target_len, truncation=True)
        enc["labels"] = labels["input_ids"]
        return enc
    return fn


@torch.no_grad()
def eval_loss(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        ntok = (batch["labels"] != -100).sum()
        acc += torch.stack([loss.float() * ntok, ntok.float()])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    logging.basicConfig(format=f"%(asctime)s [rank {rank}] %(message)s", level=logging.INFO)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    base = AutoModelForSeq2SeqLM.from_pretrained(args.model_name)
    peft_cfg = LoraConfig(task_type=TaskType.SEQ_2_SEQ_LM, r=args.lora_r, lora_alpha=args.lora_alpha,
                          lora_dropout=0.05, target_modules=["q", "v"])
    model = get_peft_model(base, peft_cfg).to(device)
    if rank == 0:
        model.print_trainable_parameters()
    model = DDP(model, device_ids=[local_rank])

    if rank != 0:
        dist.barrier()
    ds = load_dataset("samsum")
    tokenized = ds.map(preprocess(tokenizer, args), batched=True,
                       remove_columns=ds["train"].column_names, desc="tokenizing")
    if rank == 0:
        dist.barrier()

    collator = DataCollatorForSeq2Seq(tokenizer, model=None, label_pad_token_id=-100, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(tokenized["train"], shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(tokenized["validation"], shuffle=False, drop_last=True)
    train_dl = DataLoader(tokenized["train"], batch_size=args.per_device_batch, sampler=train_sampler,
                          collate_fn=collator, num_workers=2, pin_memory=True)
    val_dl = DataLoader(tokenized["validation"], batch_size=16, sampler=val_sampler,
                        collate_fn=collator, num_workers=2)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    updates_per_epoch = math.ceil(len(train_dl) / args.grad_accum)
    total_updates = updates_per_epoch * args.epochs
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=int(0.05 * total_updates),
                              num_training_steps=total_updates)

    best = float("inf")
    update = 0
    model.train()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync_now = (step + 1) % args.grad_accum == 0 or step + 1 == len(train_dl)
            with (nullcontext() if sync_now else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / args.grad_accum
                if not torch.isfinite(loss):
                    log.warning("non-finite loss at epoch %d step %d, skipping batch", epoch, step)
                    optimizer.zero_grad(set_to_none=True)
                    continue
                loss.backward()
            if not sync_now:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1
            if rank == 0 and update % 25 == 0:
                log.info("epoch %d update %d/%d loss %.4f lr %.2e (%.1fs)", epoch, update, total_updates,
                         loss.item() * args.grad_accum, scheduler.get_last_lr()[0], time.time() - t0)

        val = eval_loss(model, val_dl, device)
        if rank == 0:
            log.info("epoch %d: val loss %.4f", epoch, val)
            if val < best:
                best = val
                model.module.save_pretrained(os.path.join(args.output_dir, "best_adapter"))
                tokenizer.save_pretrained(os.path.join(args.output_dir, "best_adapter"))
            sample = tokenizer("summarize: " + ds["validation"][0]["dialogue"], return_tensors="pt").to(device)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                gen = model.module.generate(**sample, max_new_tokens=60, num_beams=4)
            log.info("sample: %s", tokenizer.decode(gen[0], skip_special_tokens=True))
        dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "last_adapter"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
