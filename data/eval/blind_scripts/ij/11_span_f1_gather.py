"""Obligation / permission / prohibition span extraction in credit agreements.

A RoBERTa token classifier runs over 512-token windows; predicted spans are mapped
back to character offsets of the full agreement, gathered from all ranks and
scored against the gold spans of the whole dev set on rank 0.

    torchrun --nproc_per_node=8 11_span_f1_gather.py --data data/credit_agreements --out runs/deontic
"""
import argparse
import json
import logging
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForTokenClassification, AutoTokenizer, get_linear_schedule_with_warmup

logger = logging.getLogger("deontic")
TYPES = ["OBLIGATION", "PERMISSION", "PROHIBITION"]
TAGS = ["O"] + [f"{b}-{t}" for t in TYPES for b in "BI"]


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="roberta-large")
    ap.add_argument("--max_len", type=int, default=512)
    ap.add_argument("--stride", type=int, default=128)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=5)
    return ap.parse_args()


class AgreementWindows(Dataset):
    def __init__(self, path, tok, max_len, stride):
        self.docs = [json.loads(l) for l in open(path)]
        self.windows = []
        for d_idx, doc in enumerate(self.docs):
            enc = tok(doc["text"], truncation=True, max_length=max_len, stride=stride,
                      return_overflowing_tokens=True, return_offsets_mapping=True, padding="max_length")
            for w in range(len(enc["input_ids"])):
                offsets = enc["offset_mapping"][w]
                labels = []
                for (s, e), sid in zip(offsets, enc.sequence_ids(w)):
                    if sid is None:
                        labels.append(-100)
                        continue
                    tag = "O"
                    for span in doc["spans"]:
                        if span["start"] <= s < span["end"]:
                            tag = ("B-" if s == span["start"] else "I-") + span["type"]
                            break
                    labels.append(TAGS.index(tag))
                self.windows.append({
                    "doc": d_idx,
                    "input_ids": torch.tensor(enc["input_ids"][w]),
                    "attention_mask": torch.tensor(enc["attention_mask"][w]),
                    "labels": torch.tensor(labels),
                    "offsets": torch.tensor(offsets),
                })

    def gold_spans(self):
        return {(d, s["start"], s["end"], TYPES.index(s["type"]))
                for d, doc in enumerate(self.docs) for s in doc["spans"]}

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        return self.windows[i]


def decode_window(pred, labels, offsets, doc):
    """Turn one window's tag ids into (doc, char_start, char_end, type) tuples."""
    out, cur = [], None
    for t, y, (s, e) in zip(pred, labels, offsets):
        if y == -100:
            continue
        tag = TAGS[t]
        if tag.startswith("B-") or (tag.startswith("I-") and (cur is None or cur[3] != TYPES.index(tag[2:]))):
            if cur:
                out.append(tuple(cur))
            cur = [doc, s, e, TYPES.index(tag[2:])]
        elif tag.startswith("I-"):
            cur[2] = e
        else:
            if cur:
                out.append(tuple(cur))
            cur = None
    if cur:
        out.append(tuple(cur))
    return out


@torch.no_grad()
def evaluate(model, loader, dataset, device, rank, world_size):
    model.eval()
    spans = []
    for batch in loader:
        logits = model(input_ids=batch["input_ids"].to(device),
                       attention_mask=batch["attention_mask"].to(device)).logits
        pred = logits.argmax(-1).cpu()
        for i in range(pred.size(0)):
            spans.extend(decode_window(pred[i].tolist(), batch["labels"][i].tolist(),
                                       batch["offsets"][i].tolist(), int(batch["doc"][i])))
    local = torch.tensor(spans, dtype=torch.long, device=device).view(-1, 4)
    gathered = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    model.train()
    if rank != 0:
        return None
    pred_set = {tuple(r) for g in gathered for r in g.tolist()}  # overlapping windows / padded samples collapse here
    gold = dataset.gold_spans()
    tp = len(pred_set & gold)
    p = tp / max(len(pred_set), 1)
    r = tp / max(len(gold), 1)
    return {"p": p, "r": r, "f1": 2 * p * r / max(p + r, 1e-9)}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds = AgreementWindows(os.path.join(args.data, "train.jsonl"), tok, args.max_len, args.stride)
    dev_ds = AgreementWindows(os.path.join(args.data, "dev.jsonl"), tok, args.max_len, args.stride)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=4, pin_memory=True)
    dev_dl = DataLoader(dev_ds, batch_size=32, sampler=DistributedSampler(dev_ds, shuffle=False), num_workers=4)

    model = AutoModelForTokenClassification.from_pretrained(args.model, num_labels=len(TAGS))
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, total // 10, total)

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            out = model(input_ids=batch["input_ids"].to(device, non_blocking=True),
                        attention_mask=batch["attention_mask"].to(device, non_blocking=True),
                        labels=batch["labels"].to(device, non_blocking=True))
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step % 100 == 0:
                logger.info("epoch %d step %d loss %.4f", epoch, step, out.loss.item())

        res = evaluate(model.module, dev_dl, dev_ds, device, rank, world_size)
        if rank == 0:
            logger.info("epoch %d dev %s", epoch, res)
            if res["f1"] > best:
                best = res["f1"]
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
