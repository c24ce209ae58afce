"""Named-entity recognition on the contracts corpus (BIO tags), RoBERTa encoder.

CoNLL-style input: one token and tag per line, blank line between sentences.

    accelerate launch --multi_gpu --num_processes 4 16_ner_token_classifier.py \
        --train data/contracts.train.conll --dev data/contracts.dev.conll --out runs/contracts_ner
"""
import argparse
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import set_seed
from seqeval.metrics import classification_report, f1_score
from torch.utils.data import DataLoader, Dataset
from transformers import (
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    get_linear_schedule_with_warmup,
)


def read_conll(path):
    sentences, tokens, tags = [], [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                if tokens:
                    sentences.append((tokens, tags))
                    tokens, tags = [], []
                continue
            tok, tag = line.split()[0], line.split()[-1]
            tokens.append(tok)
            tags.append(tag)
    if tokens:
        sentences.append((tokens, tags))
    return sentences


class NerDataset(Dataset):
    def __init__(self, sentences, tokenizer, label2id, max_length):
        self.features = []
        for words, tags in sentences:
            enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_length)
            labels, prev = [], None
            for wid in enc.word_ids():
                if wid is None or wid == prev:
                    labels.append(-100)
                else:
                    labels.append(label2id[tags[wid]])
                prev = wid
            enc["labels"] = labels
            self.features.append(dict(enc))

    def __len__(self):
        return len(self.features)

    def __getitem__(self, i):
        return self.features[i]


def gather_padded(tensor):
    """Collect a [batch, seq] tensor from every rank."""
    world = dist.get_world_size()
    out = [torch.zeros_like(tensor) for _ in range(world)]
    dist.all_gather(out, tensor.contiguous())
    return torch.cat(out, dim=0)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--model", default="roberta-base")
    ap.add_argument("--out", default="runs/contracts_ner")
    ap.add_argument("--max_length", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--seed", type=int, default=8)
    return ap.parse_args()


def main():
    args = parse_args()
    accelerator = Accelerator(mixed_precision="bf16")
    set_seed(args.seed)

    train_sents, dev_sents = read_conll(args.train), read_conll(args.dev)
    label_list = sorted({t for _, tags in train_sents + dev_sents for t in tags})
    label2id = {l: i for i, l in enumerate(label_list)}
    id2label = {i: l for l, i in label2id.items()}

    tokenizer = AutoTokenizer.from_pretrained(args.model, add_prefix_space=True)
    train_ds = NerDataset(train_sents, tokenizer, label2id, args.max_length)
    dev_ds = NerDataset(dev_sents, tokenizer, label2id, args.max_length)
    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collator)
    dev_loader = DataLoader(dev_ds, batch_size=32, shuffle=False, collate_fn=collator)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(label_list), id2label=id2label, label2id=label2id
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    num_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * num_steps), num_steps)
    model, optimizer, train_loader, dev_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, dev_loader, scheduler
    )

    best_f1 = -1.0
    for epoch in range(args.epochs):
        model.train()
        total = torch.zeros((), device=accelerator.device)
        for batch in train_loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            total += loss.detach()
        epoch_loss = accelerator.reduce(total, reduction="mean").item() / len(train_loader)

        model.eval()
        y_true, y_pred = [], []
        for batch in dev_loader:
            with torch.no_grad():
                logits = model(**batch).logits
            preds = logits.argmax(dim=-1)
            preds = gather_padded(preds)
            labels = gather_padded(batch["labels"])
            for p_row, l_row in zip(preds.tolist(), labels.tolist()):
                y_true.append([id2label[l] for l in l_row if l != -100])
                y_pred.append([id2label[p] for p, l in zip(p_row, l_row) if l != -100])
        f1 = f1_score(y_true, y_pred)
        accelerator.print(f"epoch {epoch}: train loss {epoch_loss:.4f} dev entity F1 {f1:.4f}")

        accelerator.wait_for_everyone()
        if f1 > best_f1:
            best_f1 = f1
            accelerator.unwrap_model(model).save_pretrained(
                os.path.join(args.out, "best"), is_main_process=accelerator.is_main_process,
                save_function=accelerator.save,
            )
            if accelerator.is_main_process:
                tokenizer.save_pretrained(os.path.join(args.out, "best"))
                with open(os.path.join(args.out, "dev_report.txt"), "w") as f:
                    f.write(classification_report(y_true, y_pred, digits=4))

    accelerator.print(f"best dev F1 {best_f1:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
