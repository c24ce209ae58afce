"""SELFIES-to-SELFIES retrosynthesis transformer (USPTO-50k), tracked in W&B.

Products are randomised as SMILES each time they are drawn, then encoded to
SELFIES, so every epoch sees different strings for the same molecule.

    torchrun --nproc_per_node 4 05_selfies_retro.py --data data/uspto50k --run-name selfies-retro-b
"""
import argparse
import math
import os
import random

import pandas as pd
import selfies as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from rdkit import Chem, RDLogger
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")
SPECIAL = ["[nop]", "[BOS]", "[EOS]", "[UNK]"]


def to_selfies(smi, randomize=False):
    mol = Chem.MolFromSmiles(smi)
    if mol is None:
        return None
    smi = Chem.MolToSmiles(mol, doRandom=randomize, canonical=not randomize)
    try:
        return sf.encoder(smi)
    except sf.EncoderError:
        return None


def selfies_to_canonical(s):
    try:
        mol = Chem.MolFromSmiles(sf.decoder(s))
    except sf.DecoderError:
        return None
    return Chem.MolToSmiles(mol) if mol is not None else None


def load_pairs(path):
    df = pd.read_csv(path)
    pairs = []
    for rxn in df["reactants>reagents>production"]:
        reac, _, prod = rxn.split(">")
        mp, mr = Chem.MolFromSmiles(prod), Chem.MolFromSmiles(reac)
        if mp is None or mr is None:
            continue
        for m in (mp, mr):
            for a in m.GetAtoms():
                a.SetAtomMapNum(0)
        pairs.append((Chem.MolToSmiles(mp), Chem.MolToSmiles(mr)))
    return pairs


class SelfiesRetro(Dataset):
    def __init__(self, pairs, stoi, augment):
        self.pairs, self.stoi, self.augment = pairs, stoi, augment

    def __len__(self):
        return len(self.pairs)

    def _encode(self, s):
        return [1] + [self.stoi.get(t, 3) for t in sf.split_selfies(s)] + [2]

    def __getitem__(self, i):
        prod, reac = self.pairs[i]
        src = to_selfies(prod, randomize=self.augment and random.random() < 0.8) or to_selfies(prod)
        tgt = to_selfies(reac)
        return torch.tensor(self._encode(src)), torch.tensor(self._encode(tgt)), i


def collate(batch):
    s, t, i = zip(*batch)
    return (nn.utils.rnn.pad_sequence(s, batch_first=True), nn.utils.rnn.pad_sequence(t, batch_first=True),
            torch.tensor(i))


class Model(nn.Module):
    def __init__(self, n_tok, d=256, heads=8, layers=6, drop=0.1, max_len=300):
        super().__init__()
        self.d = d
        self.emb = nn.Embedding(n_tok, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)
        self.tf = nn.Transformer(d, heads, layers, layers, 4 * d, drop, batch_first=True)
        self.fc = nn.Linear(d, n_tok)

    def _e(self, x):
        return self.emb(x) * math.sqrt(self.d) + self.pos(torch.arange(x.size(1), device=x.device))

    def encode(self, src):
        return self.tf.encoder(self._e(src), src_key_padding_mask=src.eq(0))

    def decode(self, tgt, mem, src_pad):
        m = self.tf.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        return self.fc(self.tf.decoder(self._e(tgt), mem, tgt_mask=m, tgt_key_padding_mask=tgt.eq(0),
                                       memory_key_padding_mask=src_pad))

    def forward(self, src, tgt):
        return self.decode(tgt, self.encode(src), src.eq(0))


@torch.no_grad()
def beam_decode(model, src, k, max_len=200):
    B = src.size(0)
    mem = model.encode(src).repeat_interleave(k, 0)
    pad = src.eq(0).repeat_interleave(k, 0)
    seq = src.new_ones(B * k, 1)
    logp_sum = src.new_zeros(B, k, dtype=torch.float)
    logp_sum[:, 1:] = -1e9
    alive = torch.ones(B * k, dtype=torch.bool, device=src.device)
    base = torch.arange(B, device=src.device).unsqueeze(1) * k
    for _ in range(max_len):
        lp = F.log_softmax(model.decode(seq, mem, pad)[:, -1], -1)
        lp[~alive] = -1e9
        lp[~alive, 0] = 0.0
        V = lp.size(1)
        logp_sum, pos = (logp_sum.view(-1, 1) + lp).view(B, -1).topk(k, -1)
        src_beam = (pos // V + base).view(-1)
        tok = (pos % V).view(-1)
        seq = torch.cat([seq[src_beam], tok[:, None]], 1)
        alive = alive[src_beam] & tok.ne(2)
        if not alive.any():
            break
    return seq.view(B, k, -1)


def topk_accuracy(model, loader, dataset, itos, device, beam):
    model.eval()
    ks = [1, 3, 5, 10]
    hits = torch.zeros(len(ks) + 1, device=device)
    for src, _, idx in loader:
        beams = beam_decode(model, src.to(device), beam)
        for b, i in enumerate(idx.tolist()):
            gold = dataset.pairs[i][1]
            preds = []
            for seq in beams[b].tolist():
                toks = [itos[t] for t in seq[1:] if t not in (0, 1, 2)]
                preds.append(selfies_to_canonical("".join(toks)))
            first = next((j for j, p in enumerate(preds) if p == gold), None)
            for n, kk in enumerate(ks):
                hits[n] += float(first is not None and first < kk)
            hits[-1] += 1
    dist.all_reduce(hits)
    return {f"val/top{kk}": (hits[n] / hits[-1]).item() for n, kk in enumerate(ks)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/uspto50k")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--project", default="retro-selfies")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--beam", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--out", default="checkpoints/selfies_retro")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.project, name=args.run_name, config=vars(args))

    train_pairs = load_pairs(os.path.join(args.data, "raw_train.csv"))
    val_pairs = load_pairs(os.path.join(args.data, "raw_val.csv"))
    alphabet = sf.get_alphabet_from_selfies(
        s for p in train_pairs + val_pairs for s in (to_selfies(p[0]), to_selfies(p[1])) if s)
    alphabet.update(sf.get_semantic_robust_alphabet())
    itos = SPECIAL + sorted(alphabet)
    stoi = {t: i for i, t in enumerate(itos)}

    train_ds = SelfiesRetro(train_pairs, stoi, augment=True)
    val_ds = SelfiesRetro(val_pairs, stoi, augment=False)
    train_sampler = DistributedSampler(train_ds)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=6, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, 32, sampler=DistributedSampler(val_ds, shuffle=False), collate_fn=collate,
                        num_workers=2)

    model = DDP(Model(len(itos)).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    crit = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for src, tgt, _ in train_dl:
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            out = model(src, tgt[:, :-1])
            loss = crit(out.reshape(-1, out.size(-1)), tgt[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "epoch": epoch}, step=step)

        if (epoch + 1) % args.eval_every == 0:
            metrics = topk_accuracy(model.module, val_dl, val_ds, itos, device, args.beam)
            wandb.log(metrics, step=step)
            if rank == 0 and metrics["val/top1"] > best:
                best = metrics["val/top1"]
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "itos": itos, "epoch": epoch},
                           os.path.join(args.out, "best.pt"))
                wandb.run.summary["best_top1"] = best

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
