"""
Fine-tune a CheXbert-style report labeler (BERT + 14 linear heads) on radiologist-annotated
reports from our PACS export. Heads 0..12: blank / positive / negative / uncertain,
head 13 (No Finding): blank / positive.

    torchrun --nproc_per_node=4 05_chexbert_labeler_finetune.py \
        --train data/labeler/train.csv --dev data/labeler/dev.csv --test data/labeler/test.csv
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, BertModel, get_linear_schedule_with_warmup

CONDITIONS = [
    "Enlarged Cardiomediastinum", "Cardiomegaly", "Lung Opacity", "Lung Lesion", "Edema",
    "Consolidation", "Pneumonia", "Atelectasis", "Pneumothorax", "Pleural Effusion",
    "Pleural Other", "Fracture", "Support Devices", "No Finding",
]
# csv encoding: empty = blank, 1 = positive, 0 = negative, -1 = uncertain
CSV_TO_CLASS = {1.0: 1, 0.0: 2, -1.0: 3}


class ReportDataset(Dataset):
    def __init__(self, csv_path, tokenizer, max_len=512):
        df = pd.read_csv(csv_path)
        self.texts = df["Report Impression"].fillna("").astype(str).tolist()
        y = np.zeros((len(df), len(CONDITIONS)), dtype=np.int64)
        for j, c in enumerate(CONDITIONS):
            y[:, j] = [CSV_TO_CLASS.get(v, 0) for v in df[c].tolist()]
        y[:, -1] = np.clip(y[:, -1], 0, 1)  # No Finding has no negative / uncertain
        self.labels = y
        self.tokenizer = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        enc = self.tokenizer(self.texts[i].strip().replace("\n", " "), truncation=True,
                             max_length=self.max_len, padding="max_length", return_tensors="pt")
        return enc["input_ids"][0], enc["attention_mask"][0], torch.from_numpy(self.labels[i])


class CheXbertLabeler(nn.Module):
    def __init__(self, bert_name, p_drop=0.1):
        super().__init__()
        self.bert = BertModel.from_pretrained(bert_name, add_pooling_layer=False)
        hidden = self.bert.config.hidden_size
        self.dropout = nn.Dropout(p_drop)
        self.heads = nn.ModuleList([nn.Linear(hidden, 4) for _ in range(13)] + [nn.Linear(hidden, 2)])

    def forward(self, input_ids, attention_mask):
        cls = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        cls = self.dropout(cls)
        return [head(cls) for head in self.heads]


def multihead_loss(outputs, labels, weights=None):
    ce = nn.functional.cross_entropy
    losses = [ce(out, labels[:, j], weight=None if weights is None else weights[j])
              for j, out in enumerate(outputs)]
    return torch.stack(losses).mean()


@torch.no_grad()
def evaluate(model, loader, device):
    """Weighted F1 per condition (positive+uncertain mention detection, as in the CheXbert paper)."""
    model.eval()
    preds = [[] for _ in CONDITIONS]
    golds = [[] for _ in CONDITIONS]
    for ids, mask, labels in loader:
        outs = model(ids.to(device), mask.to(device))
        for j, o in enumerate(outs):
            preds[j].append(o.argmax(-1).cpu())
            golds[j].append(labels[:, j])
    scores = {}
    for j, c in enumerate(CONDITIONS):
        p = torch.cat(preds[j]).numpy()
        g = torch.cat(golds[j]).numpy()
        scores[c] = f1_score(g, p, average="weighted")
    model.train()
    return scores


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--dev", required=True)
    parser.add_argument("--test", required=True)
    parser.add_argument("--bert", default="bert-base-uncased")
    parser.add_argument("--output-dir", default="models/chexbert_local")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--max-len", type=int, default=512)
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained(args.bert)
    train_set = ReportDataset(args.train, tokenizer, args.max_len)
    dev_set = ReportDataset(args.dev, tokenizer, args.max_len)
    sampler = DistributedSampler(train_set, shuffle=True, seed=42)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                              pin_memory=True)
    dev_loader = DataLoader(dev_set, batch_size=64, shuffle=False, num_workers=4)

    model = CheXbertLabeler(args.bert).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)

    os.makedirs(args.output_dir, exist_ok=True)
    best_path = os.path.join(args.output_dir, "chexbert_best.pth")
    best_f1 = -1.0

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        start = time.time()
        for step, (ids, mask, labels) in enumerate(train_loader):
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            outputs = model(ids, mask)
            loss = multihead_loss(outputs, labels)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

        # dev set is a few hundred reports, score it on rank 0 only
        if rank == 0:
            scores = evaluate(model.module, dev_loader, device)
            mean_f1 = float(np.mean(list(scores.values())))
            print(f"epoch {epoch} dev weighted-F1 {mean_f1:.4f} ({time.time() - start:.0f}s)")
            for c, s in scores.items():
                print(f"   {c:28s} {s:.4f}")
            if mean_f1 > best_f1:
                best_f1 = mean_f1
                torch.save(model.state_dict(), best_path)
                print(f"saved {best_path}")
        dist.barrier()

    if rank == 0:
        # final numbers on the held-out test reports with the best dev checkpoint
        test_set = ReportDataset(args.test, tokenizer, args.max_len)
        test_loader = DataLoader(test_set, batch_size=64, shuffle=False, num_workers=4)
        labeler = CheXbertLabeler(args.bert)
        labeler.load_state_dict(torch.load(best_path, map_location="cpu"))
        labeler.to(device)
        scores = evaluate(labeler, test_loader, device)
        print("TEST weighted-F1 mean %.4f" % np.mean(list(scores.values())))
        pd.Series(scores).to_csv(os.path.join(args.output_dir, "test_f1.csv"))
        tokenizer.save_pretrained(args.output_dir)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
