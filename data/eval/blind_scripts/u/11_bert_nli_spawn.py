"""Fine-tune a BERT-style encoder on MNLI with a hand-written training loop.

Single node, one process per GPU started with mp.spawn:
    python 11_bert_nli_spawn.py --model bert-base-uncased --data data/mnli --out runs/mnli_bert

No HF Trainer on purpose (we need the custom eval + the pooled-head experiments).
"""
import argparse
import functools
import json
import os
import random
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

LABELS = {'entailment': 0, 'neutral': 1, 'contradiction': 2}


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def load_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f]


def build_features(tokenizer, path, max_len):
    rows = [r for r in load_jsonl(path) if r['gold_label'] in LABELS]
    enc = tokenizer([r['sentence1'] for r in rows], [r['sentence2'] for r in rows],
                    truncation=True, max_length=max_len)
    return [{'id': i, 'input_ids': enc['input_ids'][i], 'token_type_ids': enc['token_type_ids'][i],
             'label': LABELS[r['gold_label']]} for i, r in enumerate(rows)]


def cached_features(tokenizer, path, max_len, cache_dir, rank):
    """Tokenise once on rank 0; the others wait and read the finished cache."""
    cache = os.path.join(cache_dir, os.path.basename(path) + f'.len{max_len}.pt')
    if rank == 0 and not os.path.exists(cache):
        feats = build_features(tokenizer, path, max_len)
        torch.save(feats, cache + '.tmp')
        os.replace(cache + '.tmp', cache)
    dist.barrier()
    return torch.load(cache)


class FeatDS(Dataset):
    def __init__(self, feats):
        self.f = feats

    def __len__(self):
        return len(self.f)

    def __getitem__(self, i):
        return self.f[i]


def collate(batch, pad_id=0):
    L = max(len(b['input_ids']) for b in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    tt = torch.zeros((len(batch), L), dtype=torch.long)
    for i, b in enumerate(batch):
        ids[i, :len(b['input_ids'])] = torch.tensor(b['input_ids'])
        tt[i, :len(b['token_type_ids'])] = torch.tensor(b['token_type_ids'])
    return {'input_ids': ids, 'token_type_ids': tt, 'attention_mask': (ids != pad_id).long(),
            'labels': torch.tensor([b['label'] for b in batch]), 'ids': torch.tensor([b['id'] for b in batch])}


class NLIModel(nn.Module):
    def __init__(self, name, n_labels=3, drop=0.1):
        super().__init__()
        self.enc = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.enc.config.hidden_size
        self.head = nn.Sequential(nn.Dropout(drop), nn.Linear(h, h), nn.Tanh(), nn.Dropout(drop), nn.Linear(h, n_labels))

    def forward(self, input_ids, token_type_ids, attention_mask):
        out = self.enc(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
        return self.head(out.last_hidden_state[:, 0])


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    preds = {}
    for b in loader:
        logits = model(b['input_ids'].to(device), b['token_type_ids'].to(device), b['attention_mask'].to(device))
        for i, p, y in zip(b['ids'].tolist(), logits.argmax(-1).tolist(), b['labels'].tolist()):
            preds[i] = (p, y)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, preds)
    merged = {}
    for g in gathered:
        merged.update(g)   # DistributedSampler pads with repeats; keyed by id -> counted once
    model.train()
    return sum(p == y for p, y in merged.values()) / len(merged)


def worker(rank, world_size, args):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = str(args.port)
    torch.cuda.set_device(rank)
    dist.init_process_group('nccl', rank=rank, world_size=world_size)
    device = torch.device('cuda', rank)
    set_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    os.makedirs(args.cache_dir, exist_ok=True)
    train_feats = cached_features(tok, os.path.join(args.data, 'train.jsonl'), args.max_len, args.cache_dir, rank)
    dev_feats = cached_features(tok, os.path.join(args.data, 'dev_matched.jsonl'), args.max_len, args.cache_dir, rank)

    train_ds, dev_ds = FeatDS(train_feats), FeatDS(dev_feats)
    train_sampler = DistributedSampler(train_ds, world_size, rank, shuffle=True, seed=args.seed)
    dev_sampler = DistributedSampler(dev_ds, world_size, rank, shuffle=False)
    coll = functools.partial(collate, pad_id=tok.pad_token_id)
    train_dl = DataLoader(train_ds, batch_size=args.per_gpu_bs, sampler=train_sampler, collate_fn=coll,
                          num_workers=2, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(dev_ds, batch_size=128, sampler=dev_sampler, collate_fn=coll, num_workers=2)

    model = NLIModel(args.model).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    no_decay = ('bias', 'LayerNorm.weight')
    groups = [
        {'params': [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], 'weight_decay': 0.01},
        {'params': [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], 'weight_decay': 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    # one optimizer step = per_gpu_bs * accum * world_size examples (32 * 1 * 4 = 128 with the defaults)
    steps_per_epoch = len(train_dl) // args.accum
    total = steps_per_epoch * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.06 * total), total)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    last = os.path.join(args.out, 'last.pt')
    if args.resume and os.path.exists(last):
        ck = torch.load(last, map_location='cpu')
        model.module.load_state_dict(ck['model'])
        opt.load_state_dict(ck['opt'])
        sched.load_state_dict(ck['sched'])
        scaler.load_state_dict(ck['scaler'])
        start_epoch = ck['epoch'] + 1

    writer = SummaryWriter(os.path.join(args.out, 'tb')) if rank == 0 else None
    best = 0.0
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        for step, b in enumerate(train_dl):
            sync_now = (step + 1) % args.accum == 0
            with (nullcontext() if sync_now else model.no_sync()):
                with torch.autocast('cuda', dtype=torch.float16):
                    logits = model(b['input_ids'].to(device, non_blocking=True),
                                   b['token_type_ids'].to(device, non_blocking=True),
                                   b['attention_mask'].to(device, non_blocking=True))
                    loss = nn.functional.cross_entropy(logits.float(), b['labels'].to(device)) / args.accum
                scaler.scale(loss).backward()
            if sync_now:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                sched.step()
                opt.zero_grad(set_to_none=True)
                gstep = epoch * steps_per_epoch + (step + 1) // args.accum
                if writer is not None and gstep % 50 == 0:
                    writer.add_scalar('train/loss', loss.item() * args.accum, gstep)
                    writer.add_scalar('train/lr', sched.get_last_lr()[0], gstep)
        acc = evaluate(model, dev_dl, device, world_size)
        if rank == 0:
            print(f'epoch {epoch}: dev-m acc {acc:.4f} ({time.time() - t0:.0f}s)', flush=True)
            writer.add_scalar('dev/acc', acc, epoch)
            os.makedirs(args.out, exist_ok=True)
            torch.save({'model': model.module.state_dict(), 'opt': opt.state_dict(), 'sched': sched.state_dict(),
                        'scaler': scaler.state_dict(), 'epoch': epoch}, last)
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.out, 'best_model.pt'))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--model', default='bert-base-uncased')
    ap.add_argument('--data', default='data/mnli')
    ap.add_argument('--cache_dir', default='cache')
    ap.add_argument('--out', default='runs/mnli_bert')
    ap.add_argument('--max_len', type=int, default=128)
    ap.add_argument('--per_gpu_bs', type=int, default=32)
    ap.add_argument('--accum', type=int, default=1)
    ap.add_argument('--lr', type=float, default=2e-5)
    ap.add_argument('--epochs', type=int, default=3)
    ap.add_argument('--seed', type=int, default=42)
    ap.add_argument('--port', type=int, default=29511)
    ap.add_argument('--resume', action='store_true')
    args = ap.parse_args()
    world_size = torch.cuda.device_count()
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == '__main__':
    main()
