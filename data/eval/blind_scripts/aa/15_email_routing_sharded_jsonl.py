"""Email -> department router trained on sharded JSONL exports (one shard per mailbox export).

    torchrun --nnodes=2 --nproc_per_node=4 --node_rank=$NODE_RANK --master_addr=$MASTER --master_port=29500 \
        15_email_routing_sharded_jsonl.py --shards /data/email_exports/train --valid /data/email_exports/valid.jsonl
"""
import argparse
import glob
import json
import math
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import AutoModel, AutoTokenizer

DEPARTMENTS = ["billing", "claims", "complaints", "fraud", "general", "it_support", "legal", "policy_change",
               "renewals", "sales"]
DEPT2ID = {d: i for i, d in enumerate(DEPARTMENTS)}
SIG_RE = re.compile(r"\n--\s*\n.*", re.S)
QUOTE_RE = re.compile(r"^>.*$", re.M)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--out", default="/data/runs/email_router")
    p.add_argument("--encoder", default="distilroberta-base")
    p.add_argument("--max_len", type=int, default=320)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--log_every", type=int, default=100)
    return p.parse_args()


def clean_email(subject, body):
    body = SIG_RE.sub("", body or "")
    body = QUOTE_RE.sub("", body)
    return (subject or "").strip() + " \n " + " ".join(body.split())[:4000]


def read_records(path):
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            dept = (r.get("routed_to") or "").lower().replace(" ", "_")
            if dept not in DEPT2ID:
                continue
            yield clean_email(r.get("subject"), r.get("body")), DEPT2ID[dept]


class ShardStream(IterableDataset):
    def __init__(self, files, tokenizer, max_len):
        self.files, self.tok, self.max_len = files, tokenizer, max_len
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        info = get_worker_info()
        files = list(self.files)
        g = torch.Generator().manual_seed(1000 + self.epoch)
        files = [files[i] for i in torch.randperm(len(files), generator=g).tolist()]
        if info is not None:
            files = files[info.id::info.num_workers]
        for path in files:
            for text, label in read_records(path):
                enc = self.tok(text, truncation=True, max_length=self.max_len, padding="max_length",
                               return_tensors="pt")
                yield enc["input_ids"][0], enc["attention_mask"][0], label


class Router(nn.Module):
    def __init__(self, name, n_classes):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name, add_pooling_layer=False)
        h = self.encoder.config.hidden_size
        self.classifier = nn.Sequential(nn.Linear(h, h), nn.Tanh(), nn.Dropout(0.1), nn.Linear(h, n_classes))

    def forward(self, ids, mask):
        hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return self.classifier(pooled)


def validate(module, path, tok, args, device):
    module.eval()
    correct = total = 0
    texts, labels = zip(*read_records(path))
    with torch.no_grad():
        for i in range(0, len(texts), 128):
            enc = tok(list(texts[i:i + 128]), truncation=True, max_length=args.max_len, padding=True,
                      return_tensors="pt").to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = module(enc["input_ids"], enc["attention_mask"]).argmax(-1).cpu()
            correct += (pred == torch.tensor(labels[i:i + 128])).sum().item()
            total += len(pred)
    module.train()
    return correct / max(total, 1)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    files = sorted(glob.glob(os.path.join(args.shards, "*.jsonl")))
    assert len(files) >= world, f"need at least {world} shards, found {len(files)}"
    my_files = files[rank::world]
    print(f"[rank {rank}] {len(my_files)} shards", flush=True)

    tok = AutoTokenizer.from_pretrained(args.encoder)
    stream = ShardStream(my_files, tok, args.max_len)
    loader = DataLoader(stream, batch_size=args.batch_size, num_workers=4, pin_memory=True, drop_last=True)

    model = DDP(Router(args.encoder, len(DEPARTMENTS)).to(device), device_ids=[local_rank])
    lr = args.lr * math.sqrt(world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    criterion = nn.CrossEntropyLoss()

    os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        stream.set_epoch(epoch)
        model.train()
        t0, running = time.time(), 0.0
        for step, (ids, mask, y) in enumerate(loader):
            ids, mask, y = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True), y.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(ids, mask), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            running += loss.item()
            if rank == 0 and (step + 1) % args.log_every == 0:
                print(f"epoch {epoch} step {step + 1} loss {running / args.log_every:.4f} "
                      f"({(time.time() - t0) / (step + 1):.2f}s/step)", flush=True)
                running = 0.0

        dist.barrier()
        if rank == 0:
            acc = validate(model.module, args.valid, tok, args, device)
            print(f"epoch {epoch} valid acc {acc:.4f}", flush=True)
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "departments": DEPARTMENTS, "encoder": args.encoder},
                           os.path.join(args.out, "router_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
