"""Clinical NER (BiLSTM-CRF) - medication / dosage / frequency extraction.

Data is CoNLL-style JSONL: {"tokens": [...], "tags": [...]} per line, with a
fixed vocabulary file produced by prepare_vocab.py.

    torchrun --nproc_per_node=4 06_clinical_ner_crf.py --data-dir data/med_ner --epochs 40
"""
import argparse
import json
import logging
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchcrf import CRF
from tqdm import tqdm

logger = logging.getLogger("med-ner")


# ----------------------------------------------------------------------------- data
class JsonlNerDataset(Dataset):
    def __init__(self, path, word2id, tag2id, lowercase=True):
        self.items = []
        unk = word2id["<unk>"]
        with open(path) as fh:
            for line in fh:
                ex = json.loads(line)
                toks = [t.lower() if lowercase else t for t in ex["tokens"]]
                self.items.append((torch.tensor([word2id.get(t, unk) for t in toks]),
                                   torch.tensor([tag2id[t] for t in ex["tags"]])))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def pad_collate(batch):
    toks, tags = zip(*batch)
    toks = pad_sequence(toks, batch_first=True, padding_value=0)
    tags = pad_sequence(tags, batch_first=True, padding_value=0)
    return {"tokens": toks, "tags": tags, "mask": toks != 0}


def bio_spans(seq, id2tag):
    spans, start, label = set(), None, None
    for i, t in enumerate(list(seq) + [None]):
        tag = "O" if t is None else id2tag[t]
        continues = tag.startswith("I-") and start is not None and tag[2:] == label
        if start is not None and not continues:
            spans.add((start, i, label))
            start, label = None, None
        if tag.startswith("B-") or (tag.startswith("I-") and start is None):
            start, label = i, tag[2:]
    return spans


# ----------------------------------------------------------------------------- model
class BiLstmCrfTagger(nn.Module):
    def __init__(self, vocab_size, num_tags, emb_dim=200, hidden=400, layers=2, dropout=0.33):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, emb_dim, padding_idx=0)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(emb_dim, hidden // 2, num_layers=layers, bidirectional=True,
                            batch_first=True, dropout=dropout)
        self.proj = nn.Linear(hidden, num_tags)
        self.crf = CRF(num_tags, batch_first=True)

    def emissions(self, tokens):
        h, _ = self.lstm(self.drop(self.emb(tokens)))
        return self.proj(self.drop(h))

    def forward(self, tokens, tags, mask):
        return -self.crf(self.emissions(tokens), tags, mask=mask, reduction="mean")

    @torch.no_grad()
    def validation_step(self, batch):
        em = self.emissions(batch["tokens"])
        loss = -self.crf(em, batch["tags"], mask=batch["mask"], reduction="sum")
        return loss, self.crf.decode(em, mask=batch["mask"])


# ----------------------------------------------------------------------------- callbacks
class Callback:
    def on_epoch_end(self, trainer, logs): pass


class EarlyStopping(Callback):
    def __init__(self, monitor="val_f1", patience=5):
        self.monitor, self.patience, self.best, self.bad = monitor, patience, -1.0, 0

    def on_epoch_end(self, trainer, logs):
        if logs[self.monitor] > self.best:
            self.best, self.bad = logs[self.monitor], 0
        else:
            self.bad += 1
            if self.bad >= self.patience:
                trainer.stop = True


class ModelCheckpoint(Callback):
    def __init__(self, out_dir, monitor="val_f1"):
        self.out, self.monitor, self.best = Path(out_dir), monitor, -1.0

    def on_epoch_end(self, trainer, logs):
        if trainer.rank == 0 and logs[self.monitor] > self.best:
            self.best = logs[self.monitor]
            self.out.mkdir(parents=True, exist_ok=True)
            torch.save(trainer.raw_model.state_dict(), self.out / "best_model.pt")
            (self.out / "best_metrics.json").write_text(json.dumps(logs, indent=2))


class LRMonitor(Callback):
    def on_epoch_end(self, trainer, logs):
        logs["lr"] = trainer.optimizer.param_groups[0]["lr"]


# ----------------------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, model, optimizer, scheduler, device, id2tag, callbacks, clip=5.0):
        self.device = device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        model.to(device)
        self.model = DDP(model, device_ids=[device.index]) if dist.is_initialized() else model
        self.optimizer, self.scheduler = optimizer, scheduler
        self.id2tag, self.callbacks, self.clip = id2tag, callbacks, clip
        self.stop = False

    @property
    def raw_model(self):
        return self.model.module if isinstance(self.model, DDP) else self.model

    def _to(self, batch):
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def train_epoch(self, loader, epoch):
        self.model.train()
        loader.sampler.set_epoch(epoch)
        total = torch.zeros(2, device=self.device)
        for batch in tqdm(loader, disable=self.rank != 0, desc=f"epoch {epoch}", leave=False):
            batch = self._to(batch)
            loss = self.model(**batch)
            self.optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.optimizer.step()
            total += torch.stack([loss.detach() * batch["tokens"].size(0),
                                  torch.tensor(float(batch["tokens"].size(0)), device=self.device)])
        if dist.is_initialized():
            dist.all_reduce(total)
        return {"train_loss": (total[0] / total[1]).item()}

    def evaluate(self, loader):
        self.model.eval()
        stats = torch.zeros(5, dtype=torch.float64, device=self.device)  # loss, n_sent, tp, n_pred, n_gold
        for batch in loader:
            batch = self._to(batch)
            loss, paths = self.model.validation_step(batch)
            gold = [t[:m.sum()].tolist() for t, m in zip(batch["tags"], batch["mask"])]
            tp = n_pred = n_gold = 0
            for p, g in zip(paths, gold):
                ps, gs = bio_spans(p, self.id2tag), bio_spans(g, self.id2tag)
                tp += len(ps & gs)
                n_pred += len(ps)
                n_gold += len(gs)
            stats += torch.tensor([loss.item(), len(paths), tp, n_pred, n_gold],
                                  dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(stats)
        loss, n, tp, n_pred, n_gold = stats.tolist()
        p = tp / max(n_pred, 1)
        r = tp / max(n_gold, 1)
        return {"val_loss": loss / max(n, 1), "val_p": p, "val_r": r,
                "val_f1": 2 * p * r / max(p + r, 1e-12)}

    def fit(self, train_loader, val_loader, epochs):
        for epoch in range(epochs):
            logs = self.train_epoch(train_loader, epoch)
            logs.update(self.evaluate(val_loader))
            self.scheduler.step(logs["val_f1"])
            for cb in self.callbacks:
                cb.on_epoch_end(self, logs)
            if self.rank == 0:
                logger.info("epoch %d %s", epoch, " ".join(f"{k}={v:.4f}" for k, v in logs.items()))
            if self.stop:
                break


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--patience", type=int, default=6)
    ap.add_argument("--out", default="runs/med_ner")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    device = torch.device("cuda", local_rank)

    data = Path(args.data_dir)
    word2id = json.loads((data / "vocab.json").read_text())
    tags = json.loads((data / "tags.json").read_text())
    tag2id = {t: i for i, t in enumerate(tags)}
    id2tag = {i: t for t, i in tag2id.items()}

    train_ds = JsonlNerDataset(data / "train.jsonl", word2id, tag2id)
    val_ds = JsonlNerDataset(data / "dev.jsonl", word2id, tag2id)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, collate_fn=pad_collate,
                              sampler=DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True),
                              num_workers=2, pin_memory=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=64, collate_fn=pad_collate, num_workers=2)

    torch.manual_seed(13)
    model = BiLstmCrfTagger(len(word2id), len(tags))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=2)
    callbacks = [LRMonitor(), ModelCheckpoint(args.out), EarlyStopping(patience=args.patience)]

    trainer = Trainer(model, optimizer, scheduler, device, id2tag, callbacks)
    trainer.fit(train_loader, val_loader, args.epochs)

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
