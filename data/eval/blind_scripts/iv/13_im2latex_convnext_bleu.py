"""im2latex-100k with a ConvNeXt-T encoder (timm, features only) and a Transformer decoder.
Validation: batched beam search, BLEU-4 and exact match; LR reduced on BLEU plateau.

    torchrun --nproc_per_node=4 13_im2latex_convnext_bleu.py --root data/im2latex-100k
"""
import argparse
import os
import random

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from nltk.translate.bleu_score import corpus_bleu
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def args_parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="data/im2latex-100k")
    ap.add_argument("--out", default="work_dirs/convnext_tf")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--max_len", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def seed_all(s):
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


class Data(Dataset):
    def __init__(self, root, split, stoi, max_len):
        forms = open(os.path.join(root, "im2latex_formulas.norm.lst"), encoding="latin-1").read().split("\n")
        self.items = []
        for line in open(os.path.join(root, f"im2latex_{split}_filter.lst")):
            img, k = line.split()
            toks = forms[int(k)].split()
            if 0 < len(toks) <= max_len - 2:
                self.items.append((img, toks))
        self.root, self.stoi = root, stoi

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img, toks = self.items[i]
        a = np.array(Image.open(os.path.join(self.root, "formula_images_processed", img)).convert("L"), np.float32)
        x = torch.from_numpy((a / 255.0 - 0.5) / 0.5)[None].repeat(3, 1, 1)
        y = torch.tensor([1] + [self.stoi.get(t, 3) for t in toks] + [2])
        return x, y


def collate(b):
    xs, ys = zip(*b)
    H = max(x.shape[1] for x in xs)
    W = max(x.shape[2] for x in xs)
    H, W = (H + 31) // 32 * 32, (W + 31) // 32 * 32
    out = torch.ones(len(xs), 3, H, W)
    for i, x in enumerate(xs):
        out[i, :, : x.shape[1], : x.shape[2]] = x
    return out, nn.utils.rnn.pad_sequence(ys, batch_first=True)


class ConvNeXtLatex(nn.Module):
    def __init__(self, vocab, d=384, layers=4, max_len=160):
        super().__init__()
        self.backbone = timm.create_model("convnext_tiny", pretrained=False, features_only=True, out_indices=(2,))
        self.proj = nn.Linear(self.backbone.feature_info.channels()[-1], d)
        self.h_pos = nn.Embedding(64, d)
        self.w_pos = nn.Embedding(256, d)
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 4 * d, 0.1, batch_first=True,
                                                                    norm_first=True), layers)
        self.lm = nn.Linear(d, vocab)

    def encode(self, x):
        f = self.backbone(x)[-1].permute(0, 2, 3, 1)          # B, H/16, W/16, C
        _, H, W, _ = f.shape
        pe = self.h_pos.weight[:H, None] + self.w_pos.weight[None, :W]
        return (self.proj(f) + pe).flatten(1, 2)

    def logits(self, mem, y):
        L = y.shape[1]
        m = torch.triu(torch.ones(L, L, dtype=torch.bool, device=y.device), 1)
        return self.lm(self.dec(self.emb(y) + self.pos.weight[:L], mem, tgt_mask=m))

    def forward(self, x, y):
        return self.logits(self.encode(x), y)

    @torch.no_grad()
    def beam(self, x, k, max_len, eos=2):
        B = x.shape[0]
        mem = self.encode(x).repeat_interleave(k, 0)                  # B*k, N, d
        y = torch.ones(B * k, 1, dtype=torch.long, device=x.device)
        score = torch.full((B, k), float("-inf"), device=x.device)
        score[:, 0] = 0.0
        score = score.view(-1)
        alive = torch.ones(B * k, dtype=torch.bool, device=x.device)
        for _ in range(max_len - 1):
            lp = self.logits(mem, y)[:, -1].log_softmax(-1)           # B*k, V
            V = lp.shape[-1]
            lp[~alive] = float("-inf")
            lp[~alive, 0] = 0.0                                       # finished beams only extend with pad
            cand = (score[:, None] + lp).view(B, k * V)
            top, idx = cand.topk(k, -1)
            src = (idx // V) + torch.arange(B, device=x.device)[:, None] * k
            tok = idx % V
            y = torch.cat([y[src.view(-1)], tok.view(-1, 1)], 1)
            alive = alive[src.view(-1)] & (tok.view(-1) != eos)
            score = top.view(-1)
            if not alive.any():
                break
        best = score.view(B, k).argmax(-1) + torch.arange(B, device=x.device) * k
        return y[best]


def strip(ids, itos):
    toks = []
    for i in ids[1:]:
        if i == 2:
            break
        if i > 3:
            toks.append(itos[i])
    return toks


def validate(model, loader, itos, a, device):
    model.eval()
    hyps, refs = [], []
    for x, y in loader:
        pred = model.module.beam(x.to(device), a.beam, a.max_len)
        for p, t in zip(pred.tolist(), y.tolist()):
            hyps.append(strip(p, itos))
            refs.append([strip(t, itos)])
    model.train()
    bleu = corpus_bleu(refs, hyps)
    em = float(np.mean([h == r[0] for h, r in zip(hyps, refs)]))
    return bleu, em


def main():
    a = args_parser()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    seed_all(a.seed)

    itos = ["<pad>", "<s>", "</s>", "<unk>"] + open(os.path.join(a.root, "vocab.txt")).read().split()
    stoi = {t: i for i, t in enumerate(itos)}
    tr, va = Data(a.root, "train", stoi, a.max_len), Data(a.root, "validate", stoi, a.max_len)
    tr_sampler = DistributedSampler(tr, shuffle=True, seed=a.seed)
    va_sampler = DistributedSampler(va, shuffle=False)
    tr_dl = DataLoader(tr, a.bs, sampler=tr_sampler, collate_fn=collate, num_workers=8, pin_memory=True,
                       drop_last=True)
    va_dl = DataLoader(va, 16, sampler=va_sampler, collate_fn=collate, num_workers=4, pin_memory=True)

    model = DDP(ConvNeXtLatex(len(itos), max_len=a.max_len).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.05)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=2)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)

    best = 0.0
    for ep in range(a.epochs):
        tr_sampler.set_epoch(ep)
        model.train()
        agg, n = 0.0, 0
        for it, (x, y) in enumerate(tr_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                lg = model(x, y[:, :-1])
            loss = F.cross_entropy(lg.float().transpose(1, 2), y[:, 1:], ignore_index=0, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
            agg += loss.item()
            n += 1
            if rank == 0 and it % 200 == 0:
                print(f"ep {ep} it {it} loss {agg / n:.4f}", flush=True)

        bleu, em = validate(model, va_dl, itos, a, device)
        plateau.step(bleu)
        if rank == 0:
            print(f"ep {ep} | val BLEU-4 {bleu * 100:.2f} | exact match {em * 100:.2f} | "
                  f"lr {opt.param_groups[0]['lr']:.2e}", flush=True)
            torch.save({"model": model.module.state_dict(), "ep": ep, "bleu": bleu, "itos": itos},
                       os.path.join(a.out, "latest.pth"))
            if bleu > best:
                best = bleu
                torch.save({"model": model.module.state_dict(), "ep": ep, "bleu": bleu, "itos": itos},
                           os.path.join(a.out, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
