"""Retrosynthesis transformer trained with HF Accelerate.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 \
        06_accelerate_retro_topk.py --data_dir data/USPTO_50K --output_dir runs/acc_retro
"""
import argparse
import math
import os
import pickle
import random
import re

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from rdkit import Chem, RDLogger
from torch.utils.data import DataLoader, Dataset

RDLogger.DisableLog("rdApp.*")
REGEX = re.compile(r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|\%[0-9]{2}|[0-9])")
PAD, BOS, EOS, UNK = 0, 1, 2, 3


def canon(smi, remove_map=True):
    mol = Chem.MolFromSmiles(smi)
    if mol is None:
        return ""
    if remove_map:
        for a in mol.GetAtoms():
            a.SetAtomMapNum(0)
    return Chem.MolToSmiles(mol)


def load_or_build_cache(data_dir):
    """Canonicalised (product, reactants, class) triples for each split, cached next to the raw csv."""
    cache = os.path.join(data_dir, "canonical_cache.pkl")
    if os.path.exists(cache):
        with open(cache, "rb") as f:
            return pickle.load(f)
    splits = {}
    for split in ("train", "val", "test"):
        df = pd.read_csv(os.path.join(data_dir, f"raw_{split}.csv"))
        rows = []
        for rxn, cls in zip(df["reactants>reagents>production"], df["class"]):
            reac, _, prod = rxn.split(">")
            p, r = canon(prod), canon(reac)
            if p and r:
                rows.append((p, r, int(cls)))
        splits[split] = rows
    tokens = sorted({t for rows in splits.values() for p, r, _ in rows for t in REGEX.findall(p + "." + r)})
    payload = {"splits": splits, "itos": ["<pad>", "<bos>", "<eos>", "<unk>"] + tokens}
    tmp = cache + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(payload, f)
    os.replace(tmp, cache)
    return payload


class RetroSet(Dataset):
    def __init__(self, rows, stoi, augment):
        self.rows, self.stoi, self.augment = rows, stoi, augment

    def __len__(self):
        return len(self.rows)

    def ids(self, smi):
        return [BOS] + [self.stoi.get(t, UNK) for t in REGEX.findall(smi)] + [EOS]

    def __getitem__(self, i):
        prod, reac, _ = self.rows[i]
        if self.augment:
            m = Chem.MolFromSmiles(prod)
            prod = Chem.MolToSmiles(m, doRandom=True, canonical=False)
            reac = ".".join(random.sample(reac.split("."), k=len(reac.split("."))))
        return {"src": torch.tensor(self.ids(prod)), "tgt": torch.tensor(self.ids(reac)), "idx": i}


def collate(batch):
    return {
        "src": nn.utils.rnn.pad_sequence([b["src"] for b in batch], batch_first=True, padding_value=PAD),
        "tgt": nn.utils.rnn.pad_sequence([b["tgt"] for b in batch], batch_first=True, padding_value=PAD),
        "idx": torch.tensor([b["idx"] for b in batch]),
    }


class Transformer(nn.Module):
    def __init__(self, vocab, d=256, layers=6, heads=8, ff=2048, drop=0.1):
        super().__init__()
        self.d = d
        self.tok = nn.Embedding(vocab, d, padding_idx=PAD)
        self.register_buffer("pe", self._sinusoid(1024, d), persistent=False)
        self.model = nn.Transformer(d, heads, layers, layers, ff, drop, batch_first=True)
        self.out = nn.Linear(d, vocab)

    @staticmethod
    def _sinusoid(n, d):
        pos = torch.arange(n).float()[:, None]
        i = torch.arange(0, d, 2).float()
        ang = pos / torch.pow(10000, i / d)
        return torch.stack([ang.sin(), ang.cos()], -1).flatten(1)

    def emb(self, x):
        return self.tok(x) * math.sqrt(self.d) + self.pe[: x.size(1)]

    def encode(self, src):
        return self.model.encoder(self.emb(src), src_key_padding_mask=src.eq(PAD))

    def decode(self, tgt, mem, mem_pad):
        mask = self.model.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        h = self.model.decoder(self.emb(tgt), mem, tgt_mask=mask, tgt_key_padding_mask=tgt.eq(PAD),
                               memory_key_padding_mask=mem_pad)
        return self.out(h)

    def forward(self, src, tgt):
        return self.decode(tgt, self.encode(src), src.eq(PAD))

    @torch.no_grad()
    def beam_search(self, src, k=10, max_len=200):
        B, dev = src.size(0), src.device
        mem, mpad = self.encode(src).repeat_interleave(k, 0), src.eq(PAD).repeat_interleave(k, 0)
        ys = torch.full((B * k, 1), BOS, device=dev)
        score = torch.full((B, k), -1e9, device=dev)
        score[:, 0] = 0
        fin = torch.zeros(B * k, dtype=torch.bool, device=dev)
        for _ in range(max_len):
            lp = F.log_softmax(self.decode(ys, mem, mpad)[:, -1].float(), -1)
            lp[fin] = -1e9
            lp[fin, PAD] = 0
            V = lp.size(-1)
            score, flat = (score.view(-1, 1) + lp).view(B, -1).topk(k, -1)
            parent = (torch.div(flat, V, rounding_mode="floor") + torch.arange(B, device=dev)[:, None] * k).view(-1)
            ys = torch.cat([ys[parent], (flat % V).view(-1, 1)], 1)
            fin = fin[parent] | ys[:, -1].eq(EOS)
            if fin.all():
                break
        return ys.view(B, k, -1)


def decode_ids(ids, itos):
    out = []
    for t in ids[1:]:
        if t == EOS:
            break
        if t != PAD:
            out.append(itos[t])
    return "".join(out)


def evaluate(accelerator, model, loader, rows, itos, beam):
    model.eval()
    net = accelerator.unwrap_model(model)
    ranks = []
    for batch in loader:
        with accelerator.autocast():
            beams = net.beam_search(batch["src"], k=beam)
        first = torch.full((beams.size(0),), -1, device=beams.device)
        for b, i in enumerate(batch["idx"].tolist()):
            gold = rows[i][1]
            for j, seq in enumerate(beams[b].tolist()):
                if canon(decode_ids(seq, itos), remove_map=False) == gold:
                    first[b] = j
                    break
        ranks.append(accelerator.gather_for_metrics(first))
    ranks = torch.cat(ranks)
    found = ranks.ge(0)
    return {f"top{k}": (found & ranks.lt(k)).float().mean().item() for k in (1, 3, 5, 10) if k <= beam}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--output_dir", default="runs/acc_retro")
    ap.add_argument("--epochs", type=int, default=250)
    ap.add_argument("--per_device_batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--beam", type=int, default=10)
    ap.add_argument("--eval_every", type=int, default=25)
    ap.add_argument("--resume_from", default=None)
    args = ap.parse_args()

    accelerator = Accelerator(log_with="tensorboard", project_dir=args.output_dir)
    set_seed(1234)
    accelerator.init_trackers("retro", config=vars(args))

    with accelerator.main_process_first():
        data = load_or_build_cache(args.data_dir)
    itos = data["itos"]
    stoi = {t: i for i, t in enumerate(itos)}
    train_rows, val_rows = data["splits"]["train"], data["splits"]["val"]

    train_dl = DataLoader(RetroSet(train_rows, stoi, True), batch_size=args.per_device_batch, shuffle=True,
                          collate_fn=collate, num_workers=6, drop_last=True)
    val_dl = DataLoader(RetroSet(val_rows, stoi, False), batch_size=32, shuffle=False, collate_fn=collate,
                        num_workers=2)
    model = Transformer(len(itos))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, opt, train_dl, val_dl = accelerator.prepare(model, opt, train_dl, val_dl)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))
    accelerator.register_for_checkpointing(sched)
    loss_fn = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1)

    start = 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        start = int(os.path.basename(args.resume_from.rstrip("/")).split("_")[-1]) + 1

    step = start * len(train_dl)
    for epoch in range(start, args.epochs):
        model.train()
        train_dl.set_epoch(epoch)
        for batch in train_dl:
            logits = model(batch["src"], batch["tgt"][:, :-1])
            loss = loss_fn(logits.reshape(-1, logits.size(-1)), batch["tgt"][:, 1:].reshape(-1))
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            if step % 100 == 0:
                accelerator.log({"train_loss": accelerator.reduce(loss.detach(), "mean").item()}, step=step)

        if (epoch + 1) % args.eval_every == 0:
            metrics = evaluate(accelerator, model, val_dl, val_rows, itos, args.beam)
            accelerator.log(metrics, step=step)
            accelerator.print(f"epoch {epoch}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save({"model": accelerator.unwrap_model(model).state_dict(), "itos": itos},
                   os.path.join(args.output_dir, "final.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
