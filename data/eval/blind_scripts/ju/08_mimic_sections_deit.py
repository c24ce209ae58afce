#!/usr/bin/env python3
"""MIMIC-CXR findings generation from the raw report .txt files.

The free-text reports are parsed into sections once (FINDINGS, falling back to
IMPRESSION), tokenised into a word vocabulary and cached next to the data.

torchrun --nproc_per_node=8 08_mimic_sections_deit.py --mimic-root /data/mimic-cxr-jpg \
    --reports-root /data/mimic-cxr-reports --epochs 20
"""
import argparse
import os
import pickle
import re
from collections import Counter

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

SECTION_RE = re.compile(r"^\s*([A-Z][A-Z /]+):", re.MULTILINE)
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--mimic-root", required=True)
    p.add_argument("--reports-root", required=True)
    p.add_argument("--cache", default="cache/mimic_sections_v2.pkl")
    p.add_argument("--out", default="runs/deit_sections")
    p.add_argument("--min-freq", type=int, default=5)
    p.add_argument("--max-words", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=2e-4)
    return p.parse_args()


def extract_findings(text):
    parts, last, name = {}, 0, "PREAMBLE"
    for m in SECTION_RE.finditer(text):
        parts[name] = text[last:m.start()]
        name, last = m.group(1).strip(), m.end()
    parts[name] = text[last:]
    body = parts.get("FINDINGS") or parts.get("IMPRESSION") or ""
    body = re.sub(r"\s+", " ", body.lower())
    return re.sub(r"[^a-z0-9 .,]", "", body).strip()


def build_cache(args):
    split = pd.read_csv(os.path.join(args.mimic_root, "mimic-cxr-2.0.0-split.csv.gz"))
    meta = pd.read_csv(os.path.join(args.mimic_root, "mimic-cxr-2.0.0-metadata.csv.gz"))
    df = split.merge(meta[["dicom_id", "ViewPosition"]], on="dicom_id")
    df = df[df.ViewPosition.isin(["PA", "AP"])].drop_duplicates("study_id")
    texts = {}
    for sid, stid in zip(df.subject_id, df.study_id):
        path = os.path.join(args.reports_root, f"p{str(sid)[:2]}", f"p{sid}", f"s{stid}.txt")
        with open(path) as f:
            texts[stid] = extract_findings(f.read())
    df["text"] = df.study_id.map(texts)
    df = df[df.text.str.len() > 0]
    counts = Counter(w for t in df[df.split == "train"].text for w in t.split())
    itos = SPECIALS + sorted(w for w, c in counts.items() if c >= args.min_freq)
    stoi = {w: i for i, w in enumerate(itos)}
    df["ids"] = [[stoi.get(w, 3) for w in t.split()][: args.max_words] for t in df.text]
    df["image"] = [f"files/p{str(s)[:2]}/p{s}/s{st}/{d}.jpg"
                   for s, st, d in zip(df.subject_id, df.study_id, df.dicom_id)]
    return {"itos": itos, "records": df[["image", "ids", "split", "text"]].to_dict("records")}


def load_or_build(args):
    if os.path.exists(args.cache):
        with open(args.cache, "rb") as f:
            return pickle.load(f)
    data = build_cache(args)
    os.makedirs(os.path.dirname(args.cache), exist_ok=True)
    with open(args.cache, "wb") as f:
        pickle.dump(data, f)
    return data


class Studies(Dataset):
    def __init__(self, records, root, max_words, train):
        self.records, self.root, self.max_words = records, root, max_words
        tf = [transforms.Resize(256), transforms.RandomCrop(224) if train else transforms.CenterCrop(224),
              transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.25] * 3)]
        self.tf = transforms.Compose(tf)

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        rec = self.records[i]
        img = self.tf(Image.open(os.path.join(self.root, rec["image"])).convert("RGB"))
        ids = [1] + rec["ids"] + [2]
        ids = ids + [0] * (self.max_words + 2 - len(ids))
        return img, torch.tensor(ids)


class DeiTDecoder(nn.Module):
    def __init__(self, vocab, d=384, layers=4, max_len=102):
        super().__init__()
        self.enc = timm.create_model("deit_small_patch16_224.fb_in1k", pretrained=True, num_classes=0)
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Parameter(torch.zeros(1, max_len, d))
        self.dec = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(d, 6, 4 * d, 0.1, batch_first=True, norm_first=True), layers)
        self.out = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab))
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, img, tokens):
        mem = self.enc.forward_features(img)
        L = tokens.size(1)
        x = self.emb(tokens) + self.pos[:, :L]
        causal = nn.Transformer.generate_square_subsequent_mask(L, device=tokens.device)
        return self.out(self.dec(x, mem, tgt_mask=causal, tgt_key_padding_mask=tokens.eq(0)))


def run_epoch(model, loader, opt, device, train):
    model.train(train)
    stats = torch.zeros(2, device=device)
    for img, ids in loader:
        img, ids = img.to(device, non_blocking=True), ids.to(device, non_blocking=True)
        with torch.set_grad_enabled(train), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(img, ids[:, :-1])
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(),
                                   ignore_index=0, reduction="sum")
        n_tok = ids[:, 1:].ne(0).sum()
        if train:
            opt.zero_grad(set_to_none=True)
            (loss_sum / n_tok).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        stats += torch.stack([loss_sum.detach(), n_tok.float()])
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    data = load_or_build(args)
    recs = data["records"]
    train_ds = Studies([r for r in recs if r["split"] == "train"], args.mimic_root, args.max_words, True)
    val_ds = Studies([r for r in recs if r["split"] == "validate"], args.mimic_root, args.max_words, False)
    train_sampler = DistributedSampler(train_ds)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_part = Subset(val_ds, list(range(rank, len(val_ds), dist.get_world_size())))
    val_dl = DataLoader(val_part, args.batch_size, shuffle=False, num_workers=8, pin_memory=True)

    model = DeiTDecoder(len(data["itos"]), max_len=args.max_words + 2).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.02)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"vocab={len(data['itos'])} train={len(train_ds)} val={len(val_ds)}")

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tr = run_epoch(model, train_dl, opt, device, train=True)
        va = run_epoch(model, val_dl, opt, device, train=False)
        sched.step()
        if rank == 0:
            print(f"epoch {epoch:02d} train_nll {tr:.4f} val_nll {va:.4f} lr {sched.get_last_lr()[0]:.2e}")
            state = {"epoch": epoch, "model": model.module.state_dict(), "itos": data["itos"]}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if va < best:
                best = va
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
