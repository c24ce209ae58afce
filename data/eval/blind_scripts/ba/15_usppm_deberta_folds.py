# U.S. Patent Phrase to Phrase Matching
# deberta-v3-large cross-encoder: "anchor [SEP] target [SEP] cpc title" -> score, Pearson r
#
# torchrun --nproc_per_node=4 15_usppm_deberta_folds.py --model microsoft/deberta-v3-large --epochs 5
import argparse
import os
import random
import time

import numpy as np
import pandas as pd
import scipy.stats
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.model_selection import StratifiedGroupKFold
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/us-patent-phrase-to-phrase-matching")
    ap.add_argument("--model", default="microsoft/deberta-v3-large")
    ap.add_argument("--out", default="./usppm_debv3l")
    ap.add_argument("--n-folds", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--max-len", type=int, default=96)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def make_folds(df, n_folds):
    df["score_bin"] = (df.score * 4).astype(int)
    sgkf = StratifiedGroupKFold(n_splits=n_folds, shuffle=True)
    df["fold"] = -1
    for f, (_, va) in enumerate(sgkf.split(df, df.score_bin, groups=df.anchor)):
        df.loc[va, "fold"] = f
    return df


def add_context(df, data_dir):
    titles = pd.read_csv(os.path.join(data_dir, "cpc_titles.csv"))
    mapping = dict(zip(titles.code, titles.title.str.lower()))
    df["context_text"] = df.context.map(mapping).fillna("")
    df["text"] = df.anchor + "[SEP]" + df.target + "[SEP]" + df.context_text
    return df


class PhraseDS(Dataset):
    def __init__(self, df, tok, max_len):
        self.texts, self.scores, self.tok, self.max_len = df.text.values, df.score.values.astype(np.float32), tok, max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        enc = self.tok(self.texts[i], max_length=self.max_len, padding="max_length", truncation=True)
        return (torch.tensor(enc["input_ids"]), torch.tensor(enc["attention_mask"]),
                torch.tensor(self.scores[i]), torch.tensor(i))


class CrossEncoder(nn.Module):
    def __init__(self, name):
        super().__init__()
        cfg = AutoConfig.from_pretrained(name)
        self.model = AutoModel.from_pretrained(name, config=cfg)
        self.fc_dropout = nn.Dropout(0.2)
        self.attention = nn.Sequential(nn.Linear(cfg.hidden_size, 512), nn.Tanh(), nn.Linear(512, 1))
        self.fc = nn.Linear(cfg.hidden_size, 1)

    def forward(self, ids, mask):
        h = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        w = torch.softmax(self.attention(h).float().masked_fill(mask.unsqueeze(-1) == 0, -1e4), dim=1)
        feat = torch.sum(w.to(h.dtype) * h, dim=1)
        return self.fc(self.fc_dropout(feat)).squeeze(-1)


@torch.no_grad()
def valid_fn(model, loader, device):
    model.eval()
    ids_all, preds = [], []
    for ids, mask, _, i in loader:
        with torch.cuda.amp.autocast():
            p = torch.sigmoid(model(ids.to(device), mask.to(device)).float())
        preds.append(p.cpu().numpy())
        ids_all.append(i.numpy())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (np.concatenate(ids_all), np.concatenate(preds)))
    out = np.zeros(len(loader.dataset), np.float32)
    for i, p in gathered:
        out[i] = p
    return out


def train_fold(fold, df, tok, args, rank, local_rank):
    seed_everything(args.seed)
    device = torch.device("cuda", local_rank)
    trn, val = df[df.fold != fold].reset_index(drop=True), df[df.fold == fold].reset_index(drop=True)
    trn_ds, val_ds = PhraseDS(trn, tok, args.max_len), PhraseDS(val, tok, args.max_len)
    trn_s = DistributedSampler(trn_ds, shuffle=True, seed=args.seed, drop_last=True)
    trn_dl = DataLoader(trn_ds, batch_size=args.bs, sampler=trn_s, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs * 4, sampler=DistributedSampler(val_ds, shuffle=False), num_workers=4)

    model = CrossEncoder(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, eps=1e-6)
    total = len(trn_dl) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.1 * total), total)
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.BCEWithLogitsLoss()

    best, best_pred = -1.0, None
    for ep in range(args.epochs):
        trn_s.set_epoch(ep)
        model.train()
        t0 = time.time()
        for ids, mask, y, _ in trn_dl:
            with torch.cuda.amp.autocast():
                logits = model(ids.to(device, non_blocking=True), mask.to(device, non_blocking=True))
            loss = crit(logits.float(), y.to(device))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1000)
            scaler.step(opt)
            scaler.update()
            sched.step()
        pred = valid_fn(model.module, val_dl, device)
        r = scipy.stats.pearsonr(val.score.values, pred)[0]
        if r > best:
            best, best_pred = r, pred
            if rank == 0:
                torch.save(model.module.state_dict(), os.path.join(args.out, f"fold{fold}.pth"))
        if rank == 0:
            print(f"fold {fold} epoch {ep} pearson {r:.4f} best {best:.4f} ({time.time() - t0:.0f}s)", flush=True)
        dist.barrier()
    return best, val[["id", "anchor", "target", "context", "score"]].assign(pred=best_pred)


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    df = pd.read_csv(os.path.join(args.data, "train.csv"))
    df = make_folds(df, args.n_folds)
    df = add_context(df, args.data)
    tok = AutoTokenizer.from_pretrained(args.model)
    if rank == 0:
        df.to_csv(os.path.join(args.out, "folds.csv"), index=False)
        print(df.groupby("fold").size())

    scores, oofs = [], []
    for fold in range(args.n_folds):
        s, oof = train_fold(fold, df, tok, args, rank, local_rank)
        scores.append(s)
        oofs.append(oof)
        torch.cuda.empty_cache()
    if rank == 0:
        oof = pd.concat(oofs, ignore_index=True)
        oof.to_csv(os.path.join(args.out, "oof.csv"), index=False)
        print(f"fold pearson {np.round(scores, 4)}  CV {scipy.stats.pearsonr(oof.score, oof.pred)[0]:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
