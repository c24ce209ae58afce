"""RETAIN for heart-failure onset prediction from outpatient visit sequences.

Reverse-time two-level attention (visit-level alpha, variable-level beta) so that
per-code contributions can be reported to the clinical reviewers each epoch.

    torchrun --nproc_per_node=4 06_retain_hf_onset.py --data /data/hf_onset/seqs.pkl \
        --code_names /data/hf_onset/code_names.json
"""
import argparse
import json
import os
import pickle

import mlflow
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--code_names", required=True)
    ap.add_argument("--save_dir", default="./retain_hf")
    ap.add_argument("--emb", type=int, default=128)
    ap.add_argument("--rnn_hidden", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--l2", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--max_visits", type=int, default=100)
    ap.add_argument("--n_explain", type=int, default=5)
    ap.add_argument("--mlflow_uri", default=os.environ.get("MLFLOW_TRACKING_URI", "file:./mlruns"))
    return ap.parse_args()


class MultiHotVisits(Dataset):
    def __init__(self, seqs, labels, n_codes, max_visits):
        self.seqs, self.labels = seqs, labels
        self.n_codes, self.max_visits = n_codes, max_visits

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        visits = self.seqs[i][-self.max_visits:]
        x = torch.zeros(len(visits), self.n_codes)
        for t, codes in enumerate(visits):
            x[t, codes] = 1.0
        return x, torch.tensor(float(self.labels[i])), i


def pad_collate(batch):
    xs, ys, idx = zip(*batch)
    T = max(x.shape[0] for x in xs)
    out = torch.zeros(len(xs), T, xs[0].shape[1])
    mask = torch.zeros(len(xs), T)
    for i, x in enumerate(xs):
        out[i, : x.shape[0]] = x
        mask[i, : x.shape[0]] = 1.0
    return out, mask, torch.stack(ys), torch.tensor(idx)


class RETAIN(nn.Module):
    def __init__(self, n_codes, emb, hidden, dropout=0.5):
        super().__init__()
        self.embed = nn.Linear(n_codes, emb, bias=False)
        self.rnn_alpha = nn.GRU(emb, hidden, batch_first=True)
        self.rnn_beta = nn.GRU(emb, hidden, batch_first=True)
        self.w_alpha = nn.Linear(hidden, 1)
        self.w_beta = nn.Linear(hidden, emb)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(emb, 1)

    def _attend(self, x, mask):
        v = self.drop(self.embed(x))
        rev = torch.flip(v, dims=[1])
        g, _ = self.rnn_alpha(rev)
        h, _ = self.rnn_beta(rev)
        g, h = torch.flip(g, dims=[1]), torch.flip(h, dims=[1])
        e = self.w_alpha(g).squeeze(-1).masked_fill(mask == 0, -1e9)
        alpha = torch.softmax(e, dim=1)
        beta = torch.tanh(self.w_beta(h))
        return v, alpha, beta

    def forward(self, x, mask):
        v, alpha, beta = self._attend(x, mask)
        c = (alpha.unsqueeze(-1) * beta * v).sum(1)
        return self.out(self.drop(c)).squeeze(-1)

    @torch.no_grad()
    def contributions(self, x, mask):
        """omega[t, j]: contribution of code j at visit t to the logit (RETAIN eq. 7)."""
        _, alpha, beta = self._attend(x, mask)
        W_emb = self.embed.weight  # [emb, n_codes]
        w_out = self.out.weight.squeeze(0)  # [emb]
        scores = alpha.unsqueeze(-1) * ((beta * w_out) @ W_emb)  # [B, T, n_codes]
        return scores * x


def explain(model, dataset, code_names, device, n):
    rows = []
    for i in range(n):
        x, y, _ = dataset[i]
        mask = torch.ones(1, x.shape[0], device=device)
        omega = model.contributions(x.unsqueeze(0).to(device), mask)[0]
        flat = omega.flatten()
        top = torch.topk(flat.abs(), k=min(10, int((flat != 0).sum())))
        items = []
        for k in top.indices.tolist():
            t, j = divmod(k, x.shape[1])
            items.append({"visit": t, "code": code_names[j], "contrib": round(flat[k].item(), 4)})
        rows.append({"patient": i, "label": int(y), "top": items})
    return rows


@torch.no_grad()
def evaluate(model, loader, device, n_total):
    model.eval()
    probs = torch.zeros(n_total, device=device)
    seen = torch.zeros(n_total, device=device)
    labels = torch.zeros(n_total, device=device)
    for x, m, y, idx in loader:
        idx = idx.to(device)
        probs[idx] = torch.sigmoid(model(x.to(device), m.to(device)))
        labels[idx] = y.to(device)
        seen[idx] = 1.0
    # each stay is scored on exactly one rank (duplicates from sampler padding overwrite)
    dist.all_reduce(probs)
    dist.all_reduce(labels)
    dist.all_reduce(seen)
    seen = seen.clamp(min=1.0)
    p, y = (probs / seen).cpu().numpy(), (labels / seen).cpu().numpy()
    return roc_auc_score(y, p), average_precision_score(y, p)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    with open(args.data, "rb") as f:
        d = pickle.load(f)
    with open(args.code_names) as f:
        code_names = json.load(f)
    n_codes = len(code_names)
    train_ds = MultiHotVisits(d["train_seqs"], d["train_labels"], n_codes, args.max_visits)
    val_ds = MultiHotVisits(d["val_seqs"], d["val_labels"], n_codes, args.max_visits)

    train_sampler = DistributedSampler(train_ds)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=pad_collate, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=val_sampler,
                            collate_fn=pad_collate, num_workers=4)

    model = RETAIN(n_codes, args.emb, args.rnn_hidden).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.l2)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        mlflow.set_tracking_uri(args.mlflow_uri)
        mlflow.set_experiment("retain-hf-onset")
        mlflow.start_run()
        mlflow.log_params(vars(args))

    best_auc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        agg = torch.zeros(2, device=device)
        for x, m, y, _ in train_loader:
            x, m, y = x.to(device, non_blocking=True), m.to(device), y.to(device)
            loss = F.binary_cross_entropy_with_logits(model(x, m), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            agg += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        dist.all_reduce(agg)
        auc, ap = evaluate(model, val_loader, device, len(val_ds))

        if rank == 0:
            train_loss = (agg[0] / agg[1]).item()
            print(f"epoch {epoch:02d} loss {train_loss:.4f} val AUROC {auc:.4f} AUPRC {ap:.4f}", flush=True)
            mlflow.log_metrics({"train_loss": train_loss, "val_auroc": auc, "val_auprc": ap}, step=epoch)
            model.eval()
            rows = explain(model, val_ds, code_names, device, args.n_explain)
            with open(os.path.join(args.save_dir, f"explanations_ep{epoch:02d}.json"), "w") as f:
                json.dump(rows, f, indent=1)
            if auc > best_auc:
                best_auc = auc
                torch.save(model.module.state_dict(), os.path.join(args.save_dir, "retain_best.pt"))
                mlflow.log_artifact(os.path.join(args.save_dir, "retain_best.pt"))
        dist.barrier()

    if rank == 0:
        mlflow.log_metric("best_val_auroc", best_auc)
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
