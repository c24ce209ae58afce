#!/usr/bin/env python
"""Intent classification for the voice assistant: LoRA on a 7B decoder with a
sequence-classification head.

The labelled export has no fixed dev split; we hold out --val_fraction of it.

    torchrun --nproc_per_node=4 17_lora_intent_cls.py \
        --model mistralai/Mistral-7B-v0.1 --data data/intents/export.jsonl --out runs/intent-lora
"""
import argparse
import logging
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    get_linear_schedule_with_warmup,
    set_seed,
)
from peft import LoraConfig, TaskType, get_peft_model

logger = logging.getLogger("intent")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mistralai/Mistral-7B-v0.1")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/intent-lora")
    ap.add_argument("--val_fraction", type=float, default=0.1)
    ap.add_argument("--max_len", type=int, default=128)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--label_smoothing", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=13)
    return ap.parse_args()


@torch.no_grad()
def evaluate(model, loader, num_labels, device):
    model.eval()
    conf = torch.zeros(num_labels, num_labels, device=device, dtype=torch.long)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            preds = model(**batch).logits.argmax(-1)
        conf.index_put_((labels, preds), torch.ones_like(labels), accumulate=True)
    dist.all_reduce(conf)
    model.train()
    tp = conf.diag().float()
    acc = (tp.sum() / conf.sum()).item()
    prec = tp / conf.sum(0).clamp(min=1)
    rec = tp / conf.sum(1).clamp(min=1)
    f1 = (2 * prec * rec / (prec + rec).clamp(min=1e-8)).mean().item()
    return acc, f1


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    # per-rank seed so LoRA dropout masks differ between replicas
    set_seed(args.seed + rank)

    raw = load_dataset("json", data_files=args.data, split="train", keep_in_memory=True)
    intents = sorted(set(raw["intent"]))
    label2id = {l: i for i, l in enumerate(intents)}
    id2label = {i: l for l, i in label2id.items()}
    splits = raw.train_test_split(test_size=args.val_fraction)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.eos_token

    def encode(batch):
        enc = tok(batch["text"], truncation=True, max_length=args.max_len)
        enc["labels"] = [label2id[x] for x in batch["intent"]]
        return enc

    train_ds = splits["train"].map(encode, batched=True, remove_columns=raw.column_names, keep_in_memory=True)
    val_ds = splits["test"].map(encode, batched=True, remove_columns=raw.column_names, keep_in_memory=True)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=len(intents), id2label=id2label, label2id=label2id,
        torch_dtype=torch.bfloat16)
    model.config.pad_token_id = tok.pad_token_id
    model = get_peft_model(model, LoraConfig(task_type=TaskType.SEQ_CLS, r=args.r, lora_alpha=16,
                                             lora_dropout=0.1, target_modules=["q_proj", "v_proj"]))
    # keep the trainable head and adapters in fp32
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    collator = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=collator,
                          num_workers=2, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=64, sampler=val_sampler, collate_fn=collator)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)

    best_f1 = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(**batch).logits
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=args.label_smoothing)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 50 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, loss.item())

        acc, f1 = evaluate(model.module, val_dl, len(intents), device)
        logger.info("epoch %d val acc %.4f macro-F1 %.4f", epoch, acc, f1)
        if f1 > best_f1:
            best_f1 = f1
            if rank == 0:
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
            dist.barrier()

    logger.info("best macro-F1 %.4f", best_f1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
