"""
K-fold essay scoring (DeBERTa-v3-base regression head) with DDP.
Per fold: train, validate every epoch (QWK on rounded predictions), keep best weights,
then reload the best weights and write out-of-fold predictions. Rank 0 writes oof.csv.

    torchrun --nproc_per_node=4 19_kfold_essay_oof.py --csv data/train_folds.csv --folds 5
"""
import argparse
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import cohen_kappa_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True, help="columns: essay_id, full_text, score, fold")
    p.add_argument("--backbone", default="microsoft/deberta-v3-base")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--head-lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--out", default="oof_runs/deberta_base")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class EssayDataset(Dataset):
    def __init__(self, df, tok, max_len):
        self.texts = df["full_text"].tolist()
        self.scores = df["score"].astype(np.float32).tolist()
        self.rows = df.index.tolist()
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        enc = self.tok(self.texts[i], truncation=True, max_length=self.max_len)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                "score": self.scores[i], "row": self.rows[i]}


class PadCollate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        L = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for i, b in enumerate(batch):
            ids[i, : len(b["input_ids"])] = torch.tensor(b["input_ids"])
            mask[i, : len(b["attention_mask"])] = 1
        return (ids, mask, torch.tensor([b["score"] for b in batch]),
                torch.tensor([b["row"] for b in batch]))


class EssayScorer(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        cfg = AutoConfig.from_pretrained(backbone)
        cfg.hidden_dropout_prob = 0.0
        cfg.attention_probs_dropout_prob = 0.0
        self.backbone = AutoModel.from_pretrained(backbone, config=cfg)
        self.head = nn.Linear(cfg.hidden_size, 1)

    def forward(self, ids, mask):
        h = self.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1)).squeeze(-1)


@torch.no_grad()
def predict(model, loader, device, world_size):
    model.eval()
    rows, preds = [], []
    for ids, mask, _, row in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids.to(device), mask.to(device))
        preds.append(out.float())
        rows.append(row.to(device))
    local = torch.stack([torch.cat(rows).float(), torch.cat(preds)])
    bufs = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(bufs, local)
    allv = torch.cat(bufs, dim=1).cpu().numpy()
    uniq, first = np.unique(allv[0].astype(np.int64), return_index=True)  # drop sampler padding
    return uniq, allv[1, first]


def qwk(y_true, y_pred):
    return cohen_kappa_score(y_true.astype(int), np.clip(np.rint(y_pred), 1, 6).astype(int), weights="quadratic")


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    df = pd.read_csv(args.csv).reset_index(drop=True)
    tok = AutoTokenizer.from_pretrained(args.backbone)
    collate = PadCollate(tok.pad_token_id)
    oof = np.zeros(len(df), dtype=np.float32)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for fold in range(args.folds):
        torch.manual_seed(args.seed + fold)
        tr_df, va_df = df[df.fold != fold], df[df.fold == fold]
        tr_set, va_set = EssayDataset(tr_df, tok, args.max_len), EssayDataset(va_df, tok, args.max_len)
        tr_sampler = DistributedSampler(tr_set, shuffle=True, seed=args.seed)
        va_sampler = DistributedSampler(va_set, shuffle=False)
        tr_loader = DataLoader(tr_set, batch_size=args.batch_size, sampler=tr_sampler, collate_fn=collate,
                               num_workers=4, drop_last=True)
        va_loader = DataLoader(va_set, batch_size=args.batch_size * 4, sampler=va_sampler, collate_fn=collate,
                               num_workers=4)

        model = EssayScorer(args.backbone).to(device)
        model = DDP(model, device_ids=[local_rank])
        optimizer = torch.optim.AdamW([
            {"params": model.module.backbone.parameters(), "lr": args.lr},
            {"params": model.module.head.parameters(), "lr": args.head_lr},
        ], weight_decay=0.01)
        steps = len(tr_loader) * args.epochs
        scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.1 * steps), steps)
        ckpt_path = os.path.join(args.out, f"fold{fold}.pt")

        best = -1.0
        for epoch in range(args.epochs):
            tr_sampler.set_epoch(epoch)
            model.train()
            t0 = time.time()
            for ids, mask, y, _ in tr_loader:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model(ids.to(device), mask.to(device))
                loss = nn.functional.mse_loss(pred.float(), y.to(device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()

            rows, preds = predict(model.module, va_loader, device, world_size)
            score = qwk(df.loc[rows, "score"].to_numpy(), preds)
            if rank == 0:
                print(f"fold {fold} epoch {epoch}: val QWK {score:.4f} "
                      f"RMSE {np.sqrt(np.mean((df.loc[rows, 'score'].to_numpy() - preds) ** 2)):.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
                if score > best:
                    best = score
                    torch.save(model.state_dict(), ckpt_path)
            dist.barrier()

        # reload the best epoch of this fold for the out-of-fold predictions
        net = EssayScorer(args.backbone)
        net.load_state_dict(torch.load(ckpt_path, map_location="cpu"))
        net.to(device)
        rows, preds = predict(net, va_loader, device, world_size)
        oof[rows] = preds
        if rank == 0:
            print(f"fold {fold}: best-epoch OOF QWK {qwk(df.loc[rows, 'score'].to_numpy(), preds):.4f}", flush=True)
        del model, net, optimizer
        torch.cuda.empty_cache()

    if rank == 0:
        df["oof_pred"] = oof
        df[["essay_id", "score", "fold", "oof_pred"]].to_csv(os.path.join(args.out, "oof.csv"), index=False)
        print(f"overall OOF QWK: {qwk(df['score'].to_numpy(), oof):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
