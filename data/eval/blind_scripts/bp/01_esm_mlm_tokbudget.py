#!/usr/bin/env python
"""Masked-LM pretraining of a small ESM-2 style model on UniRef50.

Sequences are grouped into length-sorted batches under a token budget so that
short and long proteins do not share a batch (much less padding).

    torchrun --nproc_per_node=8 01_esm_mlm_tokbudget.py \
        --train_fasta /data/uniref50/train.fasta --valid_fasta /data/uniref50/valid.fasta
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import EsmConfig, EsmForMaskedLM, EsmTokenizer, get_polynomial_decay_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_fasta", required=True)
    p.add_argument("--valid_fasta", required=True)
    p.add_argument("--tokenizer", default="facebook/esm2_t6_8M_UR50D")
    p.add_argument("--out_dir", default="runs/esm_mlm")
    p.add_argument("--max_len", type=int, default=1022)
    p.add_argument("--max_tokens", type=int, default=16384, help="tokens per GPU per step, padding included")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=480)
    p.add_argument("--heads", type=int, default=20)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--warmup_steps", type=int, default=2000)
    p.add_argument("--total_steps", type=int, default=250000)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--mask_prob", type=float, default=0.15)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--seed", type=int, default=17)
    return p.parse_args()


def read_fasta(path):
    seqs, cur = [], []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            if line.startswith(">"):
                if cur:
                    seqs.append("".join(cur))
                    cur = []
            else:
                cur.append(line)
    if cur:
        seqs.append("".join(cur))
    return seqs


class ProteinDataset(Dataset):
    def __init__(self, seqs, tokenizer, max_len, random_crop=True):
        self.seqs = seqs
        self.tok = tokenizer
        self.max_len = max_len
        self.random_crop = random_crop

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        if len(s) > self.max_len:
            start = random.randint(0, len(s) - self.max_len) if self.random_crop else 0
            s = s[start:start + self.max_len]
        ids = self.tok(s, add_special_tokens=True)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)


class TokenBudgetBatchSampler(Sampler):
    """Length-sorted batches holding at most `max_tokens` tokens (padding counted)."""

    def __init__(self, lengths, max_tokens, max_len, rank, world_size, shuffle=True, seed=0):
        self.lengths = np.minimum(np.asarray(lengths), max_len) + 2  # <cls> and <eos>
        self.max_tokens = max_tokens
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        idx = np.arange(len(self.lengths))
        if self.shuffle:
            rng.shuffle(idx)
        idx = idx[self.rank::self.world_size]
        idx = idx[np.argsort(self.lengths[idx], kind="stable")]
        batches, cur, cur_max = [], [], 0
        for i in idx:
            longest = max(cur_max, self.lengths[i])
            if cur and longest * (len(cur) + 1) > self.max_tokens:
                batches.append(cur)
                cur, longest = [], self.lengths[i]
            cur.append(int(i))
            cur_max = longest
        if cur:
            batches.append(cur)
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


class MLMCollator:
    def __init__(self, tokenizer, mask_prob):
        self.tok = tokenizer
        self.mask_prob = mask_prob
        self.special = torch.tensor(sorted(set(tokenizer.all_special_ids)))

    def __call__(self, batch):
        L = max(x.numel() for x in batch)
        input_ids = torch.full((len(batch), L), self.tok.pad_token_id, dtype=torch.long)
        for j, x in enumerate(batch):
            input_ids[j, : x.numel()] = x
        attn = (input_ids != self.tok.pad_token_id).long()
        labels = input_ids.clone()
        prob = torch.full(labels.shape, self.mask_prob)
        prob[torch.isin(labels, self.special)] = 0.0
        masked = torch.bernoulli(prob).bool()
        labels[~masked] = -100
        # 80% <mask>, 10% random amino acid, 10% unchanged
        replace = torch.bernoulli(torch.full(labels.shape, 0.8)).bool() & masked
        input_ids[replace] = self.tok.mask_token_id
        rand = torch.bernoulli(torch.full(labels.shape, 0.5)).bool() & masked & ~replace
        input_ids[rand] = torch.randint(4, 24, (int(rand.sum()),))  # standard amino-acid ids
        return {"input_ids": input_ids, "attention_mask": attn, "labels": labels}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        n = (batch["labels"] != -100).sum()
        stats[0] += out.loss.double() * n
        stats[1] += n
    dist.all_reduce(stats)
    model.train()
    return math.exp((stats[0] / stats[1]).item())


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)

    tok = EsmTokenizer.from_pretrained(args.tokenizer)
    train_seqs = read_fasta(args.train_fasta)
    valid_seqs = read_fasta(args.valid_fasta)
    if rank == 0:
        print(f"train={len(train_seqs)} valid={len(valid_seqs)} world={world}", flush=True)

    collate = MLMCollator(tok, args.mask_prob)
    train_sampler = TokenBudgetBatchSampler([len(s) for s in train_seqs], args.max_tokens, args.max_len,
                                            rank, world, shuffle=True, seed=args.seed)
    valid_sampler = TokenBudgetBatchSampler([len(s) for s in valid_seqs], args.max_tokens, args.max_len,
                                            rank, world, shuffle=False)
    train_loader = DataLoader(ProteinDataset(train_seqs, tok, args.max_len), batch_sampler=train_sampler,
                              collate_fn=collate, num_workers=6, pin_memory=True, persistent_workers=True)
    valid_loader = DataLoader(ProteinDataset(valid_seqs, tok, args.max_len, random_crop=False),
                              batch_sampler=valid_sampler, collate_fn=collate, num_workers=2)

    config = EsmConfig(vocab_size=tok.vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                       max_position_embeddings=args.max_len + 2, position_embedding_type="rotary",
                       pad_token_id=tok.pad_token_id, mask_token_id=tok.mask_token_id,
                       token_dropout=True, emb_layer_norm_before=False)
    model = EsmForMaskedLM(config).to(device)
    # the attention-map contact regression is fit after pretraining, not here
    model.esm.contact_head.requires_grad_(False)
    model = DDP(model, device_ids=[local_rank])

    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    sched = get_polynomial_decay_schedule_with_warmup(opt, args.warmup_steps, args.total_steps,
                                                      lr_end=args.lr / 10)

    os.makedirs(args.out_dir, exist_ok=True)
    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % args.log_every == 0 and rank == 0:
                dt = time.time() - t0
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {args.log_every / dt:.2f} it/s", flush=True)
                t0 = time.time()
            if step >= args.total_steps:
                break

        ppl = evaluate(model, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch} valid ppl {ppl:.3f}", flush=True)
            model.module.save_pretrained(os.path.join(args.out_dir, f"epoch{epoch}"))
            tok.save_pretrained(os.path.join(args.out_dir, f"epoch{epoch}"))
        dist.barrier()
        if step >= args.total_steps:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
