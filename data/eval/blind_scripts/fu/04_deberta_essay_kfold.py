"""Essay scoring (6 analytic targets) with DeBERTa-v3, 4-fold MultilabelStratifiedKFold.

    torchrun --nproc_per_node=4 04_deberta_essay_kfold.py --model microsoft/deberta-v3-base --out runs/dv3b
"""
import argparse
import gc
import math
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from iterstrat.ml_stratifiers import MultilabelStratifiedKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModel, AutoTokenizer, DataCollatorWithPadding, get_cosine_schedule_with_warmup

TARGETS = ["cohesion", "syntax", "vocabulary", "phraseology", "grammar", "conventions"]


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", default="data/train.csv")
    ap.add_argument("--model", default="microsoft/deberta-v3-base")
    ap.add_argument("--out", default="runs/dv3b")
    ap.add_argument("--folds", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--encoder-lr", type=float, default=2e-5)
    ap.add_argument("--head-lr", type=float, default=5e-4)
    ap.add_argument("--llrd", type=float, default=0.9, help="layer-wise lr decay")
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


class EssayDataset(Dataset):
    def __init__(self, df, tok, max_len):
        self.texts = df["full_text"].str.replace("\n\n", " [PARA] ").tolist()
        self.y = df[TARGETS].to_numpy(np.float32)
        self.rows = df.index.to_numpy()
        self.tok = tok
        self.max_len = max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        enc = self.tok(self.texts[i], truncation=True, max_length=self.max_len)
        enc["labels"] = self.y[i]
        enc["row"] = self.rows[i]
        return enc


class MeanPool(nn.Module):
    def forward(self, h, mask):
        m = mask.unsqueeze(-1).float()
        return (h * m).sum(1) / m.sum(1).clamp(min=1e-6)


class EssayModel(nn.Module):
    def __init__(self, name, vocab_size):
        super().__init__()
        cfg = AutoConfig.from_pretrained(name)
        cfg.hidden_dropout_prob = 0.0
        cfg.attention_probs_dropout_prob = 0.0
        self.backbone = AutoModel.from_pretrained(name, config=cfg)
        self.backbone.resize_token_embeddings(vocab_size)
        self.pool = MeanPool()
        self.head = nn.Linear(cfg.hidden_size, len(TARGETS))

    def forward(self, input_ids, attention_mask):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(self.pool(h, attention_mask))

    def optimizer_groups(self, encoder_lr, head_lr, llrd, wd):
        no_decay = ("bias", "LayerNorm.weight", "LayerNorm.bias")
        layers = [self.backbone.embeddings] + list(self.backbone.encoder.layer)
        groups = []
        lr = encoder_lr
        for layer in reversed(layers):
            groups.append({"params": [p for n, p in layer.named_parameters() if not any(nd in n for nd in no_decay)],
                           "lr": lr, "weight_decay": wd})
            groups.append({"params": [p for n, p in layer.named_parameters() if any(nd in n for nd in no_decay)],
                           "lr": lr, "weight_decay": 0.0})
            lr *= llrd
        rest = [p for n, p in self.backbone.named_parameters()
                if not n.startswith("embeddings.") and not n.startswith("encoder.layer.")]
        groups.append({"params": rest, "lr": encoder_lr, "weight_decay": 0.0})
        groups.append({"params": list(self.head.parameters()), "lr": head_lr, "weight_decay": 0.0})
        return groups


def mcrmse(y, p):
    return float(np.mean(np.sqrt(np.mean((y - p) ** 2, axis=0))))


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    rows, preds = [], []
    for b in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(b["input_ids"].to(device), b["attention_mask"].to(device))
        preds.append(out.float().cpu().numpy())
        rows.append(b["row"].numpy())
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (np.concatenate(rows), np.concatenate(preds)))
    rows = np.concatenate([g[0] for g in gathered])
    preds = np.concatenate([g[1] for g in gathered])
    rows, first = np.unique(rows, return_index=True)
    model.train()
    return rows, preds[first]


def run_fold(fold, df, tok, args, rank, local_rank, world_size):
    device = torch.device("cuda", local_rank)
    tr_ds = EssayDataset(df[df.fold != fold], tok, args.max_len)
    va_ds = EssayDataset(df[df.fold == fold], tok, args.max_len)
    collate = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    tr_sampler = DistributedSampler(tr_ds, shuffle=True, seed=args.seed)
    va_sampler = DistributedSampler(va_ds, shuffle=False)
    tr_dl = DataLoader(tr_ds, batch_size=args.bs, sampler=tr_sampler, collate_fn=collate, num_workers=4,
                       drop_last=True, pin_memory=True)
    va_dl = DataLoader(va_ds, batch_size=args.bs * 4, sampler=va_sampler, collate_fn=collate, num_workers=4)

    model = EssayModel(args.model, len(tok)).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.optimizer_groups(args.encoder_lr, args.head_lr, args.llrd, args.wd),
                                  lr=args.encoder_lr, eps=1e-6, betas=(0.9, 0.999))
    num_steps = args.epochs * len(tr_dl)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup * num_steps), num_steps)
    loss_fn = nn.SmoothL1Loss(beta=0.5)

    best, best_pred = math.inf, None
    step = 0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for b in tr_dl:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(b["input_ids"].to(device), b["attention_mask"].to(device))
                loss = loss_fn(out.float(), b["labels"].to(device))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % args.eval_every == 0 or step == num_steps:
                rows, pred = evaluate(model, va_dl, device, world_size)
                score = mcrmse(df.loc[rows, TARGETS].to_numpy(), pred)
                if rank == 0:
                    print(f"fold {fold} ep {epoch} step {step}/{num_steps} loss {loss.item():.4f} "
                          f"MCRMSE {score:.4f} elapsed {time.time() - t0:.0f}s", flush=True)
                if score < best:
                    best, best_pred = score, (rows, pred)
                    if rank == 0:
                        torch.save(model.module.state_dict(), os.path.join(args.out, f"fold{fold}.bin"))
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return best, best_pred


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)

    df = pd.read_csv(args.train_csv).reset_index(drop=True)
    mskf = MultilabelStratifiedKFold(n_splits=args.folds, shuffle=True, random_state=args.seed)
    df["fold"] = -1
    for f, (_, va) in enumerate(mskf.split(df, df[TARGETS])):
        df.loc[va, "fold"] = f

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.add_tokens(["[PARA]"], special_tokens=False)
    if rank == 0:
        tok.save_pretrained(os.path.join(args.out, "tokenizer"))

    oof = np.zeros((len(df), len(TARGETS)), dtype=np.float32)
    for fold in range(args.folds):
        score, (rows, pred) = run_fold(fold, df, tok, args, rank, local_rank, world_size)
        oof[rows] = pred
        if rank == 0:
            print(f"==> fold {fold} best MCRMSE {score:.4f}", flush=True)

    if rank == 0:
        print(f"CV MCRMSE {mcrmse(df[TARGETS].to_numpy(), oof):.4f}")
        df[[f"pred_{t}" for t in TARGETS]] = oof
        df.drop(columns=["full_text"]).to_csv(os.path.join(args.out, "oof.csv"), index=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
