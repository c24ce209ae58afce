"""BiLSTM-CRF on top of Legal-RoBERTa for clause boundary + type tagging in
lease agreements (sentence-level BIO over the clauses of a lease).

    torchrun --nproc_per_node=4 14_clause_tagger_crf.py --train data/leases/train.jsonl \
        --dev data/leases/dev.jsonl --save_dir runs/lease_crf
"""
import argparse
import json
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchcrf import CRF
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("lease_crf")

CLAUSES = ["rent", "term", "renewal", "maintenance", "assignment", "default", "insurance", "use", "deposit"]
TAGS = ["O"] + [f"{p}-{c}" for c in CLAUSES for p in ("B", "I")]


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--encoder", default="lexlms/legal-roberta-base")
    ap.add_argument("--max_sentences", type=int, default=96)
    ap.add_argument("--sent_len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--crf_lr", type=float, default=5e-3)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch_size", type=int, default=2)
    return ap.parse_args()


class LeaseDataset(Dataset):
    """One item = one lease: up to max_sentences sentences, one tag per sentence."""

    def __init__(self, path, tok, max_sentences, sent_len):
        self.items = []
        with open(path) as f:
            for line in f:
                d = json.loads(line)
                sents = d["sentences"][:max_sentences]
                tags = [TAGS.index(t) for t in d["tags"][:max_sentences]]
                enc = tok(sents, truncation=True, max_length=sent_len, padding="max_length", return_tensors="pt")
                self.items.append((enc["input_ids"], enc["attention_mask"], torch.tensor(tags)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(batch):
    ids = pad_sequence([b[0] for b in batch], batch_first=True, padding_value=1)
    att = pad_sequence([b[1] for b in batch], batch_first=True, padding_value=0)
    tags = pad_sequence([b[2] for b in batch], batch_first=True, padding_value=0)
    sent_mask = pad_sequence([torch.ones(len(b[2]), dtype=torch.bool) for b in batch], batch_first=True)
    return ids, att, tags, sent_mask


class OrderedShard(Sampler):
    def __init__(self, n, rank, world):
        self.ix = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.ix)

    def __len__(self):
        return len(self.ix)


class SentenceCRFTagger(nn.Module):
    def __init__(self, encoder_name, num_tags):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder_name, add_pooling_layer=False)
        d = self.encoder.config.hidden_size
        self.lstm = nn.LSTM(d, d // 2, num_layers=1, bidirectional=True, batch_first=True)
        self.emit = nn.Linear(d, num_tags)
        self.crf = CRF(num_tags, batch_first=True)

    def emissions(self, ids, att, sent_mask):
        B, S, L = ids.shape
        h = self.encoder(input_ids=ids[sent_mask], attention_mask=att[sent_mask]).last_hidden_state[:, 0]
        sent_vecs = h.new_zeros(B, S, h.size(-1))
        sent_vecs[sent_mask] = h
        # keep the recurrent part in fp32
        with torch.autocast("cuda", enabled=False):
            out, _ = self.lstm(sent_vecs.float())
            return self.emit(out)

    def forward(self, ids, att, sent_mask, tags):
        em = self.emissions(ids, att, sent_mask)
        return -self.crf(em.float(), tags, mask=sent_mask, reduction="mean")

    @torch.no_grad()
    def decode(self, ids, att, sent_mask):
        em = self.emissions(ids, att, sent_mask)
        return self.crf.decode(em.float(), mask=sent_mask)


def clause_spans(tags):
    spans, start, typ = set(), None, None
    for i, t in enumerate([TAGS[x] for x in tags] + ["O"]):
        if typ is not None and not (t.startswith("I-") and t[2:] == typ):
            spans.add((start, i, typ))
            typ = None
        if t.startswith("B-") or (t.startswith("I-") and typ is None):
            start, typ = i, t[2:]
    return spans


def evaluate(model, loader, device):
    model.eval()
    counts = torch.zeros(3, device=device)
    for ids, att, tags, sent_mask in loader:
        ids, att, sent_mask = ids.to(device), att.to(device), sent_mask.to(device)
        paths = model.decode(ids, att, sent_mask)
        for path, gold, m in zip(paths, tags.tolist(), sent_mask.tolist()):
            g = clause_spans(gold[:sum(m)])
            p = clause_spans(path)
            counts += torch.tensor([len(p & g), len(p - g), len(g - p)], device=device, dtype=torch.float)
    dist.all_reduce(counts)
    tp, fp, fn = counts.tolist()
    prec, rec = tp / max(tp + fp, 1), tp / max(tp + fn, 1)
    model.train()
    return {"clause_p": prec, "clause_r": rec, "clause_f1": 2 * prec * rec / max(prec + rec, 1e-9)}


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")
    torch.manual_seed(5)

    tok = AutoTokenizer.from_pretrained(args.encoder)
    train_ds = LeaseDataset(args.train, tok, args.max_sentences, args.sent_len)
    dev_ds = LeaseDataset(args.dev, tok, args.max_sentences, args.sent_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          collate_fn=collate, num_workers=2, pin_memory=True)
    dev_dl = DataLoader(dev_ds, batch_size=args.batch_size, sampler=OrderedShard(len(dev_ds), rank, world),
                        collate_fn=collate, num_workers=2)

    model = SentenceCRFTagger(args.encoder, len(TAGS)).to(device)
    model = DDP(model, device_ids=[local_rank])

    enc_params = [p for n, p in model.named_parameters() if ".encoder." in n]
    other = [p for n, p in model.named_parameters() if ".encoder." not in n]
    opt = torch.optim.AdamW([{"params": enc_params, "lr": args.lr},
                             {"params": other, "lr": args.crf_lr}], weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (ids, att, tags, sent_mask) in enumerate(train_dl):
            ids, att = ids.to(device, non_blocking=True), att.to(device, non_blocking=True)
            tags, sent_mask = tags.to(device, non_blocking=True), sent_mask.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids, att, sent_mask, tags)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if step % 25 == 0:
                logger.info("epoch %d step %d nll %.3f", epoch, step, loss.item())

        with torch.autocast("cuda", dtype=torch.bfloat16):
            metrics = evaluate(model, dev_dl, device)
        logger.info("epoch %d dev %s", epoch, metrics)
        if rank == 0 and metrics["clause_f1"] > best:
            best = metrics["clause_f1"]
            os.makedirs(args.save_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "tags": TAGS, "epoch": epoch},
                       os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
