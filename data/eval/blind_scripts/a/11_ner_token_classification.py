"""CoNLL-2003 NER with bert-base-cased, DDP (torchrun), entity-level F1 on the dev set.

    torchrun --nproc_per_node=4 train_ner.py --data_dir data/conll2003 --epochs 3
"""
import argparse
import os

import torch
import torch.distributed as dist
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification,
                          get_linear_schedule_with_warmup)

LABELS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
L2I = {l: i for i, l in enumerate(LABELS)}


def read_conll(path):
    sents, words, tags = [], [], []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("-DOCSTART-"):
                if words:
                    sents.append((words, tags))
                    words, tags = [], []
                continue
            cols = line.split()
            words.append(cols[0])
            tags.append(cols[-1])
    if words:
        sents.append((words, tags))
    return sents


class NERDataset(Dataset):
    def __init__(self, path, tokenizer, max_len=256):
        self.items = []
        for idx, (words, tags) in enumerate(read_conll(path)):
            enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_len)
            labels, prev = [], None
            for wid in enc.word_ids():
                if wid is None or wid == prev:
                    labels.append(-100)  # special tokens and sub-word continuations
                else:
                    labels.append(L2I[tags[wid]])
                prev = wid
            self.items.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                               "labels": labels, "idx": idx})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Collator:
    def __init__(self, tokenizer):
        self.inner = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)

    def __call__(self, features):
        idx = torch.tensor([f["idx"] for f in features])
        batch = self.inner([{k: v for k, v in f.items() if k != "idx"} for f in features])
        batch["idx"] = idx
        return batch


def gather(t):
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out, dim=0)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    seen = set()
    y_true, y_pred = [], []
    for batch in loader:
        idx = batch.pop("idx").to(device)
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        preds = logits.argmax(-1)
        all_idx = gather(idx)
        all_preds = gather(preds)
        all_labels = gather(batch["labels"])
        for i, p, l in zip(all_idx.tolist(), all_preds.tolist(), all_labels.tolist()):
            if i in seen:  # DistributedSampler repeats a few samples to even out the ranks
                continue
            seen.add(i)
            y_true.append([LABELS[x] for x in l if x != -100])
            y_pred.append([LABELS[x] for x, m in zip(p, l) if m != -100])
    model.train()
    return f1_score(y_true, y_pred), classification_report(y_true, y_pred, digits=4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--model", default="bert-base-cased")
    ap.add_argument("--out", default="ner_out")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--seed", type=int, default=13)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds = NERDataset(os.path.join(args.data_dir, "train.txt"), tok)
    dev_ds = NERDataset(os.path.join(args.data_dir, "valid.txt"), tok)
    collate = Collator(tok)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    dev_sampler = DistributedSampler(dev_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=collate, num_workers=2)
    dev_dl = DataLoader(dev_ds, batch_size=64, sampler=dev_sampler, collate_fn=collate, num_workers=2)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(LABELS), id2label=dict(enumerate(LABELS)), label2id=L2I).to(device)
    model = DDP(model, device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(optim, int(0.1 * total), total)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        loss_acc = torch.zeros(2, device=device)
        for step, batch in enumerate(train_dl):
            batch.pop("idx")
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            loss_acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_acc)
        f1, report = evaluate(model, dev_dl, device)
        if rank == 0:
            print(f"epoch {epoch} train loss {(loss_acc[0] / loss_acc[1]).item():.4f} dev F1 {f1:.4f} ({world} GPUs)")
            print(report)
            if f1 > best:
                best = f1
                model.module.save_pretrained(args.out)
                tok.save_pretrained(args.out)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
