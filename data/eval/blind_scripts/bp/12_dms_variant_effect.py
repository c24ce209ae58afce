"""Supervised variant-effect regression on a deep mutational scan (ProteinGym format).

An ESM-2 encoder embeds the mutant sequence; the mean of the mutated positions' embeddings
minus the wild-type ones goes to a small MLP that regresses DMS_score. Model selection on
validation Spearman; the chosen model is scored once on the held-out fold at the end.

    torchrun --nproc_per_node=4 12_dms_variant_effect.py --csv data/GFP_AEQVI_Sarkisyan_2016.csv \
        --wt_fasta data/GFP_AEQVI.fasta --fold_col fold_random_5
"""
import argparse
import os

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import EsmModel, EsmTokenizer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", required=True)
    p.add_argument("--wt_fasta", required=True)
    p.add_argument("--fold_col", default="fold_random_5")
    p.add_argument("--test_fold", type=int, default=0)
    p.add_argument("--valid_fold", type=int, default=1)
    p.add_argument("--backbone", default="facebook/esm2_t33_650M_UR50D")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--head_lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--out", default="runs/dms")
    return p.parse_args()


def read_wt(path):
    return "".join(l.strip() for l in open(path) if not l.startswith(">"))


class DMSDataset(Dataset):
    def __init__(self, df):
        self.seqs = df["mutated_sequence"].tolist()
        self.positions = [[int(m[1:-1]) for m in ms.split(":")] for ms in df["mutant"]]
        self.y = df["DMS_score"].astype(np.float32).to_numpy()

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i], self.positions[i], self.y[i]


def make_collate(tok):
    def collate(batch):
        seqs, pos, y = zip(*batch)
        enc = tok(list(seqs), return_tensors="pt", padding=True)
        L = enc["input_ids"].shape[1]
        pos_mask = torch.zeros(len(seqs), L)
        for k, ps in enumerate(pos):
            for p in ps:
                pos_mask[k, p] = 1.0  # 1-based residue index == token index because of <cls>
        return enc["input_ids"], enc["attention_mask"], pos_mask, torch.tensor(y)
    return collate


class VariantRegressor(nn.Module):
    def __init__(self, backbone, wt_ids):
        super().__init__()
        self.esm = EsmModel.from_pretrained(backbone, add_pooling_layer=False)
        self.esm.contact_head.requires_grad_(False)
        self.register_buffer("wt_ids", wt_ids, persistent=False)
        h = self.esm.config.hidden_size
        self.head = nn.Sequential(nn.Linear(2 * h, 512), nn.GELU(), nn.Dropout(0.1), nn.Linear(512, 1))

    def forward(self, ids, attn, pos_mask):
        B = ids.shape[0]
        mut = self.esm(input_ids=ids, attention_mask=attn).last_hidden_state
        wt = self.esm(input_ids=self.wt_ids.expand(B, -1), attention_mask=attn).last_hidden_state
        w = pos_mask.unsqueeze(-1) / pos_mask.sum(1, keepdim=True).unsqueeze(-1)
        feat = torch.cat([(mut * w).sum(1), ((mut - wt) * w).sum(1)], dim=-1)
        return self.head(feat).squeeze(-1)


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    preds, ys = [], []
    for ids, attn, pm, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            preds.append(model(ids.to(device), attn.to(device), pm.to(device)).float().cpu())
        ys.append(y)
    model.train()
    return torch.cat(preds).numpy(), torch.cat(ys).numpy()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    df = pd.read_csv(args.csv)
    df = df[~df["mutated_sequence"].str.contains(r"\*")]  # drop nonsense variants
    test_df = df[df[args.fold_col] == args.test_fold].copy()
    valid_df = df[df[args.fold_col] == args.valid_fold].copy()
    train_df = df[~df[args.fold_col].isin([args.test_fold, args.valid_fold])].copy()
    y_mu, y_sd = train_df["DMS_score"].mean(), train_df["DMS_score"].std()
    for d in (train_df, valid_df, test_df):
        d.loc[:, "DMS_score"] = (d["DMS_score"] - y_mu) / y_sd

    tok = EsmTokenizer.from_pretrained(args.backbone)
    wt_ids = tok(read_wt(args.wt_fasta), return_tensors="pt")["input_ids"]
    collate = make_collate(tok)
    train_ds, valid_ds, test_ds = DMSDataset(train_df), DMSDataset(valid_df), DMSDataset(test_df)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=7)
    train_loader = DataLoader(train_ds, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=2,
                              drop_last=True)
    valid_loader = DataLoader(valid_ds, 64, shuffle=False, collate_fn=collate, num_workers=2)
    test_loader = DataLoader(test_ds, 64, shuffle=False, collate_fn=collate, num_workers=2)

    model = VariantRegressor(args.backbone, wt_ids).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW([
        {"params": [p for p in model.module.esm.parameters() if p.requires_grad], "lr": args.lr},
        {"params": model.module.head.parameters(), "lr": args.head_lr},
    ], weight_decay=0.01)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (0.1 * total)))

    os.makedirs(args.out, exist_ok=True)
    best_path = os.path.join(args.out, f"best_fold{args.test_fold}.pt")
    best_rho = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for ids, attn, pm, y in train_loader:
            ids, attn, pm, y = ids.to(device), attn.to(device), pm.to(device), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(ids, attn, pm)
            loss = F.mse_loss(pred.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()

        if rank == 0:
            # the validation fold is small: score it in full on rank 0
            p, y = predict(model.module, valid_loader, device)
            rho = spearmanr(p, y).correlation
            print(f"epoch {epoch} train mse {loss.item():.4f} valid spearman {rho:.4f}", flush=True)
            if rho > best_rho:
                best_rho = rho
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    if rank == 0:
        final = VariantRegressor(args.backbone, wt_ids).to(device)
        final.load_state_dict(torch.load(best_path, map_location=device))
        p, y = predict(final, test_loader, device)
        rho = spearmanr(p, y).correlation
        print(f"test fold {args.test_fold}: spearman {rho:.4f} (best valid {best_rho:.4f})", flush=True)
        pd.DataFrame({"mutant": test_df["mutant"].values, "pred": p * y_sd + y_mu}).to_csv(
            os.path.join(args.out, f"test_preds_fold{args.test_fold}.csv"), index=False)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
