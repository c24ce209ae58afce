"""Attention-based (transformer decoder) text-line recognizer for scanned invoices.

    torchrun --nproc_per_node=4 10_attn_recognizer_invoices.py --cfg configs/invoice_lines.yaml
"""
import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field

import editdistance
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

PAD, BOS, EOS = 0, 1, 2


@dataclass
class Config:
    train_jsonl: str = "data/invoice_lines/train.jsonl"
    val_jsonl: str = "data/invoice_lines/val.jsonl"
    vocab: str = "data/invoice_lines/vocab.txt"
    out_dir: str = "runs/attn_rec"
    height: int = 32
    width: int = 384
    max_len: int = 64
    d_model: int = 384
    layers: int = 4
    batch: int = 96
    epochs: int = 30
    lr: float = 4e-4
    warmup: int = 2000
    workers: int = 6
    extra: dict = field(default_factory=dict)


class Vocab:
    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            chars = [l.rstrip("\n") for l in f if l.rstrip("\n")]
        self.itos = ["<pad>", "<s>", "</s>"] + chars
        self.stoi = {c: i for i, c in enumerate(self.itos)}

    def encode(self, s, max_len):
        ids = [BOS] + [self.stoi[c] for c in s if c in self.stoi][: max_len - 2] + [EOS]
        return ids + [PAD] * (max_len - len(ids))

    def decode(self, ids):
        out = []
        for i in ids:
            if i == EOS:
                break
            if i > EOS:
                out.append(self.itos[i])
        return "".join(out)


class LineDataset(Dataset):
    def __init__(self, jsonl, vocab, cfg, train):
        with open(jsonl, encoding="utf-8") as f:
            self.items = [json.loads(l) for l in f]
        self.vocab, self.cfg = vocab, cfg
        aug = [T.RandomApply([T.ColorJitter(0.3, 0.3)], p=0.5), T.RandomAffine(1.5, shear=5, fill=255)] if train else []
        self.tf = T.Compose(aug + [T.Resize((cfg.height, cfg.width)), T.ToTensor(), T.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        img = Image.open(it["image"]).convert("L")
        return self.tf(img), torch.tensor(self.vocab.encode(it["text"], self.cfg.max_len)), i


class Recognizer(nn.Module):
    def __init__(self, n_vocab, d=384, layers=4, max_len=64):
        super().__init__()

        def block(cin, cout, pool):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1), nn.GroupNorm(16, cout), nn.GELU(), nn.MaxPool2d(pool))

        self.backbone = nn.Sequential(block(1, 64, 2), block(64, 128, 2), block(128, 256, (2, 1)),
                                      block(256, d, (4, 2)))  # -> B, d, 1, W/8
        self.enc_pos = nn.Parameter(torch.zeros(1, 64, d))
        enc_layer = nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, 2)
        self.embed = nn.Embedding(n_vocab, d, padding_idx=PAD)
        self.dec_pos = nn.Parameter(torch.zeros(1, max_len, d))
        dec_layer = nn.TransformerDecoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(dec_layer, layers)
        self.head = nn.Linear(d, n_vocab)
        nn.init.trunc_normal_(self.enc_pos, std=0.02)
        nn.init.trunc_normal_(self.dec_pos, std=0.02)

    def encode(self, x):
        f = self.backbone(x).squeeze(2).transpose(1, 2)
        return self.encoder(f + self.enc_pos[:, : f.shape[1]])

    def decode(self, memory, tgt):
        L = tgt.shape[1]
        mask = torch.triu(torch.full((L, L), float("-inf"), device=tgt.device), 1)
        h = self.embed(tgt) + self.dec_pos[:, :L]
        return self.head(self.decoder(h, memory, tgt_mask=mask, tgt_key_padding_mask=tgt == PAD))

    def forward(self, x, tgt_in):
        return self.decode(self.encode(x), tgt_in)

    @torch.no_grad()
    def greedy(self, x, max_len):
        memory = self.encode(x)
        ys = torch.full((x.shape[0], 1), BOS, dtype=torch.long, device=x.device)
        for _ in range(max_len - 1):
            nxt = self.decode(memory, ys)[:, -1].argmax(-1, keepdim=True)
            ys = torch.cat([ys, nxt], 1)
            if (ys == EOS).any(1).all():
                break
        return ys[:, 1:]


def lr_lambda(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def evaluate(model, loader, vocab, cfg, device, rank, world):
    model.eval()
    all_pred, all_idx = [], []
    for x, _, idx in loader:
        pred = model.module.greedy(x.to(device, non_blocking=True), cfg.max_len)
        idx = idx.to(device)
        pred_list = [torch.empty_like(pred) for _ in range(world)]
        idx_list = [torch.empty_like(idx) for _ in range(world)]
        dist.all_gather(pred_list, pred)
        dist.all_gather(idx_list, idx)
        if rank == 0:
            for p, i in zip(pred_list, idx_list):
                all_pred += p.cpu().tolist()
                all_idx += i.cpu().tolist()
    model.train()
    if rank != 0:
        return None
    seen, edits, chars, exact = set(), 0, 0, 0
    for ids, i in zip(all_pred, all_idx):
        if i in seen:  # DistributedSampler repeats a few samples to even out the shards
            continue
        seen.add(i)
        hyp, ref = vocab.decode(ids), loader.dataset.items[i]["text"]
        edits += editdistance.eval(hyp, ref)
        chars += len(ref)
        exact += hyp == ref
    return {"cer": edits / max(chars, 1), "acc": exact / max(len(seen), 1), "n": len(seen)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cli = ap.parse_args()
    cfg = Config()
    if cli.cfg:
        with open(cli.cfg) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    torch.manual_seed(0)

    vocab = Vocab(cfg.vocab)
    train_ds = LineDataset(cfg.train_jsonl, vocab, cfg, train=True)
    val_ds = LineDataset(cfg.val_jsonl, vocab, cfg, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, cfg.batch, sampler=train_sampler, num_workers=cfg.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 128, sampler=val_sampler, num_workers=cfg.workers, pin_memory=True)

    model = Recognizer(len(vocab.itos), cfg.d_model, cfg.layers, cfg.max_len).to(device)
    model = DDP(model, device_ids=[local])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.05)
    total = cfg.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, cfg.warmup, total))
    crit = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1)

    best = float("inf")
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (x, tgt, _) in enumerate(train_dl):
            x, tgt = x.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, tgt[:, :-1])
                loss = crit(logits.float().reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        metrics = evaluate(model, val_dl, vocab, cfg, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} val {metrics} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"model": model.module.state_dict(), "vocab": vocab.itos, "cfg": cfg.__dict__},
                       os.path.join(cfg.out_dir, "last.pt"))
            if metrics["cer"] < best:
                best = metrics["cer"]
                torch.save({"model": model.module.state_dict(), "vocab": vocab.itos, "cfg": cfg.__dict__},
                           os.path.join(cfg.out_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
