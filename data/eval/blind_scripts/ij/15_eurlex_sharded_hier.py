"""EUR-LEX 57k: EUROVOC multi-label classification with a chunked DistilRoBERTa
encoder and a chunk-level transformer. The corpus lives as jsonl shards
(train-000NN-of-00064.jsonl); every rank reads its own subset of shard files.

    torchrun --nproc_per_node=8 15_eurlex_sharded_hier.py --data_dir /datasets/eurlex57k_tok \
        --label_file /datasets/eurlex57k_tok/eurovoc_top100.json --out runs/eurlex_hier
"""
import argparse
import glob
import json
import logging
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, RandomSampler
from transformers import AutoModel, get_linear_schedule_with_warmup

logger = logging.getLogger("eurlex")
PAD_ID = 1


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--label_file", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--encoder", default="distilroberta-base")
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=4e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=99)
    return ap.parse_args()


def read_shards(pattern, rank, world):
    files = sorted(glob.glob(pattern))
    docs = []
    for path in files[rank::world]:
        with open(path) as f:
            docs.extend(json.loads(l) for l in f)
    return docs


class ChunkedDocs(Dataset):
    """Docs are pre-tokenised: {"celex_id", "chunks": [[ids...], ...], "concepts": [...]}"""

    def __init__(self, docs, label2id, max_chunks):
        self.docs = docs
        self.label2id = label2id
        self.max_chunks = max_chunks

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        d = self.docs[i]
        y = torch.zeros(len(self.label2id))
        for c in d["concepts"]:
            if c in self.label2id:
                y[self.label2id[c]] = 1.0
        return d["chunks"][: self.max_chunks], y


def collate(batch):
    C = max(len(chunks) for chunks, _ in batch)
    L = max(len(c) for chunks, _ in batch for c in chunks)
    ids = torch.full((len(batch), C, L), PAD_ID, dtype=torch.long)
    cmask = torch.zeros(len(batch), C, dtype=torch.bool)
    for i, (chunks, _) in enumerate(batch):
        for j, c in enumerate(chunks):
            ids[i, j, : len(c)] = torch.tensor(c)
            cmask[i, j] = True
    return ids, (ids != PAD_ID).long(), cmask, torch.stack([y for _, y in batch])


class HierEurovoc(nn.Module):
    def __init__(self, encoder, num_labels, max_chunks):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder, add_pooling_layer=False)
        d = self.encoder.config.hidden_size
        self.chunk_pos = nn.Embedding(max_chunks, d)
        self.chunk_tf = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, 12, 2048, batch_first=True, norm_first=True), num_layers=2)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, num_labels)

    def forward(self, ids, attn, cmask):
        B, C, _ = ids.shape
        cls = self.encoder(input_ids=ids[cmask], attention_mask=attn[cmask]).last_hidden_state[:, 0]
        x = cls.new_zeros(B, C, cls.size(-1))
        x[cmask] = cls
        x = x + self.chunk_pos(torch.arange(C, device=ids.device))
        x = self.norm(self.chunk_tf(x, src_key_padding_mask=~cmask))
        x = x.masked_fill(~cmask.unsqueeze(-1), 0.0).sum(1) / cmask.sum(1, keepdim=True)
        return self.out(x)


@torch.no_grad()
def evaluate(model, loader, device, threshold):
    model.eval()
    s = torch.zeros(3, device=device)
    for ids, attn, cmask, y in loader:
        ids, attn, cmask, y = ids.to(device), attn.to(device), cmask.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids, attn, cmask)
        pred = (logits.float().sigmoid() > threshold).float()
        s += torch.stack([(pred * y).sum(), (pred * (1 - y)).sum(), ((1 - pred) * y).sum()])
    dist.all_reduce(s)
    tp, fp, fn = s.tolist()
    p, r = tp / max(tp + fp, 1.0), tp / max(tp + fn, 1.0)
    model.train()
    return {"micro_p": p, "micro_r": r, "micro_f1": 2 * p * r / max(p + r, 1e-9)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [{rank}] %(message)s")
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    with open(args.label_file) as f:
        label2id = {c: i for i, c in enumerate(json.load(f))}

    train_docs = read_shards(os.path.join(args.data_dir, "train-*.jsonl"), rank, world)
    dev_docs = read_shards(os.path.join(args.data_dir, "dev-*.jsonl"), rank, world)
    # size the chunk position table to the longest document we train on
    max_chunks = max(len(d["chunks"]) for d in train_docs)
    logger.info("rank-local train docs %d, dev docs %d, max_chunks %d", len(train_docs), len(dev_docs), max_chunks)

    train_ds = ChunkedDocs(train_docs, label2id, max_chunks)
    dev_ds = ChunkedDocs(dev_docs, label2id, max_chunks)
    gen = torch.Generator()
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=RandomSampler(train_ds, generator=gen),
                          collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(dev_ds, batch_size=8, collate_fn=collate, num_workers=4)

    # shards hold different numbers of docs: every rank runs the smallest count of steps
    n_steps = torch.tensor(len(train_dl), device=device)
    dist.all_reduce(n_steps, op=dist.ReduceOp.MIN)
    steps_per_epoch = int(n_steps.item())

    model = HierEurovoc(args.encoder, len(label2id), max_chunks).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = steps_per_epoch * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, total // 20, total)
    criterion = nn.BCEWithLogitsLoss()

    best = 0.0
    for epoch in range(args.epochs):
        gen.manual_seed(args.seed * 1000 + epoch * world + rank)
        model.train()
        for step, (ids, attn, cmask, y) in zip(range(steps_per_epoch), train_dl):
            ids, attn = ids.to(device, non_blocking=True), attn.to(device, non_blocking=True)
            cmask, y = cmask.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids, attn, cmask)
            loss = criterion(logits.float(), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0:
                logger.info("epoch %d step %d/%d loss %.4f", epoch, step, steps_per_epoch, loss.item())

        metrics = evaluate(model.module, dev_dl, device, args.threshold)
        logger.info("epoch %d dev %s", epoch, metrics)
        if rank == 0 and metrics["micro_f1"] > best:
            best = metrics["micro_f1"]
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "max_chunks": max_chunks,
                        "labels": list(label2id)}, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
