#!/usr/bin/env python
# Fine-tune roberta-base on a GLUE task (default MNLI) with plain DDP + wandb
#   torchrun --nproc_per_node=4 14_textcls_wandb.py --task mnli --bs 32 --lr 2e-5 --epochs 3
import os
import math
import time
import argparse
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from datasets import load_dataset
from transformers import (AutoTokenizer, AutoModelForSequenceClassification, DataCollatorWithPadding,
                          get_linear_schedule_with_warmup)
import wandb

TASK_KEYS = {'mnli': ('premise', 'hypothesis', 3, 'validation_matched'),
             'qnli': ('question', 'sentence', 2, 'validation'),
             'sst2': ('sentence', None, 2, 'validation'),
             'rte': ('sentence1', 'sentence2', 2, 'validation')}

ap = argparse.ArgumentParser()
ap.add_argument('--model', default='roberta-base')
ap.add_argument('--task', default='mnli', choices=list(TASK_KEYS))
ap.add_argument('--bs', type=int, default=32, help='per device')
ap.add_argument('--lr', type=float, default=2e-5)
ap.add_argument('--epochs', type=int, default=3)
ap.add_argument('--max_len', type=int, default=128)
ap.add_argument('--warmup_ratio', type=float, default=0.06)
ap.add_argument('--wd', type=float, default=0.1)
ap.add_argument('--eval_steps', type=int, default=2000)
ap.add_argument('--project', default='glue-ddp')
ap.add_argument('--run_name', default=None)
ap.add_argument('--out', default='runs/roberta_mnli')
ap.add_argument('--bf16', action='store_true')
args = ap.parse_args()


@contextmanager
def main_process_first(rank):
    if rank != 0:
        dist.barrier()
    yield
    if rank == 0:
        dist.barrier()


def build_data(tok, rank):
    k1, k2, _, val_split = TASK_KEYS[args.task]

    def enc(ex):
        if k2 is None:
            return tok(ex[k1], truncation=True, max_length=args.max_len)
        return tok(ex[k1], ex[k2], truncation=True, max_length=args.max_len)

    with main_process_first(rank):
        raw = load_dataset('glue', args.task)
        ds = raw.map(enc, batched=True, remove_columns=[c for c in raw['train'].column_names if c != 'label'],
                     desc='tokenize')
    ds = ds.rename_column('label', 'labels')
    ds.set_format('torch')
    return ds['train'], ds[val_split]


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, correct, n
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        n = batch['labels'].numel()
        stats += torch.stack([out.loss * n, (out.logits.argmax(-1) == batch['labels']).sum().float(),
                              torch.tensor(float(n), device=device)])
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)
    torch.manual_seed(42)

    run = wandb.init(project=args.project, name=args.run_name, config=vars(args))

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds, val_ds = build_data(tok, rank)
    collate = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True)
    val_shard = Subset(val_ds, list(range(rank, len(val_ds), world)))  # no padding duplicates
    val_loader = DataLoader(val_shard, batch_size=128, shuffle=False, collate_fn=collate, num_workers=2)

    n_labels = TASK_KEYS[args.task][2]
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=n_labels).to(device)
    model = DDP(model, device_ids=[local_rank])
    no_decay = ['bias', 'LayerNorm.weight']
    groups = [{'params': [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
               'weight_decay': args.wd},
              {'params': [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
               'weight_decay': 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    step, best = 0, 0.0
    model.train()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast('cuda', dtype=torch.bfloat16, enabled=args.bf16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                wandb.log({'train/loss': l.item(), 'train/lr': scheduler.get_last_lr()[0],
                           'train/it_per_s': 50 / (time.time() - t0), 'epoch': epoch}, step=step)
                t0 = time.time()
            if step % args.eval_steps == 0 or step == total:
                vloss, vacc = evaluate(model.module, val_loader, device)
                wandb.log({'eval/loss': vloss, 'eval/acc': vacc}, step=step)
                if rank == 0:
                    print(f'step {step}/{total} eval loss {vloss:.4f} acc {vacc:.4f}', flush=True)
                    if vacc > best:
                        best = vacc
                        model.module.save_pretrained(os.path.join(args.out, 'best'))
                        tok.save_pretrained(os.path.join(args.out, 'best'))

    if rank == 0:
        run.summary['best_acc'] = best
    run.finish()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
