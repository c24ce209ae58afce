"""Character-level LM on folk tunes in ABC notation (The Session dump, ~45k tunes).

Tunes are separated by blank lines in a single text file. Header fields (X:, T:) are
stripped; M:, L:, K: and the body are kept.

    torchrun --nproc_per_node=4 18_abc_notation_lm.py --abc data/thesession_tunes.abc --out runs/abc_char
"""
import argparse
import json
import math
import os
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel

DROP_FIELDS = re.compile(r"^(X|T|Z|S|N|H|R|B|D|F|O|W|w):")


def read_tunes(path):
    with open(path, encoding="utf-8", errors="ignore") as f:
        blocks = f.read().split("\n\n")
    tunes = []
    for b in blocks:
        lines = [l for l in b.strip().splitlines() if l and not DROP_FIELDS.match(l)]
        if any(l.startswith("K:") for l in lines) and len(lines) > 2:
            tunes.append("\n".join(lines))
    return tunes


class ABCTokenizer:
    """Characters of the corpus + <pad>, <bos>, <eos> appended after them."""

    def __init__(self, chars):
        self.chars = sorted(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.pad_id = len(self.chars)
        self.bos_id = len(self.chars) + 1
        self.eos_id = len(self.chars) + 2

    @property
    def vocab_size(self):
        return len(self.chars) + 2

    @classmethod
    def from_tunes(cls, tunes):
        return cls(set("".join(tunes)))

    def encode(self, s):
        return [self.bos_id] + [self.stoi[c] for c in s if c in self.stoi] + [self.eos_id]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids if i < len(self.chars))

    def save(self, path):
        with open(path, "w") as f:
            json.dump({"chars": self.chars}, f)


class TuneDataset(Dataset):
    def __init__(self, tunes, tok, max_len):
        self.data = [tok.encode(t)[: max_len + 1] for t in tunes]
        self.max_len, self.pad = max_len, tok.pad_id

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        ids = self.data[i]
        x = torch.full((self.max_len + 1,), self.pad, dtype=torch.long)
        x[:len(ids)] = torch.tensor(ids)
        return x


def lm_batch(x, pad):
    inp, tgt = x[:, :-1], x[:, 1:].clone()
    tgt[tgt == pad] = -100
    return inp, tgt, (inp != pad).long()


@torch.no_grad()
def evaluate(model, loader, pad, device):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for x in loader:
        inp, tgt, att = lm_batch(x.to(device), pad)
        logits = model(input_ids=inp, attention_mask=att).logits
        tot[0] += F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100, reduction="sum")
        tot[1] += (tgt != -100).sum()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--abc", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--val_every", type=int, default=40, help="every n-th tune goes to validation")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    tunes = read_tunes(args.abc)
    tok = ABCTokenizer.from_tunes(tunes)  # sorted char set: identical on every rank
    val_tunes = tunes[::args.val_every]
    train_tunes = [t for i, t in enumerate(tunes) if i % args.val_every]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        tok.save(os.path.join(args.out, "vocab.json"))
        print(f"{len(train_tunes)} train / {len(val_tunes)} val tunes, vocab {tok.vocab_size}", flush=True)

    train_ds = TuneDataset(train_tunes, tok, args.max_len)
    val_ds = TuneDataset(val_tunes[rank::world], tok, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size)

    cfg = GPT2Config(vocab_size=tok.vocab_size, n_positions=args.max_len, n_embd=512, n_layer=8, n_head=8,
                     bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = GPT2LMHeadModel(cfg).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.98))
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))

    best = math.inf
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for it, x in enumerate(train_dl):
            inp, tgt, att = lm_batch(x.to(device, non_blocking=True), tok.pad_id)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(input_ids=inp, attention_mask=att).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

        val = evaluate(model, val_dl, tok.pad_id, device)
        if rank == 0:
            print(f"epoch {epoch} val loss {val:.4f} ({val / math.log(2):.3f} bits/char)", flush=True)
            if val < best:
                best = val
                model.save_pretrained(os.path.join(args.out, "best"))
            # a short sample so we can eyeball the tunes
            model.eval()
            prompt = torch.tensor([[tok.bos_id] + [tok.stoi[c] for c in "M:6/8\nK:D\n"]], device=device)
            out = model.generate(prompt, do_sample=True, top_k=20, max_new_tokens=400,
                                 eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
            model.train()
            print(tok.decode(out[0].tolist()), flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
