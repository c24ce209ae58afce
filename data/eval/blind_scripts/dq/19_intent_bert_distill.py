"""
Distil the fine-tuned BERT-base intent classifier into a 4-layer, 312-hidden
student (TinyBERT General_4L_312D init) for the offline voice assistant.

Loss = CE(labels) + KD(logits, T) + hidden-state MSE on mapped layers
(student layer i <- teacher layer 3*i) through a learned 312->768 projection.

The dataset is one CSV export (text,intent); 10% is held out for validation.

    torchrun --nproc_per_node=4 19_intent_bert_distill.py --csv data/intents_2024q2.csv \
        --teacher models/bert-base-intents --student huawei-noah/TinyBERT_General_4L_312D
"""
import argparse
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset, random_split
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


class IntentCSV(Dataset):
    def __init__(self, csv_path, label2id):
        df = pd.read_csv(csv_path)
        df = df[df["intent"].isin(label2id)]
        self.texts = df["text"].astype(str).tolist()
        self.labels = [label2id[i] for i in df["intent"]]

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return self.texts[i], self.labels[i]


class Collate:
    def __init__(self, tokenizer, max_len):
        self.tok, self.max_len = tokenizer, max_len

    def __call__(self, batch):
        texts, labels = zip(*batch)
        enc = self.tok(list(texts), padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        enc["labels"] = torch.tensor(labels)
        return enc


class Student(nn.Module):
    def __init__(self, name, num_labels, teacher_hidden):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.encoder.config.hidden_size
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(h, num_labels)
        self.proj = nn.Linear(h, teacher_hidden)

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                           token_type_ids=token_type_ids, output_hidden_states=True)
        logits = self.classifier(self.dropout(out.last_hidden_state[:, 0]))
        hidden = [self.proj(h) for h in out.hidden_states]  # embeddings + 4 layers
        return logits, hidden


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--teacher", required=True)
    p.add_argument("--student", default="huawei-noah/TinyBERT_General_4L_312D")
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--T", type=float, default=2.0)
    p.add_argument("--w-hidden", type=float, default=1.0)
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default="out/tinybert4_intents")
    return p.parse_args()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits, _ = model(**batch)
        acc[0] += (logits.argmax(-1) == labels).sum()
        acc[1] += labels.numel()
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different dropout masks / shuffles per process
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    teacher = AutoModelForSequenceClassification.from_pretrained(args.teacher)
    teacher.to(device).eval().requires_grad_(False)
    label2id = teacher.config.label2id
    tokenizer = AutoTokenizer.from_pretrained(args.teacher)

    full = IntentCSV(args.csv, label2id)
    n_val = int(len(full) * args.val_frac)
    train_ds, val_ds = random_split(full, [len(full) - n_val, n_val])
    collate = Collate(tokenizer, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, drop_last=True)
    val_shard = Subset(val_ds, range(rank, len(val_ds), world))
    val_loader = DataLoader(val_shard, batch_size=256, shuffle=False, collate_fn=collate, num_workers=2)

    model = Student(args.student, len(label2id), teacher.config.hidden_size).to(device)
    model = DDP(model, device_ids=[local_rank])

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optim = torch.optim.AdamW(groups, lr=args.lr)
    total = args.epochs * len(train_loader)
    sched = get_linear_schedule_with_warmup(optim, int(0.06 * total), total)

    n_s_layers = model.module.encoder.config.num_hidden_layers
    layer_map = {i: i * (teacher.config.num_hidden_layers // n_s_layers) for i in range(n_s_layers + 1)}

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_ds)} / val {len(val_ds)}  layer map {layer_map}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.no_grad():
                t_out = teacher(**batch, output_hidden_states=True)
            s_logits, s_hidden = model(**batch)

            ce = F.cross_entropy(s_logits, labels)
            kd = F.kl_div(F.log_softmax(s_logits / args.T, -1), F.softmax(t_out.logits / args.T, -1),
                          reduction="batchmean") * args.T ** 2
            mask = batch["attention_mask"].unsqueeze(-1).float()
            hid = sum(((s_hidden[i] - t_out.hidden_states[j]) ** 2 * mask).sum() / (mask.sum() * s_hidden[i].size(-1))
                      for i, j in layer_map.items()) / len(layer_map)
            loss = ce + kd + args.w_hidden * hid

            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step} ce {ce.item():.4f} kd {kd.item():.4f} hid {hid.item():.4f}",
                      flush=True)

        acc = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val acc {acc * 100:.2f}", flush=True)
            if acc > best:
                best = acc
                model.module.encoder.save_pretrained(os.path.join(args.out, "best_encoder"))
                torch.save({"classifier": model.module.classifier.state_dict(), "label2id": label2id},
                           os.path.join(args.out, "best_head.pt"))
                tokenizer.save_pretrained(os.path.join(args.out, "best_encoder"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
