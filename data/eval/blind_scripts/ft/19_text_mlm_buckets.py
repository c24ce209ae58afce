"""Domain-adaptive MLM pretraining (BERT-style) on clinical notes of very different length.

Notes are tokenized once, grouped into length buckets and batched by a token budget;
the bucket order is reshuffled every epoch.

    torchrun --nproc_per_node=4 19_text_mlm_buckets.py --corpus data/notes_train.txt \
        --dev-corpus data/notes_dev.txt --tokenizer bert-base-uncased --out out/clinical_mlm
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import (AutoModelForMaskedLM, AutoTokenizer, DataCollatorForLanguageModeling,
                          get_polynomial_decay_schedule_with_warmup)


class NotesDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        with open(path, encoding="utf-8") as f:
            texts = [l.strip() for l in f if l.strip()]
        enc = tokenizer(texts, truncation=True, max_length=max_len, return_special_tokens_mask=True)
        self.examples, self.special = enc["input_ids"], enc["special_tokens_mask"]
        self.lengths = [len(x) for x in self.examples]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return {"input_ids": self.examples[i], "special_tokens_mask": self.special[i]}


class BucketBatchSampler(Sampler):
    """Token-budget batches over length-sorted data; batch order reshuffled per epoch."""

    def __init__(self, lengths, max_tokens, shuffle=True, seed=0, sort_window=10000):
        self.lengths, self.max_tokens = lengths, max_tokens
        self.shuffle, self.seed, self.sort_window = shuffle, seed, sort_window
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rnd = random.Random(self.seed + self.epoch)
        order = list(range(len(self.lengths)))
        if self.shuffle:
            rnd.shuffle(order)
        batches = []
        for s in range(0, len(order), self.sort_window):
            window = sorted(order[s:s + self.sort_window], key=self.lengths.__getitem__)
            cur, cur_max = [], 0
            for i in window:
                m = max(cur_max, self.lengths[i])
                if cur and m * (len(cur) + 1) > self.max_tokens:
                    batches.append(cur)
                    cur, m = [], self.lengths[i]
                cur.append(i)
                cur_max = m
            if cur:
                batches.append(cur)
        if self.shuffle:
            rnd.shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    loss_sum, n = 0.0, 0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        k = (batch["labels"] != -100).sum().item()
        loss_sum += out.loss.item() * k
        n += k
    model.train()
    return loss_sum / max(n, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--dev-corpus", required=True)
    ap.add_argument("--tokenizer", default="bert-base-uncased")
    ap.add_argument("--init", default="bert-base-uncased")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16384, help="tokens per GPU batch")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=100)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    train_ds = NotesDataset(args.corpus, tokenizer, args.max_len)
    dev_ds = NotesDataset(args.dev_corpus, tokenizer, args.max_len)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, pad_to_multiple_of=8)
    train_sampler = BucketBatchSampler(train_ds.lengths, args.max_tokens, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collator, num_workers=4,
                              pin_memory=True)
    dev_loader = DataLoader(dev_ds, batch_sampler=BucketBatchSampler(dev_ds.lengths, args.max_tokens, shuffle=False),
                            collate_fn=collator, num_workers=2)

    model = AutoModelForMaskedLM.from_pretrained(args.init).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    total_steps = args.epochs * len(train_sampler)
    scheduler = get_polynomial_decay_schedule_with_warmup(optimizer, args.warmup, total_steps)

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
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
                rate = 100 / (time.time() - t0)
                t0 = time.time()
                print(f"epoch {epoch} step {step}/{total_steps} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {rate:.2f} it/s", flush=True)

        if rank == 0:
            dev_loss = evaluate(model.module, dev_loader, device)
            print(f"epoch {epoch}: dev MLM loss {dev_loss:.4f} ppl {math.exp(dev_loss):.2f}", flush=True)
            model.module.save_pretrained(os.path.join(args.out, f"epoch_{epoch}"))
            tokenizer.save_pretrained(os.path.join(args.out, f"epoch_{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
