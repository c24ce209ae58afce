"""NBME - Score Clinical Patient Notes: character span prediction as token classification.

roberta-large at max_len 512 does not fit with bs 8 on a 24GB card, hence
gradient checkpointing.  4 x 3090:

    torchrun --nproc_per_node=4 11_nbme_token_cls_gradckpt.py --fold 0
"""
import argparse
import ast
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup


class CFG:
    model = "roberta-large"
    max_len = 512
    batch_size = 8
    epochs = 5
    encoder_lr = 2e-5
    decoder_lr = 2e-5
    weight_decay = 0.01
    warmup = 0.1
    grad_ckpt = True
    data = "input/nbme_train_merged.csv"
    out = "out"


def parse_spans(loc_list):
    spans = []
    for loc in loc_list:
        for part in loc.split(";"):
            s, e = part.split()
            spans.append((int(s), int(e)))
    return spans


class NBMEDataset(Dataset):
    def __init__(self, df, tokenizer):
        self.df = df.reset_index(drop=True)
        self.tok = tokenizer

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        enc = self.tok(r.pn_history, r.feature_text, max_length=CFG.max_len, padding="max_length",
                       truncation="only_first", return_offsets_mapping=True)
        offsets = enc.pop("offset_mapping")
        seq_ids = enc.sequence_ids()
        labels = np.full(len(offsets), -100.0, dtype=np.float32)
        spans = parse_spans(ast.literal_eval(r.location))
        for t, ((s, e), sid) in enumerate(zip(offsets, seq_ids)):
            if sid != 0:
                continue
            labels[t] = 0.0
            for a, b in spans:
                if s < b and e > a:
                    labels[t] = 1.0
        return {k: torch.tensor(v) for k, v in enc.items()}, torch.from_numpy(labels)


class SpanModel(nn.Module):
    def __init__(self, name, grad_ckpt):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(name)
        if grad_ckpt:
            self.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        hid = self.backbone.config.hidden_size
        self.dropouts = nn.ModuleList([nn.Dropout(0.1 * (i + 1)) for i in range(5)])
        self.fc = nn.Linear(hid, 1)

    def forward(self, input_ids, attention_mask):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # multi-sample dropout
        return torch.stack([self.fc(d(h)) for d in self.dropouts]).mean(0).squeeze(-1)


def param_groups(model):
    no_decay = ("bias", "LayerNorm.bias", "LayerNorm.weight")
    groups = []
    for n, p in model.backbone.named_parameters():
        wd = 0.0 if any(nd in n for nd in no_decay) else CFG.weight_decay
        groups.append({"params": [p], "lr": CFG.encoder_lr, "weight_decay": wd})
    groups.append({"params": list(model.fc.parameters()), "lr": CFG.decoder_lr, "weight_decay": 0.0})
    return groups


@torch.no_grad()
def token_f1_stats(model, loader, device):
    model.eval()
    tp = fp = fn = 0.0
    for enc, labels in loader:
        enc = {k: v.to(device) for k, v in enc.items()}
        labels = labels.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = torch.sigmoid(model(enc["input_ids"], enc["attention_mask"]).float()) > 0.5
        valid = labels != -100
        gold = labels == 1
        tp += (pred & gold & valid).sum().item()
        fp += (pred & ~gold & valid).sum().item()
        fn += (~pred & gold & valid).sum().item()
    return torch.tensor([tp, fp, fn], device=device, dtype=torch.float64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fold", type=int, default=0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(42)

    df = pd.read_csv(CFG.data)
    tokenizer = AutoTokenizer.from_pretrained(CFG.model)
    tr_ds = NBMEDataset(df[df.fold != args.fold], tokenizer)
    va_ds = NBMEDataset(df[df.fold == args.fold], tokenizer)
    sampler = DistributedSampler(tr_ds, shuffle=True, drop_last=True)
    tr_dl = DataLoader(tr_ds, batch_size=CFG.batch_size, sampler=sampler, num_workers=4,
                       pin_memory=True, drop_last=True)
    va_dl = DataLoader(Subset(va_ds, range(rank, len(va_ds), world)), batch_size=CFG.batch_size * 4,
                       num_workers=4)

    model = SpanModel(CFG.model, CFG.grad_ckpt).to(device)
    optimizer = torch.optim.AdamW(param_groups(model), lr=CFG.encoder_lr)
    # roberta's pooler is never used (we read last_hidden_state), so its params get no grad
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    steps = len(tr_dl) * CFG.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(CFG.warmup * steps), steps)
    scaler = torch.cuda.amp.GradScaler()
    bce = nn.BCEWithLogitsLoss(reduction="none")
    best_f1 = 0.0

    for epoch in range(CFG.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (enc, labels) in enumerate(tr_dl):
            enc = {k: v.to(device, non_blocking=True) for k, v in enc.items()}
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(enc["input_ids"], enc["attention_mask"]).float()
            loss = bce(logits, labels.clamp(min=0))
            loss = loss[labels != -100].mean()
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and step % 200 == 0:
                print(f"[ep {epoch}] {step}/{len(tr_dl)} loss={loss.item():.4f}", flush=True)

        stats = token_f1_stats(model.module, va_dl, device)
        dist.all_reduce(stats)
        tp, fp, fn = stats.tolist()
        f1 = 2 * tp / max(2 * tp + fp + fn, 1.0)
        if rank == 0:
            print(f"epoch {epoch} token-F1 {f1:.4f}", flush=True)
            if f1 > best_f1:
                best_f1 = f1
                os.makedirs(CFG.out, exist_ok=True)
                torch.save(model.module.state_dict(), f"{CFG.out}/{CFG.model.split('/')[-1]}_fold{args.fold}.pth")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
