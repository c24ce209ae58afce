# Named-entity tagger for contract documents (xlm-roberta-base + token classification head).
#
# Kubeflow PyTorchJob: 3 worker pods x 4 GPUs, torchrun elastic-style launch:
#   torchrun --nnodes=3 --nproc_per_node=4 --rdzv_backend=c10d \
#            --rdzv_endpoint=$(MASTER_ADDR):$(MASTER_PORT) --rdzv_id=$(JOB_NAME) \
#            train_ner.py --data /datasets/contracts-ner --cache /shared/cache --out /shared/runs/ner-xlmr
# /datasets is a read-only mount of the GCS bucket (gcsfuse CSI), /shared is a Filestore RWX PVC.
import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from seqeval.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForTokenClassification, AutoTokenizer, get_cosine_schedule_with_warmup

LABELS = ["O", "B-PARTY", "I-PARTY", "B-DATE", "I-DATE", "B-AMOUNT", "I-AMOUNT",
          "B-JURISDICTION", "I-JURISDICTION", "B-TERM", "I-TERM"]
L2I = {l: i for i, l in enumerate(LABELS)}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="xlm-roberta-base")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=4e-5)
    return ap.parse_args()


def read_conll_jsonl(path):
    docs = []
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            docs.append((d["tokens"], d["tags"]))
    return docs


def encode(docs, tokenizer, max_len):
    features = []
    for words, tags in docs:
        enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_len)
        labels, prev = [], None
        for wid in enc.word_ids():
            if wid is None or wid == prev:
                labels.append(-100)
            else:
                labels.append(L2I[tags[wid]])
            prev = wid
        features.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                         "labels": labels})
    return features


def load_features(split, args, tokenizer):
    key = hashlib.md5(f"{args.model}-{args.max_len}-{split}".encode()).hexdigest()[:10]
    cache_file = os.path.join(args.cache, f"{split}-{key}.pt")
    if os.path.exists(cache_file):
        return torch.load(cache_file)
    docs = read_conll_jsonl(os.path.join(args.data, f"{split}.jsonl"))
    features = encode(docs, tokenizer, args.max_len)
    os.makedirs(args.cache, exist_ok=True)
    torch.save(features, cache_file)
    return features


class FeatureDataset(Dataset):
    def __init__(self, feats):
        self.feats = feats

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        return self.feats[i]


def collate(batch, pad_id=1):
    n = max(len(b["input_ids"]) for b in batch)
    out = {"input_ids": [], "attention_mask": [], "labels": []}
    for b in batch:
        pad = n - len(b["input_ids"])
        out["input_ids"].append(b["input_ids"] + [pad_id] * pad)
        out["attention_mask"].append(b["attention_mask"] + [0] * pad)
        out["labels"].append(b["labels"] + [-100] * pad)
    return {k: torch.tensor(v) for k, v in out.items()}


@torch.no_grad()
def evaluate(model, loader, device, world):
    model.eval()
    y_true, y_pred = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        pred = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
        for p_row, l_row in zip(pred.tolist(), batch["labels"].tolist()):
            t = [LABELS[l] for l in l_row if l != -100]
            p = [LABELS[pp] for pp, l in zip(p_row, l_row) if l != -100]
            y_true.append(t)
            y_pred.append(p)
    gathered = [None] * world
    dist.all_gather_object(gathered, (y_true, y_pred))
    model.train()
    all_true = [s for part in gathered for s in part[0]]
    all_pred = [s for part in gathered for s in part[1]]
    return f1_score(all_true, all_pred), all_true, all_pred


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    train_feats = load_features("train", args, tokenizer)
    dev_feats = load_features("dev", args, tokenizer)

    train_ds = FeatureDataset(train_feats)
    dev_ds = torch.utils.data.Subset(FeatureDataset(dev_feats), range(rank, len(dev_feats), world))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=7)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, collate_fn=collate,
                          num_workers=2, pin_memory=True)
    dev_dl = DataLoader(dev_ds, batch_size=32, collate_fn=collate, num_workers=2)

    model = AutoModelForTokenClassification.from_pretrained(
        args.model, num_labels=len(LABELS), id2label=dict(enumerate(LABELS)), label2id=L2I)
    model = DDP(model.to(device), device_ids=[local_rank])

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(train_dl) * args.epochs
    sched = get_cosine_schedule_with_warmup(optim, int(0.1 * total), total)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} it {i}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        f1, all_true, all_pred = evaluate(model, dev_dl, device, world)
        if rank == 0:
            print(f"epoch {epoch} dev F1 {f1:.4f} ({time.time() - tic:.0f}s)", flush=True)
            if f1 > best:
                best = f1
                os.makedirs(args.out, exist_ok=True)
                model.module.save_pretrained(args.out)
                tokenizer.save_pretrained(args.out)
                with open(os.path.join(args.out, "dev_report.txt"), "w") as fh:
                    fh.write(classification_report(all_true, all_pred, digits=4))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
