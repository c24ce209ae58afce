"""Fine-tune BART-large on CNN/DailyMail with plain PyTorch DDP.

torchrun --nproc_per_node=4 02_bart_cnndm_summarization.py --output_dir runs/bart_cnndm
"""
import argparse
import json
import logging
import math
import os

import nltk
import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from rouge_score import rouge_scorer, scoring
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm.auto import tqdm
from transformers import (AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq,
                          get_polynomial_decay_schedule_with_warmup)

logger = logging.getLogger(__name__)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", default="facebook/bart-large")
    parser.add_argument("--dataset_config", default="3.0.0")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_source_length", type=int, default=1024)
    parser.add_argument("--max_target_length", type=int, default=142)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=16)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=3e-5)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--label_smoothing", type=float, default=0.1)
    parser.add_argument("--num_train_epochs", type=int, default=3)
    parser.add_argument("--warmup_steps", type=int, default=500)
    parser.add_argument("--num_beams", type=int, default=4)
    parser.add_argument("--max_eval_samples", type=int, default=None)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args()


def postprocess(texts):
    # rougeLsum expects newline-separated sentences
    return ["\n".join(nltk.sent_tokenize(t.strip())) for t in texts]


def compute_rouge(preds, refs):
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeLsum"], use_stemmer=True)
    agg = scoring.BootstrapAggregator()
    for p, r in zip(preds, refs):
        agg.add_scores(scorer.score(r, p))
    result = agg.aggregate()
    return {k: round(v.mid.fmeasure * 100, 2) for k, v in result.items()}


def evaluate(model, tokenizer, eval_ds, raw_refs, args, device, rank, world_size):
    model.eval()
    shard = Subset(eval_ds, list(range(rank, len(eval_ds), world_size)))
    collator = DataCollatorForSeq2Seq(tokenizer, padding="longest")
    loader = DataLoader(shard, batch_size=args.per_device_eval_batch_size, collate_fn=collator, num_workers=2)
    local = []
    offset = 0
    with torch.no_grad():
        for batch in tqdm(loader, disable=rank != 0, desc="generate"):
            generated = model.generate(
                input_ids=batch["input_ids"].to(device),
                attention_mask=batch["attention_mask"].to(device),
                num_beams=args.num_beams,
                max_length=args.max_target_length,
                min_length=56,
                length_penalty=2.0,
                no_repeat_ngram_size=3,
                early_stopping=True,
            )
            texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
            for t in texts:
                local.append((shard.indices[offset], t))
                offset += 1
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    model.train()
    if rank != 0:
        return None
    preds = dict(p for part in gathered for p in part)
    order = sorted(preds)
    return compute_rouge(postprocess([preds[i] for i in order]), postprocess([raw_refs[i] for i in order]))


def save_model(model, tokenizer, path):
    model_to_save = model.module if hasattr(model, "module") else model
    model_to_save.save_pretrained(path)
    tokenizer.save_pretrained(path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s - %(levelname)s - %(message)s")
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model_name)
    model.config.dropout = 0.1

    def preprocess(examples):
        inputs = tokenizer(examples["article"], max_length=args.max_source_length, truncation=True)
        labels = tokenizer(text_target=examples["highlights"], max_length=args.max_target_length, truncation=True)
        inputs["labels"] = labels["input_ids"]
        return inputs

    # tokenise once on rank 0, the other ranks pick up the datasets cache
    if rank != 0:
        dist.barrier()
    raw = load_dataset("cnn_dailymail", args.dataset_config)
    if args.max_eval_samples is not None:
        raw["validation"] = raw["validation"].select(range(args.max_eval_samples))
    tokenized = raw.map(preprocess, batched=True, num_proc=8,
                        remove_columns=raw["train"].column_names, desc="tokenize")
    if rank == 0:
        dist.barrier()

    train_ds = tokenized["train"]
    eval_ds = tokenized["validation"]
    raw_refs = raw["validation"]["highlights"]

    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.per_device_train_batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=4, pin_memory=True, drop_last=True)

    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    no_decay = ["bias", "layer_norm.weight", "layernorm_embedding.weight"]
    grouped = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped, lr=args.learning_rate)
    updates_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    total_updates = updates_per_epoch * args.num_train_epochs
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, args.warmup_steps, total_updates)
    loss_fct = torch.nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=args.label_smoothing)

    logger.info("world_size=%d, updates/epoch=%d, total=%d", world_size, updates_per_epoch, total_updates)
    best_r2 = -1.0
    global_step = 0
    for epoch in range(args.num_train_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for step, batch in enumerate(tqdm(train_loader, disable=rank != 0, desc=f"epoch {epoch}")):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(**batch, decoder_input_ids=model.module.prepare_decoder_input_ids_from_labels(labels)).logits
            loss = loss_fct(logits.float().view(-1, logits.size(-1)), labels.view(-1))
            loss = loss / args.gradient_accumulation_steps
            loss.backward()
            running += torch.stack([loss.detach() * args.gradient_accumulation_steps, torch.ones((), device=device)])
            if (step + 1) % args.gradient_accumulation_steps == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
                if global_step % 50 == 0:
                    dist.all_reduce(running)
                    logger.info("step %d loss %.4f lr %.2e", global_step, (running[0] / running[1]).item(),
                                scheduler.get_last_lr()[0])
                    running.zero_()

        scores = evaluate(model, tokenizer, eval_ds, raw_refs, args, device, rank, world_size)
        if rank == 0:
            logger.info("epoch %d: %s", epoch, scores)
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, "eval_results.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, **scores}) + "\n")
            save_model(model, tokenizer, os.path.join(args.output_dir, f"epoch_{epoch}"))
            if scores["rouge2"] > best_r2:
                best_r2 = scores["rouge2"]
                save_model(model, tokenizer, os.path.join(args.output_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
