"""Train a product->reactants transformer, keep the best checkpoint by validation
token accuracy, then score the best checkpoint on the test split with beam search.

    torchrun --nproc_per_node=4 19_retro_beam_test.py --data_dir data/uspto50k_tok --work_dir work/retro_tf
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rdkit import Chem, RDLogger
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")


class Vocab:
    def __init__(self, path):
        with open(path) as f:
            self.itos = [line.rstrip("\n").split("\t")[0] for line in f]
        self.stoi = {t: i for i, t in enumerate(self.itos)}
        self.pad, self.bos, self.eos, self.unk = 0, 1, 2, 3

    def __len__(self):
        return len(self.itos)

    def encode(self, tokens):
        return [self.bos] + [self.stoi.get(t, self.unk) for t in tokens] + [self.eos]

    def to_smiles(self, ids):
        out = []
        for t in ids[1:]:
            if t == self.eos:
                break
            if t > self.unk:
                out.append(self.itos[t])
        return "".join(out)


class TokFiles(Dataset):
    def __init__(self, data_dir, split, vocab):
        with open(os.path.join(data_dir, f"src-{split}.txt")) as f:
            self.src = [l.split() for l in f]
        with open(os.path.join(data_dir, f"tgt-{split}.txt")) as f:
            self.tgt = [l.split() for l in f]
        self.vocab = vocab

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return torch.tensor(self.vocab.encode(self.src[i])), torch.tensor(self.vocab.encode(self.tgt[i])), i


def collate(batch):
    s, t, i = zip(*batch)
    return nn.utils.rnn.pad_sequence(s, True), nn.utils.rnn.pad_sequence(t, True), torch.tensor(i)


class TransformerRetro(nn.Module):
    def __init__(self, V, d_model=256, nhead=8, layers=6, ff=2048, dropout=0.1):
        super().__init__()
        self.d_model = d_model
        self.embedding = nn.Embedding(V, d_model, padding_idx=0)
        pe = torch.zeros(1024, d_model)
        pos = torch.arange(1024).float().unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe)
        self.transformer = nn.Transformer(d_model, nhead, layers, layers, ff, dropout, batch_first=True)
        self.generator = nn.Linear(d_model, V)

    def embed(self, x):
        return self.embedding(x) * math.sqrt(self.d_model) + self.pe[: x.size(1)]

    def encode(self, src):
        return self.transformer.encoder(self.embed(src), src_key_padding_mask=src.eq(0))

    def decode(self, tgt, memory, src_pad):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        out = self.transformer.decoder(self.embed(tgt), memory, tgt_mask=mask, tgt_key_padding_mask=tgt.eq(0),
                                       memory_key_padding_mask=src_pad)
        return self.generator(out)

    def forward(self, src, tgt):
        return self.decode(tgt, self.encode(src), src.eq(0))


@torch.no_grad()
def beam_search(net, src, k, max_len=200):
    B, dev = src.size(0), src.device
    mem, sp = net.encode(src).repeat_interleave(k, 0), src.eq(0).repeat_interleave(k, 0)
    seq = torch.ones(B * k, 1, dtype=torch.long, device=dev)
    score = torch.full((B, k), float("-inf"), device=dev)
    score[:, 0] = 0.0
    ended = torch.zeros(B * k, dtype=torch.bool, device=dev)
    for _ in range(max_len):
        lp = F.log_softmax(net.decode(seq, mem, sp)[:, -1], -1)
        lp[ended] = float("-inf")
        lp[ended, 0] = 0.0
        V = lp.size(1)
        score, flat = (score.view(-1, 1) + lp).view(B, -1).topk(k, -1)
        parent = (torch.div(flat, V, rounding_mode="floor") + torch.arange(B, device=dev)[:, None] * k).view(-1)
        seq = torch.cat([seq[parent], (flat % V).view(-1, 1)], 1)
        ended = ended[parent] | seq[:, -1].eq(2)
        if ended.all():
            break
    return seq.view(B, k, -1)


def canon(s):
    m = Chem.MolFromSmiles(s)
    return Chem.MolToSmiles(m) if m is not None else None


@torch.no_grad()
def token_accuracy(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for src, tgt, _ in loader:
        src, tgt = src.to(device), tgt.to(device)
        pred = model(src, tgt[:, :-1]).argmax(-1)
        gold = tgt[:, 1:]
        c[0] += (pred.eq(gold) & gold.ne(0)).sum()
        c[1] += gold.ne(0).sum()
    dist.all_reduce(c)
    model.train()
    return (c[0] / c[1]).item()


@torch.no_grad()
def test_topk(net, loader, ds, vocab, device, k, ks=(1, 3, 5, 10)):
    net.eval()
    c = torch.zeros(len(ks) + 1, device=device)
    for src, _, idx in loader:
        beams = beam_search(net, src.to(device), k).tolist()
        for cand, i in zip(beams, idx.tolist()):
            gold = canon("".join(ds.tgt[i]))
            preds = [canon(vocab.to_smiles(s)) for s in cand]
            first = preds.index(gold) if gold in preds else k
            for j, kk in enumerate(ks):
                c[j] += float(first < kk)
            c[-1] += 1
    dist.all_reduce(c)
    return {f"top{kk}": (c[j] / c[-1]).item() for j, kk in enumerate(ks)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--work_dir", default="work/retro_tf")
    ap.add_argument("--epochs", type=int, default=250)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--beam", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2024)

    vocab = Vocab(os.path.join(args.data_dir, "vocab.txt"))
    splits = {s: TokFiles(args.data_dir, s, vocab) for s in ("train", "val", "test")}
    train_sampler = DistributedSampler(splits["train"], shuffle=True)
    train_dl = DataLoader(splits["train"], args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(splits["val"], 128, sampler=DistributedSampler(splits["val"], shuffle=False),
                        collate_fn=collate, num_workers=2)
    test_dl = DataLoader(splits["test"], 32, sampler=DistributedSampler(splits["test"], shuffle=False),
                         collate_fn=collate, num_workers=2)

    model = DDP(TransformerRetro(len(vocab)).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.998), eps=1e-9)
    crit = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
    best_path = os.path.join(args.work_dir, "best_model.pt")
    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for src, tgt, _ in train_dl:
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            logits = model(src, tgt[:, :-1])
            loss = crit(logits.flatten(0, 1), tgt[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        acc = token_accuracy(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} val_tok_acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if acc > best:
                best = acc
                torch.save(model.state_dict(), best_path)
                print(f"  new best, saved to {best_path}", flush=True)
    dist.barrier()

    net = TransformerRetro(len(vocab)).to(device)
    net.load_state_dict(torch.load(best_path, map_location=device))
    results = test_topk(net, test_dl, splits["test"], vocab, device, args.beam)
    if rank == 0:
        print("test " + " ".join(f"{k}={v:.4f}" for k, v in results.items()), flush=True)
        with open(os.path.join(args.work_dir, "test_results.json"), "w") as f:
            json.dump(results, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
