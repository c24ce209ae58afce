"""Token-classification (NER) fine-tuning with length-bucketed, token-budget batches.

    torchrun --nproc_per_node=4 09_ner_tagging_buckets.py --train data/ner/train.conll \
        --dev data/ner/dev.conll --model bert-base-cased --out out/ner_bert
"""
import argparse
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import AutoModelForTokenClassification, AutoTokenizer, get_cosine_schedule_with_warmup

logger = logging.getLogger("ner")


def read_conll(path):
    sents, words, tags = [], [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("-DOCSTART-"):
                if words:
                    sents.append((words, tags))
                    words, tags = [], []
                continue
            parts = line.split()
            words.append(parts[0])
            tags.append(parts[-1])
    if words:
        sents.append((words, tags))
    return sents


class NERDataset(Dataset):
    def __init__(self, sents, tokenizer, tag2id, max_length=256):
        self.examples = []
        for words, tags in sents:
            enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_length)
            labels, prev = [], None
            for wid in enc.word_ids():
                if wid is None or wid == prev:
                    labels.append(-100)  # special tokens and continuation sub-words
                else:
                    labels.append(tag2id[tags[wid]])
                prev = wid
            self.examples.append((enc["input_ids"], labels))
        self.lengths = np.array([len(ids) for ids, _ in self.examples])

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def make_collate(pad_id):
    def collate(batch):
        T = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), T), pad_id)
        labels = torch.full((len(batch), T), -100)
        mask = torch.zeros((len(batch), T), dtype=torch.long)
        for i, (ids, lab) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
            mask[i, : len(ids)] = 1
        return input_ids, mask, labels
    return collate


class DistributedTokenBucketSampler(Sampler):
    def __init__(self, lengths, max_tokens, num_replicas, rank, shuffle=True, seed=0, bucket_size=1000,
                 pad_last=True):
        self.lengths, self.max_tokens = lengths, max_tokens
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.bucket_size, self.pad_last = shuffle, seed, bucket_size, pad_last
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _batches(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        idx = rng.permutation(len(self.lengths)) if self.shuffle else np.arange(len(self.lengths))
        batches = []
        for s in range(0, len(idx), self.bucket_size):
            bucket = idx[s:s + self.bucket_size]
            bucket = bucket[np.argsort(self.lengths[bucket], kind="stable")]
            cur = []
            for i in bucket:
                if cur and self.lengths[i] * (len(cur) + 1) > self.max_tokens:
                    batches.append(cur)
                    cur = []
                cur.append(int(i))
            if cur:
                batches.append(cur)
        if self.shuffle:
            batches = [batches[j] for j in rng.permutation(len(batches))]
        if self.pad_last and len(batches) % self.num_replicas:
            batches += batches[: self.num_replicas - len(batches) % self.num_replicas]
        return batches[self.rank::self.num_replicas]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return len(self._batches())


@torch.no_grad()
def evaluate(model, loader, id2tag, device):
    model.eval()
    y_true, y_pred = [], []
    for input_ids, mask, labels in loader:
        logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
        preds = logits.argmax(-1).cpu()
        for p_row, l_row in zip(preds, labels):
            keep = l_row != -100
            y_true.append([id2tag[t] for t in l_row[keep].tolist()])
            y_pred.append([id2tag[t] for t in p_row[keep].tolist()])
    model.train()
    return f1_score(y_true, y_pred), classification_report(y_true, y_pred, digits=4)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--dev", required=True)
    parser.add_argument("--model", default="bert-base-cased")
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--warmup-ratio", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed)

    train_sents, dev_sents = read_conll(args.train), read_conll(args.dev)
    tags = sorted({t for _, ts in train_sents for t in ts})
    tag2id = {t: i for i, t in enumerate(tags)}
    id2tag = dict(enumerate(tags))

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_ds = NERDataset(train_sents, tokenizer, tag2id)
    dev_ds = NERDataset(dev_sents, tokenizer, tag2id)
    collate = make_collate(tokenizer.pad_token_id)
    train_sampler = DistributedTokenBucketSampler(train_ds.lengths, args.max_tokens, world, rank, seed=args.seed)
    dev_sampler = DistributedTokenBucketSampler(dev_ds.lengths, args.max_tokens, world, rank, shuffle=False,
                                                pad_last=False)
    train_loader = DataLoader(train_ds, batch_sampler=train_sampler, collate_fn=collate, num_workers=2)
    dev_loader = DataLoader(dev_ds, batch_sampler=dev_sampler, collate_fn=collate, num_workers=2)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(tags), id2label=id2tag, label2id=tag2id).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_sampler) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)

    best_f1 = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running = 0.0
        for step, (input_ids, mask, labels) in enumerate(train_loader, 1):
            input_ids, mask, labels = input_ids.to(device), mask.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            running += out.loss.item()
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_sampler), running / 100)
                running = 0.0

        dev_f1, report = evaluate(model.module, dev_loader, id2tag, device)
        if rank == 0:
            logger.info("epoch %d dev entity F1 %.4f\n%s", epoch, dev_f1, report)
            if dev_f1 > best_f1:
                best_f1 = dev_f1
                model.module.save_pretrained(args.out)
                tokenizer.save_pretrained(args.out)
                logger.info("new best (%.4f), saved to %s", best_f1, args.out)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
