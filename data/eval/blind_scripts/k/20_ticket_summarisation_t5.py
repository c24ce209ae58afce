"""Abstractive summarisation of support tickets (ticket thread -> agent handover note), Flan-T5 fine-tuning.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        20_ticket_summarisation_t5.py --config configs/t5_ticket_summ.yaml
"""
import argparse
import logging
import math
import os
from dataclasses import dataclass

import evaluate as hf_evaluate
import torch
import torch.distributed as dist
import yaml
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, get_cosine_schedule_with_warmup

logger = logging.getLogger("summ")


@dataclass
class SummConfig:
    model_name: str = "google/flan-t5-large"
    train_file: str = "/data/tickets/train.jsonl"
    valid_file: str = "/data/tickets/valid.jsonl"
    max_source_len: int = 1024
    max_target_len: int = 128
    per_device_batch: int = 4
    base_lr: float = 1e-4          # tuned for a global batch of 64
    base_global_batch: int = 64
    epochs: int = 5
    warmup_ratio: float = 0.05
    num_beams: int = 4
    patience: int = 2
    output_dir: str = "/ckpt/t5-ticket-summ"


@torch.no_grad()
def generate_and_score(model, tok, loader, device, cfg, rank, world_size, rouge):
    model.eval()
    local = []
    for batch in loader:
        idx = batch.pop("example_idx").tolist()
        out = model.generate(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                             max_new_tokens=cfg.max_target_len, num_beams=cfg.num_beams)
        labels = batch["labels"].masked_fill(batch["labels"] == -100, tok.pad_token_id)
        preds = tok.batch_decode(out, skip_special_tokens=True)
        refs = tok.batch_decode(labels, skip_special_tokens=True)
        local.extend(zip(idx, preds, refs))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    model.train()
    result = [None]
    if rank == 0:
        by_idx = {i: (p, r) for part in gathered for i, p, r in part}
        preds, refs = zip(*[by_idx[i] for i in sorted(by_idx)])
        result[0] = rouge.compute(predictions=list(preds), references=list(refs), use_stemmer=True)["rougeL"]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = SummConfig(**yaml.safe_load(open(ap.parse_args().config)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)

    tok = AutoTokenizer.from_pretrained(cfg.model_name)
    raw = load_dataset("json", data_files={"train": cfg.train_file, "valid": cfg.valid_file})

    def preprocess(batch):
        enc = tok(["summarize: " + t for t in batch["thread"]], max_length=cfg.max_source_len, truncation=True)
        enc["labels"] = tok(text_target=batch["handover_note"], max_length=cfg.max_target_len,
                            truncation=True)["input_ids"]
        return enc

    # local_rank 0 of each node builds the HF cache on node-local disk; the rest of the node reuses it
    if local_rank != 0:
        dist.barrier()
    train_ds = raw["train"].map(preprocess, batched=True, remove_columns=raw["train"].column_names)
    valid_ds = raw["valid"].map(preprocess, batched=True, remove_columns=raw["valid"].column_names)
    if local_rank == 0:
        dist.barrier()
    valid_ds = valid_ds.add_column("example_idx", list(range(len(valid_ds))))

    model = AutoModelForSeq2SeqLM.from_pretrained(cfg.model_name)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    collator = DataCollatorForSeq2Seq(tok, model=model, label_pad_token_id=-100, pad_to_multiple_of=8)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=11)
    train_loader = DataLoader(train_ds, batch_size=cfg.per_device_batch, sampler=sampler, collate_fn=collator,
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=cfg.per_device_batch * 2, collate_fn=collator, num_workers=2,
                              sampler=DistributedSampler(valid_ds, shuffle=False))

    model = DDP(model.to(device), device_ids=[local_rank])
    global_batch = cfg.per_device_batch * world_size
    lr = cfg.base_lr * math.sqrt(global_batch / cfg.base_global_batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    total = len(train_loader) * cfg.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total), total)
    if rank == 0:
        logger.info("world %d, global batch %d, lr %.2e, %d steps", world_size, global_batch, lr, total)
    rouge = hf_evaluate.load("rouge") if rank == 0 else None

    best, bad = -1.0, 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            loss_sum += torch.stack([loss.detach().float(), torch.ones((), device=device)])
        dist.all_reduce(loss_sum)

        rouge_l = generate_and_score(model.module, tok, valid_loader, device, cfg, rank, world_size, rouge)
        if rank == 0:
            logger.info("epoch %d train loss %.4f valid rougeL %.4f", epoch, (loss_sum[0] / loss_sum[1]).item(), rouge_l)
        if rouge_l > best:
            best, bad = rouge_l, 0
            if rank == 0:
                model.module.save_pretrained(os.path.join(cfg.output_dir, "best"))
                tok.save_pretrained(os.path.join(cfg.output_dir, "best"))
        else:
            bad += 1
        dist.barrier()
        if bad >= cfg.patience:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
