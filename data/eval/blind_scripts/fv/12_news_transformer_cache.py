"""Topic classification on a news corpus with a small Transformer encoder trained from scratch.

The Horovod version used hvd.broadcast_object for the vocabulary; this one does
the same with torch.distributed.broadcast_object_list. Start with torchrun.
"""
import argparse
import collections
import json
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TOKEN_RE = re.compile(r"[a-z0-9']+")
PAD, UNK = 0, 1


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-jsonl", required=True)
    p.add_argument("--val-jsonl", required=True)
    p.add_argument("--cache-dir", default="cache/news")
    p.add_argument("--vocab-size", type=int, default=50000)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=64, help="per GPU")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=5e-4, help="for the global batch")
    p.add_argument("--init-from", default="", help="weights from an earlier run (may be a DDP checkpoint)")
    p.add_argument("--out", default="runs/news")
    return p.parse_args()


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def build_vocab(records, size):
    counts = collections.Counter(tok for r in records for tok in TOKEN_RE.findall(r["text"].lower()))
    itos = ["<pad>", "<unk>"] + [w for w, _ in counts.most_common(size - 2)]
    labels = sorted({r["label"] for r in records})
    return {"itos": itos, "labels": labels}


def encode(records, vocab, max_len):
    stoi = {w: i for i, w in enumerate(vocab["itos"])}
    ltoi = {l: i for i, l in enumerate(vocab["labels"])}
    ids = torch.full((len(records), max_len), PAD, dtype=torch.int32)
    for n, r in enumerate(records):
        toks = [stoi.get(t, UNK) for t in TOKEN_RE.findall(r["text"].lower())[:max_len]]
        ids[n, :len(toks)] = torch.tensor(toks, dtype=torch.int32)
    return {"ids": ids, "labels": torch.tensor([ltoi[r["label"]] for r in records])}


class Encoded(Dataset):
    def __init__(self, blob):
        self.ids, self.labels = blob["ids"], blob["labels"]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.ids[i].long(), self.labels[i], i


class TextTransformer(nn.Module):
    def __init__(self, vocab, n_classes, d_model, layers, max_len):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, 8, 4 * d_model, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, ids):
        pad = ids == PAD
        x = self.encoder(self.emb(ids) + self.pos[:, :ids.size(1)], src_key_padding_mask=pad)
        x = self.norm(x).masked_fill(pad.unsqueeze(-1), 0.0)
        return self.head(x.sum(1) / (~pad).sum(1, keepdim=True).clamp(min=1))


def prepare_data(args, rank):
    """Rank 0 builds the vocabulary and the encoded cache; every rank then reads the same files."""
    cache = os.path.join(args.cache_dir, f"enc_v{args.vocab_size}_l{args.max_len}.pt")
    vocab_file = cache.replace(".pt", ".vocab.json")
    vocab = [None]
    if rank == 0:
        if os.path.exists(cache) and os.path.exists(vocab_file):
            with open(vocab_file) as f:
                vocab[0] = json.load(f)
        else:
            os.makedirs(args.cache_dir, exist_ok=True)
            train_recs = read_jsonl(args.train_jsonl)
            vocab[0] = build_vocab(train_recs, args.vocab_size)
            blob = {"train": encode(train_recs, vocab[0], args.max_len),
                    "val": encode(read_jsonl(args.val_jsonl), vocab[0], args.max_len), "vocab": vocab[0]}
            tmp = cache + ".tmp"
            torch.save(blob, tmp)
            os.replace(tmp, cache)
            with open(vocab_file, "w") as f:
                json.dump(vocab[0], f)
    dist.broadcast_object_list(vocab, src=0)
    dist.barrier()
    blob = torch.load(cache, map_location="cpu")
    assert blob["vocab"] == vocab[0], "stale cache, delete it"
    return vocab[0], Encoded(blob["train"]), Encoded(blob["val"])


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    local = []
    for ids, labels, idx in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(ids.to(device, non_blocking=True)).argmax(-1).cpu()
        local.extend(zip(idx.tolist(), (pred == labels).tolist()))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    model.train()
    # DistributedSampler repeats a few samples to even out the shards; count each index once
    seen = dict(pair for part in gathered for pair in part)
    return sum(seen.values()) / len(seen)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    vocab, train_set, val_set = prepare_data(args, rank)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256, sampler=val_sampler, num_workers=2)

    model = TextTransformer(len(vocab["itos"]), len(vocab["labels"]), args.d_model, args.layers, args.max_len)
    if args.init_from:
        state = torch.load(args.init_from, map_location="cpu")
        state = {k.removeprefix("module."): v for k, v in state.get("model", state).items()}
        model.load_state_dict(state)
    model = DDP(model.to(device), device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=total, pct_start=0.06)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"vocab {len(vocab['itos'])}, {len(vocab['labels'])} classes, {len(train_set)} train docs")
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (ids, labels, _) in enumerate(train_loader):
            ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            # bf16 autocast: no loss scaling needed
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(ids), labels, label_smoothing=0.05)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.4f} {time.time() - t0:.0f}s")
        acc = evaluate(model, val_loader, device, world_size)
        if rank == 0:
            print(f"epoch {epoch}: val acc {100 * acc:.2f}")
            torch.save({"model": model.module.state_dict(), "vocab": vocab, "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save({"model": model.module.state_dict(), "vocab": vocab},
                           os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
