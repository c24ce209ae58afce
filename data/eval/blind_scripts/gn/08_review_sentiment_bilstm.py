"""BiLSTM sentiment classifier on product reviews (3 classes), DDP.

* vocabulary built on rank 0 and broadcast, so every rank uses the same ids
* validation every --eval-every steps, macro-F1 with scikit-learn on the gathered predictions
* the best --keep checkpoints are retained, early stopping with --patience

    torchrun --nproc_per_node=4 08_review_sentiment_bilstm.py --train data/reviews_train.jsonl \
        --valid data/reviews_valid.jsonl --test data/reviews_test.jsonl
"""
import argparse
import collections
import heapq
import json
import os
import re

import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.metrics import classification_report, f1_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TOKEN_RE = re.compile(r"[a-z0-9']+")
LABELS = ["negative", "neutral", "positive"]


def tokenize(text):
    return TOKEN_RE.findall(text.lower())


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def build_vocab(rows, max_size, min_freq):
    counts = collections.Counter(tok for r in rows for tok in tokenize(r["text"]))
    words = [w for w, c in sorted(counts.items(), key=lambda x: (-x[1], x[0])) if c >= min_freq][:max_size]
    return {w: i + 2 for i, w in enumerate(words)}  # 0 pad, 1 unk


class Reviews(Dataset):
    def __init__(self, rows, vocab, max_len=400):
        self.items = []
        for i, r in enumerate(rows):
            ids = [vocab.get(t, 1) for t in tokenize(r["text"])][:max_len] or [1]
            self.items.append((i, torch.tensor(ids), LABELS.index(r["label"])))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(batch):
    idx, seqs, labels = zip(*batch)
    lengths = torch.tensor([len(s) for s in seqs])
    return torch.tensor(idx), pad_sequence(seqs, batch_first=True), lengths, torch.tensor(labels)


class BiLSTM(nn.Module):
    def __init__(self, vocab_size, emb=300, hidden=256, n_classes=3):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, emb, padding_idx=0)
        self.lstm = nn.LSTM(emb, hidden, num_layers=2, bidirectional=True, batch_first=True, dropout=0.3)
        self.drop = nn.Dropout(0.4)
        self.out = nn.Linear(2 * hidden + emb, n_classes)

    def forward(self, x, lengths):
        emb = self.embedding(x)
        packed = pack_padded_sequence(emb, lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        h = torch.cat([h[-2], h[-1]], dim=1)           # last layer, both directions
        mean_emb = emb.sum(1) / lengths[:, None]       # padding rows of the embedding are zero
        return self.out(self.drop(torch.cat([h, mean_emb], dim=1)))


@torch.no_grad()
def predict(model, loader, device):
    model.eval()
    out = []
    for idx, x, lengths, y in loader:
        logits = model(x.to(device), lengths.to(device))
        out.extend(zip(idx.tolist(), logits.argmax(1).tolist(), y.tolist()))
    model.train()
    # DistributedSampler pads the last shard with repeats; keying by index removes them
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, out)
    merged = {i: (p, t) for shard in shards for i, p, t in shard}
    preds = [merged[i][0] for i in sorted(merged)]
    targets = [merged[i][1] for i in sorted(merged)]
    return preds, targets


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--test", required=True)
    ap.add_argument("--out", default="runs/bilstm")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3, help="tuned for 4 GPUs x 64")
    ap.add_argument("--max-steps", type=int, default=30000)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--patience", type=int, default=10)
    ap.add_argument("--keep", type=int, default=3)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    train_rows, valid_rows, test_rows = read_jsonl(args.train), read_jsonl(args.valid), read_jsonl(args.test)
    holder = [build_vocab(train_rows, 50000, 2) if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    vocab = holder[0]

    train_ds, valid_ds, test_ds = (Reviews(r, vocab) for r in (train_rows, valid_rows, test_rows))
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=7)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=256, collate_fn=collate,
                              sampler=DistributedSampler(valid_ds, shuffle=False))
    test_loader = DataLoader(test_ds, batch_size=256, collate_fn=collate,
                             sampler=DistributedSampler(test_ds, shuffle=False))

    torch.manual_seed(7)
    model = BiLSTM(len(vocab) + 2).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=3)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    kept = []  # min-heap of (f1, step, path), rank 0 only
    best_f1, since_best, step, epoch = -1.0, 0, 0, 0
    stop = torch.zeros(1, device=device)

    while step < args.max_steps and stop.item() == 0:
        train_sampler.set_epoch(epoch)
        for _, x, lengths, y in train_loader:
            x, lengths, y = x.to(device), lengths.to(device), y.to(device)
            loss = nn.functional.cross_entropy(model(x, lengths), y)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            step += 1

            if step % args.eval_every == 0:
                preds, targets = predict(model.module, valid_loader, device)
                f1 = f1_score(targets, preds, average="macro")  # same value on every rank
                scheduler.step(f1)
                if f1 > best_f1:
                    best_f1, since_best = f1, 0
                else:
                    since_best += 1
                if rank == 0:
                    print(f"step {step} loss {loss.item():.4f} val macro-F1 {f1:.4f} best {best_f1:.4f}", flush=True)
                    if len(kept) < args.keep or f1 > kept[0][0]:
                        path = os.path.join(args.out, f"step{step:06d}_f1{f1:.4f}.pt")
                        torch.save({"step": step, "f1": f1, "model": model.module.state_dict(), "vocab": vocab}, path)
                        heapq.heappush(kept, (f1, step, path))
                        if len(kept) > args.keep:
                            os.remove(heapq.heappop(kept)[2])
                    if since_best >= args.patience:
                        stop.fill_(1)
                dist.broadcast(stop, src=0)
                if stop.item():
                    break
            if step >= args.max_steps:
                break
        epoch += 1

    # every rank evaluates the best checkpoint on the test set
    best_path = [max(kept)[2] if rank == 0 else None]
    dist.barrier()
    dist.broadcast_object_list(best_path, src=0)
    state = torch.load(best_path[0], map_location="cpu")
    model.module.load_state_dict(state["model"])
    preds, targets = predict(model.module, test_loader, device)
    if rank == 0:
        print(f"best checkpoint: {best_path[0]}")
        print(classification_report(targets, preds, target_names=LABELS, digits=4))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
