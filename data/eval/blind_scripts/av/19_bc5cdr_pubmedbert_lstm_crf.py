"""Chemical/disease NER on BC5CDR: PubMedBERT -> BiLSTM -> CRF, DDP with torchrun.

    torchrun --nproc_per_node=4 19_bc5cdr_pubmedbert_lstm_crf.py --data data/BC5CDR-IOB --out runs/bc5cdr
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from seqeval.metrics import f1_score, precision_score, recall_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchcrf import CRF
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

ENCODER = "microsoft/BiomedNLP-PubMedBERT-base-uncased-abstract-fulltext"


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--encoder", default=ENCODER)
    ap.add_argument("--lstm_dim", type=int, default=256)
    ap.add_argument("--bsz", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--head_lr", type=float, default=1e-3)
    ap.add_argument("--max_len", type=int, default=320)
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--seed", type=int, default=5)
    return ap.parse_args()


def read_iob(path):
    out, words, tags = [], [], []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                if words:
                    out.append((words, tags))
                words, tags = [], []
                continue
            w, t = line.split("\t")
            words.append(w)
            tags.append(t)
    if words:
        out.append((words, tags))
    return out


class Encoded:
    def __init__(self, sents, tok, label2id, max_len):
        self.rows = []
        for words, tags in sents:
            enc = tok(words, is_split_into_words=True, truncation=True, max_length=max_len)
            heads, seen = [], set()
            for i, w in enumerate(enc.word_ids()):
                if w is not None and w not in seen:
                    seen.add(w)
                    heads.append(i)
            self.rows.append((enc["input_ids"], heads, [label2id[t] for t in tags[:len(heads)]]))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(batch):
    B = len(batch)
    T = max(len(r[0]) for r in batch)
    W = max(len(r[1]) for r in batch)
    ids = torch.zeros(B, T, dtype=torch.long)
    att = torch.zeros(B, T, dtype=torch.long)
    heads = torch.zeros(B, W, dtype=torch.long)
    tags = torch.zeros(B, W, dtype=torch.long)
    mask = torch.zeros(B, W, dtype=torch.bool)
    for b, (x, h, y) in enumerate(batch):
        ids[b, :len(x)] = torch.tensor(x)
        att[b, :len(x)] = 1
        heads[b, :len(h)] = torch.tensor(h)
        tags[b, :len(y)] = torch.tensor(y)
        mask[b, :len(h)] = True
    return ids, att, heads, tags, mask


class BertLstmCrf(nn.Module):
    def __init__(self, encoder, num_tags, lstm_dim):
        super().__init__()
        self.bert = AutoModel.from_pretrained(encoder)
        hid = self.bert.config.hidden_size
        self.lstm = nn.LSTM(hid, lstm_dim, batch_first=True, bidirectional=True)
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(2 * lstm_dim, num_tags)
        self.crf = CRF(num_tags, batch_first=True)

    def _emissions(self, ids, att, heads, mask):
        h = self.bert(input_ids=ids, attention_mask=att).last_hidden_state
        h = h.gather(1, heads.unsqueeze(-1).expand(-1, -1, h.size(-1)))
        lengths = mask.sum(1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=h.size(1))
        return self.fc(self.drop(out)).float()

    def forward(self, ids, att, heads, mask, tags=None):
        em = self._emissions(ids, att, heads, mask)
        if tags is None:
            return self.crf.decode(em, mask=mask)
        return -self.crf(em, tags, mask=mask, reduction="token_mean")


@torch.no_grad()
def evaluate(model, ds, sents, id2label, device, rank, world):
    model.eval()
    mine = list(range(rank, len(ds), world))
    out = []
    for s in range(0, len(mine), 64):
        idx = mine[s:s + 64]
        ids, att, heads, _, mask = collate([ds[i] for i in idx])
        paths = model(ids.to(device), att.to(device), heads.to(device), mask.to(device))
        out += [(i, [id2label[t] for t in p]) for i, p in zip(idx, paths)]
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    model.train()
    if rank != 0:
        return None
    pred = dict(x for g in gathered for x in g)
    y_pred = [pred[i] for i in range(len(ds))]
    y_true = [sents[i][1][:len(y_pred[i])] for i in range(len(ds))]
    return precision_score(y_true, y_pred), recall_score(y_true, y_pred), f1_score(y_true, y_pred)


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    train = read_iob(os.path.join(args.data, "train.tsv"))
    dev = read_iob(os.path.join(args.data, "devel.tsv"))
    test = read_iob(os.path.join(args.data, "test.tsv"))
    labels = sorted({t for _, ts in train + dev for t in ts})
    label2id = {l: i for i, l in enumerate(labels)}
    id2label = {i: l for i, l in enumerate(labels)}
    tok = AutoTokenizer.from_pretrained(args.encoder)
    train_ds = Encoded(train, tok, label2id, args.max_len)
    dev_ds = Encoded(dev, tok, label2id, args.max_len)
    test_ds = Encoded(test, tok, label2id, args.max_len)

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.bsz, sampler=sampler, collate_fn=collate, num_workers=2,
                        pin_memory=True, drop_last=True)

    net = BertLstmCrf(args.encoder, len(labels), args.lstm_dim).to(device)
    model = DDP(net, device_ids=[local_rank])
    bert_params = [p for n, p in net.named_parameters() if n.startswith("bert.")]
    head_params = [p for n, p in net.named_parameters() if not n.startswith("bert.")]
    opt = torch.optim.AdamW([{"params": bert_params, "lr": args.lr},
                             {"params": head_params, "lr": args.head_lr}], weight_decay=0.01)
    total = len(loader) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)
    scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"labels={labels} train={len(train_ds)} dev={len(dev_ds)} world={world}", flush=True)

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for ids, att, heads, tags, mask in loader:
            ids, att, heads = ids.to(device), att.to(device), heads.to(device)
            tags, mask = tags.to(device), mask.to(device)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.fp16):
                loss = model(ids, att, heads, mask, tags)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=True)
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        res = evaluate(net, dev_ds, dev, id2label, device, rank, world)
        if rank == 0:
            p, r, f = res
            print(f"epoch {epoch}: loss {(tot[0] / tot[1]).item():.4f} dev P {p:.4f} R {r:.4f} F1 {f:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if f > best:
                best = f
                torch.save({"model": net.state_dict(), "labels": labels}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    ckpt = torch.load(os.path.join(args.out, "best.pt"), map_location="cpu")
    net.load_state_dict(ckpt["model"])
    res = evaluate(net, test_ds, test, id2label, device, rank, world)
    if rank == 0:
        print(f"test P {res[0]:.4f} R {res[1]:.4f} F1 {res[2]:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
