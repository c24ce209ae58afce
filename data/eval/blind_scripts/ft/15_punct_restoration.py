"""Punctuation and casing restoration for ASR output, as token classification on XLM-R.

Training segments are whole paragraphs of very different length; they are bucketed by
sub-word count and batched under a token budget.

    torchrun --nproc_per_node=4 15_punct_restoration.py --train data/punct/train.jsonl \
        --dev data/punct/dev.jsonl --out models/punct_xlmr
"""
import argparse
import json
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

PUNCT = ["O", "COMMA", "PERIOD", "QUESTION"]
CASE = ["lower", "upper_first", "all_caps"]


class PunctDataset(Dataset):
    """jsonl rows: {"words": [...], "punct": [...], "case": [...]} (one label per word)."""

    def __init__(self, path, tokenizer, max_len=512):
        self.items = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                enc = tokenizer(ex["words"], is_split_into_words=True, truncation=True, max_length=max_len)
                p_lab, c_lab, prev = [], [], None
                for w in enc.word_ids():
                    if w is None or w == prev:
                        p_lab.append(-100)
                        c_lab.append(-100)
                    else:
                        p_lab.append(PUNCT.index(ex["punct"][w]))
                        c_lab.append(CASE.index(ex["case"][w]))
                    prev = w
                self.items.append((enc["input_ids"], p_lab, c_lab))
        self.lengths = np.array([len(x[0]) for x in self.items])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def make_collate(pad_id):
    def fn(batch):
        T = max(len(b[0]) for b in batch)
        ids = torch.full((len(batch), T), pad_id)
        att = torch.zeros((len(batch), T), dtype=torch.long)
        pl = torch.full((len(batch), T), -100)
        cl = torch.full((len(batch), T), -100)
        for i, (x, p, c) in enumerate(batch):
            n = len(x)
            ids[i, :n], att[i, :n] = torch.tensor(x), 1
            pl[i, :n], cl[i, :n] = torch.tensor(p), torch.tensor(c)
        return ids, att, pl, cl
    return fn


class ShardedBucketSampler(Sampler):
    def __init__(self, lengths, max_tokens, world, rank, shuffle=True, seed=0, pad=True):
        self.lengths, self.max_tokens = lengths, max_tokens
        self.world, self.rank = world, rank
        self.shuffle, self.seed, self.pad = shuffle, seed, pad
        self.epoch = 0
        order = np.argsort(lengths, kind="stable")
        self.batches, cur = [], []
        for i in order:
            if cur and lengths[i] * (len(cur) + 1) > max_tokens:
                self.batches.append(cur)
                cur = []
            cur.append(int(i))
        if cur:
            self.batches.append(cur)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        batches = list(self.batches)
        if self.shuffle:
            perm = np.random.RandomState(self.seed + self.epoch).permutation(len(batches))
            batches = [batches[i] for i in perm]
        if self.pad and len(batches) % self.world:
            batches += batches[: self.world - len(batches) % self.world]
        return iter(batches[self.rank::self.world])

    def __len__(self):
        n = len(self.batches)
        if self.pad:
            return -(-n // self.world)
        return len(range(self.rank, n, self.world))


class PunctCaseModel(nn.Module):
    def __init__(self, name, dropout=0.1):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)
        d = self.encoder.config.hidden_size
        self.drop = nn.Dropout(dropout)
        self.punct_head = nn.Linear(d, len(PUNCT))
        self.case_head = nn.Linear(d, len(CASE))

    def forward(self, ids, att):
        h = self.drop(self.encoder(input_ids=ids, attention_mask=att).last_hidden_state)
        return self.punct_head(h), self.case_head(h)


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    preds, golds = [], []
    for ids, att, pl, _ in loader:
        p_logits, _ = model(ids.to(device), att.to(device))
        keep = pl.to(device) != -100
        preds.append(p_logits.argmax(-1)[keep])
        golds.append(pl.to(device)[keep])
    preds = torch.cat(preds) if preds else torch.empty(0, dtype=torch.long, device=device)
    golds = torch.cat(golds) if golds else torch.empty(0, dtype=torch.long, device=device)
    all_preds = [torch.zeros_like(preds) for _ in range(world)]
    all_golds = [torch.zeros_like(golds) for _ in range(world)]
    dist.all_gather(all_preds, preds)
    dist.all_gather(all_golds, golds)
    model.train()
    return torch.cat(all_preds).cpu().numpy(), torch.cat(all_golds).cpu().numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="xlm-roberta-base")
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--head-lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--case-weight", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds, dev_ds = PunctDataset(args.train, tok), PunctDataset(args.dev, tok)
    collate = make_collate(tok.pad_token_id)
    train_sampler = ShardedBucketSampler(train_ds.lengths, args.max_tokens, world, rank, seed=args.seed)
    dev_sampler = ShardedBucketSampler(dev_ds.lengths, args.max_tokens, world, rank, shuffle=False, pad=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collate, num_workers=2, pin_memory=True)
    dev_loader = DataLoader(dev_ds, batch_sampler=dev_sampler, collate_fn=collate, num_workers=2)

    model = DDP(PunctCaseModel(args.model).to(device), device_ids=[local_rank])
    enc_params = [p for n, p in model.named_parameters() if "encoder." in n]
    head_params = [p for n, p in model.named_parameters() if "encoder." not in n]
    optimizer = torch.optim.AdamW([{"params": enc_params, "lr": args.lr},
                                   {"params": head_params, "lr": args.head_lr}], weight_decay=0.01)
    total = args.epochs * len(train_sampler)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.05 * total), total)
    ce = nn.CrossEntropyLoss(ignore_index=-100)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (ids, att, pl, cl) in enumerate(train_loader):
            ids, att, pl, cl = ids.to(device), att.to(device), pl.to(device), cl.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                p_logits, c_logits = model(ids, att)
            loss = ce(p_logits.float().flatten(0, 1), pl.flatten()) + \
                args.case_weight * ce(c_logits.float().flatten(0, 1), cl.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(train_sampler)} loss {loss.item():.4f}", flush=True)

        y_pred, y_true = evaluate(model.module, dev_loader, device, world)
        if rank == 0:
            macro = f1_score(y_true, y_pred, labels=[1, 2, 3], average="macro")
            print(classification_report(y_true, y_pred, labels=[0, 1, 2, 3], target_names=PUNCT, digits=4))
            print(f"epoch {epoch}: punctuation macro-F1 (no O) {macro:.4f}", flush=True)
            if macro > best:
                best = macro
                os.makedirs(args.out, exist_ok=True)
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
                tok.save_pretrained(args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
