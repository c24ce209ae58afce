"""
BERT-large fine-tuning on MNLI across two 8-GPU nodes connected by plain Ethernet.
The gradient all-reduce is the bottleneck, so we wrap PowerSGD in fp16
compression (rank-8 factors sent as fp16).

node0: torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=10.0.0.11 --master_port=29511 \
           18_powersgd_bert_mnli.py --output_dir /mnt/shared/mnli_bertl_psgd
node1: same with --node_rank=1
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding
from transformers import get_linear_schedule_with_warmup


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name", default="bert-large-uncased")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_len", type=int, default=128)
    ap.add_argument("--per_device_batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--psgd_rank", type=int, default=8)
    ap.add_argument("--psgd_start_iter", type=int, default=500)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    # tokenize once on local rank 0 of every node, the others read the datasets cache
    if local_rank != 0:
        dist.barrier()
    raw = load_dataset("glue", "mnli")
    enc = raw.map(lambda b: tokenizer(b["premise"], b["hypothesis"], truncation=True, max_length=args.max_len),
                  batched=True, remove_columns=["premise", "hypothesis", "idx"])
    enc = enc.rename_column("label", "labels")
    if local_rank == 0:
        dist.barrier()

    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    train_ds = enc["train"]
    eval_sets = {"matched": enc["validation_matched"], "mismatched": enc["validation_mismatched"]}
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.per_device_batch, sampler=train_sampler,
                          collate_fn=collator, num_workers=2, pin_memory=True)
    eval_dls = {k: DataLoader(v, batch_size=64, sampler=DistributedSampler(v, shuffle=False),
                              collate_fn=collator, num_workers=2) for k, v in eval_sets.items()}

    model = AutoModelForSequenceClassification.from_pretrained(args.model_name, num_labels=3).to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.psgd_rank,
                                        start_powerSGD_iter=args.psgd_start_iter, min_compression_rate=2)
    model.register_comm_hook(state, default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook))

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = len(train_dl) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{len(train_ds)} train examples, {total_steps} steps, global batch "
              f"{args.per_device_batch * world}")

    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{total_steps} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / 100:.3f}s/step")
                t0 = time.time()

        model.eval()
        accs = {}
        for name, dl in eval_dls.items():
            c = torch.zeros(2, device=device)
            with torch.no_grad():
                for batch in dl:
                    batch = {k: v.to(device) for k, v in batch.items()}
                    logits = model(**batch).logits
                    c[0] += (logits.argmax(-1) == batch["labels"]).sum()
                    c[1] += batch["labels"].numel()
            dist.all_reduce(c)
            accs[name] = (c[0] / c[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: acc_m {accs['matched']:.4f} acc_mm {accs['mismatched']:.4f}")
            if accs["matched"] > best:
                best = accs["matched"]
                model.module.save_pretrained(args.output_dir)
                tokenizer.save_pretrained(args.output_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
