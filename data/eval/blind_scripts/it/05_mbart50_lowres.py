#!/usr/bin/env python
# Fine-tune mBART-50 many-to-many on a low-resource pair (default en_XX -> si_LK).
#
#   torchrun --nproc_per_node=4 05_mbart50_lowres.py \
#       --train_file data/en-si/train.jsonl --valid_file data/en-si/flores_dev.jsonl
#
import argparse
import logging
import math
import os
from contextlib import nullcontext

import sacrebleu
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (DataCollatorForSeq2Seq, MBart50TokenizerFast,
                          MBartForConditionalGeneration, get_polynomial_decay_schedule_with_warmup)

logger = logging.getLogger("mbart50")


def parse_args():
    parser = argparse.ArgumentParser(description="mBART-50 bilingual fine-tuning")
    parser.add_argument("--model_name", default="facebook/mbart-large-50-many-to-many-mmt")
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--valid_file", required=True)
    parser.add_argument("--src_lang", default="en_XX")
    parser.add_argument("--tgt_lang", default="si_LK")
    parser.add_argument("--src_key", default="en")
    parser.add_argument("--tgt_key", default="si")
    parser.add_argument("--output_dir", default="outputs/mbart50-en-si")
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--grad_accum", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=3e-5)
    parser.add_argument("--warmup_steps", type=int, default=500)
    parser.add_argument("--num_epochs", type=int, default=10)
    parser.add_argument("--max_source_length", type=int, default=128)
    parser.add_argument("--max_target_length", type=int, default=128)
    parser.add_argument("--num_beams", type=int, default=5)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def build_datasets(args, tokenizer, rank):
    raw = load_dataset("json", data_files={"train": args.train_file, "validation": args.valid_file})

    def preprocess(batch):
        model_inputs = tokenizer(batch[args.src_key], max_length=args.max_source_length, truncation=True)
        labels = tokenizer(text_target=batch[args.tgt_key], max_length=args.max_target_length,
                           truncation=True)
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    # the main process tokenizes first and writes the datasets cache; the others reuse it
    if rank != 0:
        dist.barrier()
    train = raw["train"].map(preprocess, batched=True, remove_columns=raw["train"].column_names,
                             desc="tokenize train")
    if rank == 0:
        dist.barrier()
    return train, raw["validation"]


@torch.no_grad()
def evaluate(model, tokenizer, valid, args, rank, world, device):
    model.eval()
    src_all, ref_all = valid[args.src_key], valid[args.tgt_key]
    mine = list(range(rank, len(src_all), world))
    forced_bos = tokenizer.lang_code_to_id[args.tgt_lang]
    outputs = []
    bs = args.per_device_batch_size * 4
    for start in range(0, len(mine), bs):
        idx = mine[start : start + bs]
        enc = tokenizer([src_all[i] for i in idx], return_tensors="pt", padding=True,
                        truncation=True, max_length=args.max_source_length).to(device)
        gen = model.generate(**enc, forced_bos_token_id=forced_bos, num_beams=args.num_beams,
                             max_length=args.max_target_length + 10)
        outputs.extend(zip(idx, tokenizer.batch_decode(gen, skip_special_tokens=True)))
    gathered = [None] * world
    dist.all_gather_object(gathered, outputs)
    model.train()
    by_idx = dict(pair for part in gathered for pair in part)
    hyps = [by_idx[i] for i in range(len(src_all))]
    bleu = sacrebleu.corpus_bleu(hyps, [ref_all])
    chrf = sacrebleu.corpus_chrf(hyps, [ref_all], word_order=2)
    return bleu.score, chrf.score


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    torch.manual_seed(args.seed)

    tokenizer = MBart50TokenizerFast.from_pretrained(args.model_name, src_lang=args.src_lang,
                                                     tgt_lang=args.tgt_lang)
    model = MBartForConditionalGeneration.from_pretrained(args.model_name)
    model.config.forced_bos_token_id = tokenizer.lang_code_to_id[args.tgt_lang]
    model.to(device)

    train_ds, valid_ds = build_datasets(args, tokenizer, rank)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, padding="longest", pad_to_multiple_of=8)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.per_device_batch_size, sampler=sampler,
                        collate_fn=collator, num_workers=4, drop_last=True)

    ddp_model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    no_decay = ("bias", "layer_norm.weight", "layernorm_embedding.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)
    updates_per_epoch = len(loader) // args.grad_accum
    total_updates = updates_per_epoch * args.num_epochs
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, args.warmup_steps, total_updates)

    logger.info("train=%d valid=%d world=%d updates=%d", len(train_ds), len(valid_ds), world, total_updates)
    best_chrf = -1.0
    update = 0
    for epoch in range(args.num_epochs):
        sampler.set_epoch(epoch)
        loss_acc = torch.zeros((), device=device)
        for i, batch in enumerate(loader):
            batch = {k: v.to(device) for k, v in batch.items()}
            sync_now = (i + 1) % args.grad_accum == 0
            with (nullcontext() if sync_now else ddp_model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = ddp_model(**batch).loss / args.grad_accum
                loss.backward()
            loss_acc += loss.detach()
            if not sync_now:
                continue
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1
            if update % 50 == 0:
                dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
                logger.info("epoch %d update %d loss %.4f lr %.2e", epoch, update,
                            loss_acc.item() / 50, scheduler.get_last_lr()[0])
                loss_acc.zero_()

        bleu, chrf = evaluate(model, tokenizer, valid_ds, args, rank, world, device)
        logger.info("epoch %d: BLEU %.2f chrF++ %.2f", epoch, bleu, chrf)
        if rank == 0 and chrf > best_chrf:
            best_chrf = chrf
            model.save_pretrained(os.path.join(args.output_dir, "best"))
            tokenizer.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    if rank == 0:
        model.save_pretrained(os.path.join(args.output_dir, "final"))
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
