"""
Punctuation restoration for ASR transcripts: tag each word with the punctuation that follows it
(O, COMMA, PERIOD, QUESTION). Word vocab built from the training text at start-up.

    torchrun --nproc_per_node=2 13_punct_restoration_tagger.py --data data/iwslt_punct --exp exp/punct_tfm
"""
import argparse
import collections
import os
import re

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TAGS = ["O", "COMMA", "PERIOD", "QUESTION"]
PUNCT2TAG = {",": 1, ".": 2, "?": 3}


def read_corpus(path):
    """one document per line, punctuated text"""
    seqs = []
    for line in open(path, encoding="utf-8"):
        words, tags = [], []
        for tok in re.findall(r"[\w']+|[,.?]", line.lower()):
            if tok in PUNCT2TAG:
                if words:
                    tags[-1] = PUNCT2TAG[tok]
            else:
                words.append(tok)
                tags.append(0)
        if words:
            seqs.append((words, tags))
    return seqs


def build_vocab(seqs, min_count=2):
    cnt = collections.Counter(w for ws, _ in seqs for w in ws)
    itos = ["<pad>", "<unk>"] + sorted(w for w, c in cnt.items() if c >= min_count)
    return {w: i for i, w in enumerate(itos)}


class WindowDataset(Dataset):
    def __init__(self, seqs, vocab, win=100, hop=50):
        self.items = []
        for words, tags in seqs:
            ids = [vocab.get(w, 1) for w in words]
            for s in range(0, max(1, len(ids) - win + hop), hop):
                self.items.append((ids[s:s + win], tags[s:s + win]))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ids, tags = self.items[i]
        return torch.tensor(ids), torch.tensor(tags)


def collate(batch):
    ids, tags = zip(*batch)
    return (nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=0),
            nn.utils.rnn.pad_sequence(tags, batch_first=True, padding_value=-100))


class PunctTagger(nn.Module):
    def __init__(self, vocab_size, d=384, layers=6, heads=6, max_len=128):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d))
        nn.init.normal_(self.pos, std=0.02)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, 4 * d, 0.1, batch_first=True), layers)
        self.cls = nn.Linear(d, len(TAGS))

    def forward(self, ids):
        h = self.emb(ids) + self.pos[:, : ids.size(1)]
        return self.cls(self.enc(h, src_key_padding_mask=ids.eq(0)))


def f1_report(tp, fp, fn):
    out = {}
    for k in range(1, len(TAGS)):
        p = tp[k] / max(1.0, tp[k] + fp[k])
        r = tp[k] / max(1.0, tp[k] + fn[k])
        out[TAGS[k]] = 2 * p * r / max(1e-9, p + r)
    return out


@torch.no_grad()
def count_errors(model, loader, device):
    model.eval()
    tp, fp, fn = (torch.zeros(len(TAGS), device=device) for _ in range(3))
    for ids, tags in loader:
        ids, tags = ids.to(device), tags.to(device)
        pred = model(ids).argmax(-1)
        valid = tags.ne(-100)
        for k in range(1, len(TAGS)):
            tp[k] += ((pred == k) & (tags == k) & valid).sum()
            fp[k] += ((pred == k) & (tags != k) & valid).sum()
            fn[k] += ((pred != k) & (tags == k) & valid).sum()
    model.train()
    return tp, fp, fn


def test(args, vocab, device):
    model = PunctTagger(len(vocab)).to(device)
    state = torch.load(os.path.join(args.exp, "best.pt"), map_location=device)
    model.load_state_dict(state)
    test_set = WindowDataset(read_corpus(os.path.join(args.data, "test.txt")), vocab, hop=100)
    tp, fp, fn = count_errors(model, DataLoader(test_set, batch_size=128, collate_fn=collate), device)
    f1 = f1_report(tp.tolist(), fp.tolist(), fn.tolist())
    print("TEST " + " ".join(f"{k}={100 * v:.1f}" for k, v in f1.items()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--exp", required=True)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--bsz", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(3)

    train_seqs = read_corpus(os.path.join(args.data, "train.txt"))
    vocab = build_vocab(train_seqs)
    train_set = WindowDataset(train_seqs, vocab)
    dev_set = WindowDataset(read_corpus(os.path.join(args.data, "dev.txt")), vocab, hop=100)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.bsz, sampler=sampler, collate_fn=collate,
                              num_workers=2, drop_last=True)
    dev_loader = DataLoader(torch.utils.data.Subset(dev_set, range(rank, len(dev_set), world)),
                            batch_size=128, collate_fn=collate)

    model = DDP(PunctTagger(len(vocab)).to(device), device_ids=[local_rank])
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # class weights: punctuation is rare
    weight = torch.tensor([0.5, 1.0, 1.0, 2.0], device=device)
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)
        print(f"vocab {len(vocab)} train windows {len(train_set)}")

    best = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = 0.0
        for step, (ids, tags) in enumerate(train_loader):
            ids, tags = ids.to(device), tags.to(device)
            logits = model(ids)
            loss = F.cross_entropy(logits.view(-1, len(TAGS)), tags.view(-1), weight=weight, ignore_index=-100)
            optim.zero_grad()
            loss.backward()
            optim.step()
            total += loss.item()

        tp, fp, fn = count_errors(model.module, dev_loader, device)
        for t in (tp, fp, fn):
            dist.all_reduce(t)
        f1 = f1_report(tp.tolist(), fp.tolist(), fn.tolist())
        macro = sum(f1.values()) / len(f1)
        if rank == 0:
            print(f"epoch {epoch} loss {total / max(1, step + 1):.4f} dev " +
                  " ".join(f"{k}={100 * v:.1f}" for k, v in f1.items()) + f" macro={100 * macro:.1f}", flush=True)
            if macro > best:
                best = macro
                torch.save(model.state_dict(), os.path.join(args.exp, "best.pt"))
        dist.barrier()

    if rank == 0:
        test(args, vocab, device)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
