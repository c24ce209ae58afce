"""Language identification from short text with a character CNN; exports TorchScript for serving.

    torchrun --nproc_per_node=4 16_langid_charcnn_export.py --data_dir data/langid --out_dir runs/langid_cnn
"""
import argparse
import collections
import csv
import logging
import os
import random
import unicodedata

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

logger = logging.getLogger("langid")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True, help="train.tsv / dev.tsv / test.tsv with lang<TAB>text")
    ap.add_argument("--out_dir", default="runs/langid_cnn")
    ap.add_argument("--max_chars", type=int, default=160)
    ap.add_argument("--min_char_freq", type=int, default=50)
    ap.add_argument("--emb", type=int, default=64)
    ap.add_argument("--channels", type=int, default=256)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=8)
    return ap.parse_args()


def read_tsv(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for lang, text in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            text = unicodedata.normalize("NFC", text.strip())
            if len(text) >= 3:
                rows.append((lang, text))
    return rows


def build_char_vocab(rows, min_freq):
    counts = collections.Counter(ch for _, t in rows for ch in t)
    chars = sorted(ch for ch, c in counts.items() if c >= min_freq)
    return {ch: i + 2 for i, ch in enumerate(chars)}  # 0 = pad, 1 = unk


class CharDataset(Dataset):
    def __init__(self, rows, char2id, lang2id, max_chars):
        self.rows = [(lang2id[l], t) for l, t in rows if l in lang2id]
        self.char2id, self.max_chars = char2id, max_chars

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        y, text = self.rows[i]
        ids = [self.char2id.get(ch, 1) for ch in text[: self.max_chars]]
        ids += [0] * (self.max_chars - len(ids))
        return torch.tensor(ids), y


class CharCNN(nn.Module):
    def __init__(self, n_chars, n_langs, emb, channels):
        super().__init__()
        self.emb = nn.Embedding(n_chars, emb, padding_idx=0)
        self.convs = nn.ModuleList([nn.Conv1d(emb, channels, k, padding=k // 2) for k in (2, 3, 4, 5)])
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(4 * channels, n_langs)

    def forward(self, x):
        mask = (x != 0).unsqueeze(1)
        h = self.emb(x).transpose(1, 2)
        feats = []
        for conv in self.convs:
            c = F.relu(conv(h))[:, :, : x.size(1)]
            c = c.masked_fill(~mask, -1e4)
            feats.append(c.max(dim=2).values)
        return self.fc(self.drop(torch.cat(feats, dim=1)))


def accuracy(model, loader, device, reduce=True):
    model.eval()
    t = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            t[0] += (model(x).argmax(1) == y).sum()
            t[1] += y.numel()
    if reduce:
        dist.all_reduce(t)
    return (t[0] / t[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_rows = read_tsv(os.path.join(args.data_dir, "train.tsv"))
    dev_rows = read_tsv(os.path.join(args.data_dir, "dev.tsv"))
    test_rows = read_tsv(os.path.join(args.data_dir, "test.tsv"))
    char2id = build_char_vocab(train_rows, args.min_char_freq)
    langs = sorted({l for l, _ in train_rows})
    lang2id = {l: i for i, l in enumerate(langs)}
    logger.info("%d langs, %d chars, %d train rows", len(langs), len(char2id), len(train_rows))

    train_ds = CharDataset(train_rows, char2id, lang2id, args.max_chars)
    dev_ds = CharDataset(dev_rows, char2id, lang2id, args.max_chars)
    test_ds = CharDataset(test_rows, char2id, lang2id, args.max_chars)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True,
                          drop_last=True)
    dev_dl = DataLoader(dev_ds, batch_size=1024, sampler=DistributedSampler(dev_ds, shuffle=False), num_workers=2)

    model = CharCNN(len(char2id) + 2, len(langs), args.emb, args.channels).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))

    os.makedirs(args.out_dir, exist_ok=True)
    best_path = os.path.join(args.out_dir, "best.pt")
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        dev_acc = accuracy(model, dev_dl, device)
        logger.info("epoch %d loss %.4f dev_acc %.4f", epoch, loss.item(), dev_acc)
        if dev_acc > best:
            best = dev_acc
            if rank == 0:
                torch.save(model.state_dict(), best_path)
        dist.barrier()

    if rank == 0:
        # final test + export on a single GPU with a clean, unwrapped model
        export_model = CharCNN(len(char2id) + 2, len(langs), args.emb, args.channels).to(device)
        export_model.load_state_dict(torch.load(best_path, map_location=device))
        test_dl = DataLoader(test_ds, batch_size=1024, num_workers=2)
        test_acc = accuracy(export_model, test_dl, device, reduce=False)
        logger.info("best dev %.4f | test %.4f", best, test_acc)
        export_model.eval()
        scripted = torch.jit.script(export_model.cpu())
        scripted.save(os.path.join(args.out_dir, "langid_cnn.ts"))
        torch.save({"char2id": char2id, "langs": langs, "max_chars": args.max_chars},
                   os.path.join(args.out_dir, "vocab.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
