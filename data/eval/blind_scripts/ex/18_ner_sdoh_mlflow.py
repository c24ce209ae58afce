"""
Social determinants of health (SDoH) mention tagging in social-history sections
(n2c2-2022 track 2 trigger types: Alcohol, Drug, Tobacco, Employment, LivingStatus) with
a clinical BERT tagger. Runs are tracked in the group's MLflow server.

    torchrun --nproc_per_node=4 18_ner_sdoh_mlflow.py --data data/sdoh --model emilyalsentzer/Bio_ClinicalBERT
"""
import argparse
import json
import os
from collections import defaultdict

import mlflow
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification,
                          get_linear_schedule_with_warmup)

TYPES = ["Alcohol", "Drug", "Tobacco", "Employment", "LivingStatus"]
TAGS = ["O"] + [f"{b}-{t}" for t in TYPES for b in ("B", "I")]


def read_split(path):
    with open(path) as f:
        return [json.loads(l) for l in f]


class TaggedSentences(Dataset):
    def __init__(self, rows, tok, max_len):
        self.feats = []
        for r in rows:
            enc = tok(r["tokens"], is_split_into_words=True, truncation=True, max_length=max_len)
            labels, prev = [], None
            for w in enc.word_ids():
                labels.append(-100 if (w is None or w == prev) else TAGS.index(r["tags"][w]))
                prev = w
            self.feats.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                               "labels": labels})

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        return self.feats[i]


def extract_spans(tag_ids):
    spans, cur = [], None
    for i, t in enumerate(tag_ids):
        tag = TAGS[t]
        if tag == "O":
            if cur:
                spans.append(tuple(cur))
            cur = None
        elif tag.startswith("B-") or cur is None or tag[2:] != cur[2]:
            if cur:
                spans.append(tuple(cur))
            cur = [i, i, tag[2:]]          # an I- without a matching B- opens a new span
        else:
            cur[1] = i
    if cur:
        spans.append(tuple(cur))
    return spans


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = defaultdict(lambda: [0, 0, 0])     # type -> tp, fp, fn
    for batch in loader:
        labels = batch.pop("labels")
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        pred = logits.argmax(-1).cpu()
        for p, g in zip(pred, labels):
            keep = g != -100
            P = set(extract_spans(p[keep].tolist()))
            G = set(extract_spans(g[keep].tolist()))
            for s in P & G:
                stats[s[2]][0] += 1
            for s in P - G:
                stats[s[2]][1] += 1
            for s in G - P:
                stats[s[2]][2] += 1
    counts = torch.tensor([stats[t] for t in TYPES], dtype=torch.float64)   # |TYPES| x 3
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    tp, fp, fn = counts[:, 0], counts[:, 1], counts[:, 2]
    per_type = (2 * tp / (2 * tp + fp + fn).clamp(min=1)).tolist()
    micro = (2 * tp.sum() / (2 * tp.sum() + fp.sum() + fn.sum()).clamp(min=1)).item()
    return micro, dict(zip(TYPES, per_type))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default="emilyalsentzer/Bio_ClinicalBERT")
    ap.add_argument("--out", default="runs/sdoh_ner")
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=4e-5)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=22)
    ap.add_argument("--experiment", default="sdoh-ner")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds = TaggedSentences(read_split(os.path.join(args.data, "train.jsonl")), tok, args.max_len)
    dev_ds = TaggedSentences(read_split(os.path.join(args.data, "dev.jsonl")), tok, args.max_len)
    collator = DataCollatorForTokenClassification(tok)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collator, num_workers=2)
    dev_dl = DataLoader(Subset(dev_ds, range(rank, len(dev_ds), world)), batch_size=64, collate_fn=collator)

    model = AutoModelForTokenClassification.from_pretrained(args.model, num_labels=len(TAGS)).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)

    if rank == 0:
        mlflow.set_experiment(args.experiment)
        mlflow.start_run(run_name=f"{os.path.basename(args.model)}-lr{args.lr}")
        mlflow.log_params({**vars(args), "world_size": world})

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(2, device=device)
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_sum)

        micro, per_type = evaluate(model.module, dev_dl, device)
        if rank == 0:
            train_loss = (loss_sum[0] / loss_sum[1]).item()
            print(f"epoch {epoch}: loss {train_loss:.4f} dev micro-F1 {micro:.4f} "
                  + " ".join(f"{k}={v:.3f}" for k, v in per_type.items()), flush=True)
            mlflow.log_metrics({"train_loss": train_loss, "dev_micro_f1": micro,
                                **{f"dev_f1_{k}": v for k, v in per_type.items()}}, step=epoch)
            if micro > best:
                best = micro
                model.module.save_pretrained(args.out)
                tok.save_pretrained(args.out)
                mlflow.log_metric("best_dev_micro_f1", best, step=epoch)
        dist.barrier()

    if rank == 0:
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
