"""Hierarchical classifier for 10-K filings (EDGAR-CORPUS) -> SIC division.

Each filing is cut into 512-token chunks (at most --max_chunks), the chunks are
encoded by a BERT-style encoder, a small transformer runs over the chunk [CLS]
vectors and the document vector is the masked mean of its outputs.

torchrun --nproc_per_node=8 03_edgar_hier_classifier.py --data_dir /data/edgar --cache_dir /data/edgar/cache
"""
import argparse
import json
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer, get_cosine_schedule_with_warmup

log = logging.getLogger(__name__)

SECTIONS = ("item_1", "item_1A", "item_7", "item_7A")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--cache_dir", required=True)
    ap.add_argument("--out_dir", default="runs/edgar_hier")
    ap.add_argument("--encoder", default="yiyanghkust/finbert-pretrain")
    ap.add_argument("--chunk_len", type=int, default=512)
    ap.add_argument("--max_chunks", type=int, default=32)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--head_lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--warmup_steps", type=int, default=500)
    ap.add_argument("--amp", action="store_true")
    return ap.parse_args()


def chunk_document(tokenizer, text, chunk_len, max_chunks):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    body = chunk_len - 2
    chunks = []
    for start in range(0, len(ids), body):
        piece = ids[start:start + body]
        chunks.append([tokenizer.cls_token_id] + piece + [tokenizer.sep_token_id])
        if len(chunks) == max_chunks:
            break
    return chunks or [[tokenizer.cls_token_id, tokenizer.sep_token_id]]


def build_features(path, tokenizer, label2id, chunk_len, max_chunks):
    feats = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            text = "\n".join(rec.get(s, "") for s in SECTIONS)
            feats.append({
                "cik": rec["cik"],
                "chunks": chunk_document(tokenizer, text, chunk_len, max_chunks),
                "label": label2id[rec["sic_division"]],
            })
    return feats


def load_or_build(split, args, tokenizer, label2id):
    cache_path = os.path.join(args.cache_dir, f"{split}_c{args.chunk_len}_n{args.max_chunks}.pt")
    if os.path.exists(cache_path):
        return torch.load(cache_path)
    feats = build_features(os.path.join(args.data_dir, f"{split}.jsonl"), tokenizer, label2id,
                           args.chunk_len, args.max_chunks)
    os.makedirs(args.cache_dir, exist_ok=True)
    torch.save(feats, cache_path)
    return feats


class FilingDataset(Dataset):
    def __init__(self, feats):
        self.feats = feats

    def __len__(self):
        return len(self.feats)

    def __getitem__(self, i):
        return self.feats[i]


def make_collate(pad_id, chunk_len):
    def collate(batch):
        n_chunks = max(len(b["chunks"]) for b in batch)
        ids = torch.full((len(batch), n_chunks, chunk_len), pad_id, dtype=torch.long)
        chunk_mask = torch.zeros(len(batch), n_chunks, dtype=torch.bool)
        for i, b in enumerate(batch):
            for j, c in enumerate(b["chunks"]):
                ids[i, j, :len(c)] = torch.tensor(c)
                chunk_mask[i, j] = True
        return {
            "input_ids": ids,
            "attention_mask": (ids != pad_id).long(),
            "chunk_mask": chunk_mask,
            "labels": torch.tensor([b["label"] for b in batch]),
        }
    return collate


class ShardSampler(Sampler):
    """Contiguous, unpadded slice of the eval set for one rank."""

    def __init__(self, n, rank, world_size):
        per = math.ceil(n / world_size)
        self.indices = list(range(rank * per, min(n, (rank + 1) * per)))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


class HierarchicalClassifier(nn.Module):
    def __init__(self, encoder_name, num_labels, max_chunks, n_layers=2):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(encoder_name, add_pooling_layer=False)
        d = self.encoder.config.hidden_size
        self.chunk_pos = nn.Embedding(max_chunks, d)
        layer = nn.TransformerEncoderLayer(d, nhead=8, dim_feedforward=4 * d, batch_first=True)
        self.doc_encoder = nn.TransformerEncoder(layer, n_layers)
        self.classifier = nn.Sequential(nn.Dropout(0.1), nn.Linear(d, num_labels))

    def forward(self, input_ids, attention_mask, chunk_mask):
        B, C, L = input_ids.shape
        # only encode real chunks
        flat_ids = input_ids[chunk_mask]
        flat_mask = attention_mask[chunk_mask]
        cls = self.encoder(input_ids=flat_ids, attention_mask=flat_mask).last_hidden_state[:, 0]
        chunk_vecs = cls.new_zeros(B, C, cls.size(-1))
        chunk_vecs[chunk_mask] = cls
        pos = torch.arange(C, device=input_ids.device)
        h = self.doc_encoder(chunk_vecs + self.chunk_pos(pos)[None], src_key_padding_mask=~chunk_mask)
        m = chunk_mask.unsqueeze(-1).float()
        doc = (h * m).sum(1) / m.sum(1).clamp(min=1.0)
        return self.classifier(doc)


@torch.no_grad()
def evaluate(model, loader, device, num_labels):
    model.eval()
    confusion = torch.zeros(num_labels, num_labels, dtype=torch.long, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(batch["input_ids"], batch["attention_mask"], batch["chunk_mask"])
        pred = logits.argmax(-1)
        confusion.index_put_((batch["labels"], pred), torch.ones_like(pred), accumulate=True)
    dist.all_reduce(confusion)
    tp = confusion.diag().float()
    prec = tp / confusion.sum(0).clamp(min=1)
    rec = tp / confusion.sum(1).clamp(min=1)
    f1 = 2 * prec * rec / (prec + rec).clamp(min=1e-8)
    return {"acc": (tp.sum() / confusion.sum()).item(), "macro_f1": f1.mean().item()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(1234)

    with open(os.path.join(args.data_dir, "sic_divisions.json")) as f:
        divisions = json.load(f)
    label2id = {d: i for i, d in enumerate(divisions)}

    tokenizer = AutoTokenizer.from_pretrained(args.encoder)
    train_feats = load_or_build("train", args, tokenizer, label2id)
    dev_feats = load_or_build("validation", args, tokenizer, label2id)
    log.info("train filings %d, dev filings %d", len(train_feats), len(dev_feats))

    collate = make_collate(tokenizer.pad_token_id, args.chunk_len)
    train_ds, dev_ds = FilingDataset(train_feats), FilingDataset(dev_feats)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True)
    dev_loader = DataLoader(dev_ds, batch_size=args.batch_size * 2,
                            sampler=ShardSampler(len(dev_ds), rank, world),
                            collate_fn=collate, num_workers=4, pin_memory=True)

    model = HierarchicalClassifier(args.encoder, len(divisions), args.max_chunks).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    enc_params = [p for n, p in model.named_parameters() if n.startswith("module.encoder.")]
    head_params = [p for n, p in model.named_parameters() if not n.startswith("module.encoder.")]
    optimizer = torch.optim.AdamW([
        {"params": enc_params, "lr": args.lr},
        {"params": head_params, "lr": args.head_lr},
    ], weight_decay=0.01)
    total = len(train_loader) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, total)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
                logits = model(batch["input_ids"], batch["attention_mask"], batch["chunk_mask"])
            loss = F.cross_entropy(logits.float(), batch["labels"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if it % 100 == 0:
                log.info("ep %d it %d/%d loss %.4f %.1f s", epoch, it, len(train_loader),
                         loss.item(), time.time() - t0)

        metrics = evaluate(model.module, dev_loader, device, len(divisions))
        log.info("epoch %d validation %s", epoch, metrics)
        if rank == 0 and metrics["macro_f1"] > best:
            best = metrics["macro_f1"]
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": metrics,
                        "labels": divisions}, os.path.join(args.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
