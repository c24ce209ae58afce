#!/usr/bin/env python
"""
LAAT-style ICD-9 coding on MIMIC-III discharge summaries (top-50 / full code sets).
BiLSTM encoder + label-wise attention, multi-label BCE, DDP across the GPUs of one node.

Data is produced by prep/mimic3_to_jsonl.py:
    {train,dev,test}.jsonl  one admission per line: {"hadm_id", "text", "codes"}
    vocab.json              token -> id (0 = pad, 1 = unk)
    codes.json              ordered list of ICD-9 codes
    w2v_100.npy             optional pretrained word2vec matrix aligned with vocab.json
"""
import argparse
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import f1_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("laat")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--output_dir", default="runs/laat_mimic3_50")
    p.add_argument("--max_len", type=int, default=4000)
    p.add_argument("--emb_dim", type=int, default=100)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--att_dim", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--batch_size", type=int, default=8, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--patience", type=int, default=6)
    p.add_argument("--threshold", type=float, default=0.5)
    p.add_argument("--num_workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=2021)
    return p.parse_args()


class NoteDataset(Dataset):
    def __init__(self, path, vocab, code2idx, max_len):
        self.examples = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                ids = [vocab.get(t, 1) for t in ex["text"].split()[:max_len]]
                y = np.zeros(len(code2idx), dtype=np.float32)
                for c in ex["codes"]:
                    if c in code2idx:
                        y[code2idx[c]] = 1.0
                self.examples.append((torch.tensor(ids, dtype=torch.long), torch.from_numpy(y)))

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def collate(batch):
    ids, ys = zip(*batch)
    lengths = torch.tensor([len(x) for x in ids])
    ids = pad_sequence(ids, batch_first=True, padding_value=0)
    return ids, lengths, torch.stack(ys)


class LAAT(nn.Module):
    def __init__(self, vocab_size, num_labels, emb_dim, hidden, att_dim, dropout, pretrained=None):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, emb_dim, padding_idx=0)
        if pretrained is not None:
            self.emb.weight.data.copy_(torch.from_numpy(pretrained))
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(emb_dim, hidden // 2, batch_first=True, bidirectional=True)
        self.W = nn.Linear(hidden, att_dim, bias=False)
        self.U = nn.Linear(att_dim, num_labels, bias=False)
        self.out = nn.Linear(hidden, num_labels)

    def forward(self, ids, lengths):
        x = self.drop(self.emb(ids))
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = self.lstm(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=ids.size(1))
        z = torch.tanh(self.W(h))                      # B x T x d_a
        scores = self.U(z).transpose(1, 2)             # B x L x T
        scores = scores.masked_fill(ids.eq(0).unsqueeze(1), float("-inf"))
        att = F.softmax(scores, dim=-1)
        v = torch.bmm(att, self.drop(h))               # B x L x H
        return (self.out.weight * v).sum(-1) + self.out.bias


def precision_at_k(golds, probs, k):
    topk = np.argsort(-probs, axis=1)[:, :k]
    hits = np.take_along_axis(golds, topk, axis=1).sum(1)
    return float(np.mean(hits / k))


@torch.no_grad()
def evaluate(model, loader, device, threshold):
    model.eval()
    probs, golds = [], []
    for ids, lengths, y in loader:
        logits = model(ids.to(device, non_blocking=True), lengths)
        probs.append(torch.sigmoid(logits).float().cpu().numpy())
        golds.append(y.numpy())
    probs = np.concatenate(probs)
    golds = np.concatenate(golds)
    preds = (probs >= threshold).astype(np.int64)
    out = {
        "micro_f1": f1_score(golds, preds, average="micro", zero_division=0),
        "macro_f1": f1_score(golds, preds, average="macro", zero_division=0),
        "p@5": precision_at_k(golds, probs, 5),
        "p@8": precision_at_k(golds, probs, 8),
    }
    try:
        out["micro_auc"] = roc_auc_score(golds, probs, average="micro")
    except ValueError:
        out["micro_auc"] = float("nan")
    return out


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
    )
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    with open(os.path.join(args.data_dir, "vocab.json")) as f:
        vocab = json.load(f)
    with open(os.path.join(args.data_dir, "codes.json")) as f:
        codes = json.load(f)
    code2idx = {c: i for i, c in enumerate(codes)}
    w2v_path = os.path.join(args.data_dir, f"w2v_{args.emb_dim}.npy")
    pretrained = np.load(w2v_path) if os.path.exists(w2v_path) else None

    train_ds = NoteDataset(os.path.join(args.data_dir, "train.jsonl"), vocab, code2idx, args.max_len)
    dev_ds = NoteDataset(os.path.join(args.data_dir, "dev.jsonl"), vocab, code2idx, args.max_len)
    logger.info("train=%d dev=%d codes=%d vocab=%d", len(train_ds), len(dev_ds), len(codes), len(vocab))

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    dev_sampler = DistributedSampler(dev_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=args.num_workers, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=args.batch_size * 2, sampler=dev_sampler,
                            collate_fn=collate, num_workers=args.num_workers, pin_memory=True)

    model = LAAT(len(vocab), len(codes), args.emb_dim, args.hidden, args.att_dim, args.dropout, pretrained)
    model = DDP(model.to(device), device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.9, patience=5)

    os.makedirs(args.output_dir, exist_ok=True)
    best_f1, bad_epochs = -1.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_sum = torch.zeros(2, device=device)
        for ids, lengths, y in train_loader:
            ids = ids.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            logits = model(ids, lengths)
            loss = F.binary_cross_entropy_with_logits(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            n = float(ids.size(0))
            loss_sum += torch.stack([loss.detach() * n, torch.tensor(n, device=device)])
        dist.all_reduce(loss_sum)
        train_loss = (loss_sum[0] / loss_sum[1]).item()

        metrics = evaluate(model.module, dev_loader, device, args.threshold)
        scheduler.step(metrics["micro_f1"])
        if rank == 0:
            logger.info("epoch %d loss %.4f | dev micro-F1 %.4f macro-F1 %.4f P@5 %.4f AUC %.4f | %.0fs",
                        epoch, train_loss, metrics["micro_f1"], metrics["macro_f1"], metrics["p@5"],
                        metrics["micro_auc"], time.time() - t0)
            if metrics["micro_f1"] > best_f1:
                best_f1, bad_epochs = metrics["micro_f1"], 0
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "codes": codes,
                            "dev": metrics, "args": vars(args)},
                           os.path.join(args.output_dir, "best.pt"))
            else:
                bad_epochs += 1
        stop = torch.tensor(int(bad_epochs >= args.patience), device=device)
        dist.broadcast(stop, src=0)
        if stop.item():
            logger.info("early stopping at epoch %d (best micro-F1 %.4f)", epoch, best_f1)
            break

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
