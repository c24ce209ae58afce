"""Fine-tune a pretrained SMILES BART (Chemformer-large layout) for retrosynthesis
on USPTO-50k under FSDP.

Pretrained weights are read on rank 0 only and broadcast by FSDP
(sync_module_states), so the 8 processes do not each hold a CPU copy.

torchrun --nproc_per_node=8 17_fsdp_retro_finetune.py --pretrained /shared/runs/chemformer_large/step_400000.pt \
    --data data/uspto50k --out /shared/runs/chemformer_retro
"""
import argparse
import functools
import math
import os
import random
import re

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from rdkit import Chem, RDLogger
from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision,
                                    StateDictType)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")
REGEX = re.compile(r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|\%[0-9]{2}|[0-9])")
PAD, BOS, EOS, UNK = 0, 1, 2, 3


def unmap(smi):
    mol = Chem.MolFromSmiles(smi)
    if mol is None:
        return None
    for a in mol.GetAtoms():
        a.SetAtomMapNum(0)
    return Chem.MolToSmiles(mol)


class RetroPairs(Dataset):
    def __init__(self, csv, stoi, augment):
        df = pd.read_csv(csv)
        self.pairs = []
        for rxn in df["reactants>reagents>production"]:
            r, _, p = rxn.split(">")
            r, p = unmap(r), unmap(p)
            if r and p:
                self.pairs.append((p, r))
        self.stoi, self.augment = stoi, augment

    def __len__(self):
        return len(self.pairs)

    def enc(self, s):
        return [BOS] + [self.stoi.get(t, UNK) for t in REGEX.findall(s)] + [EOS]

    def __getitem__(self, i):
        p, r = self.pairs[i]
        if self.augment:
            p = Chem.MolToSmiles(Chem.MolFromSmiles(p), doRandom=True, canonical=False)
            frags = r.split(".")
            random.shuffle(frags)
            r = ".".join(frags)
        return torch.tensor(self.enc(p)), torch.tensor(self.enc(r))


def collate(b):
    s, t = zip(*b)
    return nn.utils.rnn.pad_sequence(s, True, PAD), nn.utils.rnn.pad_sequence(t, True, PAD)


class BartForSmiles(nn.Module):
    def __init__(self, V, d=1024, layers=12, heads=16, drop=0.1, max_pos=512):
        super().__init__()
        self.d = d
        self.tok = nn.Embedding(V, d, padding_idx=PAD)
        self.pos = nn.Embedding(max_pos, d)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, heads, 4 * d, drop, activation="gelu", batch_first=True, norm_first=True),
            layers, norm=nn.LayerNorm(d))
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(d, heads, 4 * d, drop, activation="gelu", batch_first=True, norm_first=True),
            layers, norm=nn.LayerNorm(d))
        self.lm_head = nn.Linear(d, V, bias=False)

    def embed(self, x):
        return self.tok(x) * math.sqrt(self.d) + self.pos(torch.arange(x.size(1), device=x.device))

    def forward(self, src, tgt):
        mem = self.encoder(self.embed(src), src_key_padding_mask=src.eq(PAD))
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        h = self.decoder(self.embed(tgt), mem, tgt_mask=mask, tgt_key_padding_mask=tgt.eq(PAD),
                         memory_key_padding_mask=src.eq(PAD))
        return self.lm_head(h)


@torch.no_grad()
def evaluate(model, loader, device):
    """Teacher-forced metrics: every rank runs exactly one forward per batch."""
    model.eval()
    s = torch.zeros(5, device=device)
    for src, tgt in loader:
        src, tgt = src.to(device), tgt.to(device)
        logits = model(src, tgt[:, :-1]).float()
        gold = tgt[:, 1:]
        m = gold.ne(PAD)
        eq = logits.argmax(-1).eq(gold)
        s[0] += nn.functional.cross_entropy(logits.flatten(0, 1), gold.flatten(), ignore_index=PAD, reduction="sum")
        s[1] += (eq & m).sum()
        s[2] += m.sum()
        s[3] += (eq | ~m).all(1).sum()
        s[4] += gold.size(0)
    dist.all_reduce(s)
    model.train()
    return {"loss": (s[0] / s[2]).item(), "tok_acc": (s[1] / s[2]).item(), "seq_acc": (s[3] / s[4]).item()}


def save_full(model, opt, path, epoch, itos):
    # all ranks take part in the gather; only rank 0 receives the full tensors
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, opt)
    if dist.get_rank() == 0:
        torch.save({"model": model_state, "optim": optim_state, "epoch": epoch, "itos": itos}, path)
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pretrained", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)

    with open(os.path.join(os.path.dirname(args.pretrained), "vocab.txt")) as f:
        itos = [l.rstrip("\n") for l in f]
    stoi = {t: i for i, t in enumerate(itos)}

    model = BartForSmiles(len(itos))
    if rank == 0:
        ckpt = torch.load(args.pretrained, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        print(f"loaded {args.pretrained} (step {ckpt.get('step')})", flush=True)
        del ckpt

    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={nn.TransformerEncoderLayer, nn.TransformerDecoderLayer})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=policy, mixed_precision=mp, device_id=local_rank,
                 sync_module_states=True, use_orig_params=True)

    train_ds = RetroPairs(os.path.join(args.data, "raw_train.csv"), stoi, augment=True)
    val_ds = RetroPairs(os.path.join(args.data, "raw_val.csv"), stoi, augment=False)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=4,
                          pin_memory=True)
    val_dl = DataLoader(val_ds, 64, sampler=DistributedSampler(val_ds, shuffle=False), collate_fn=collate,
                        num_workers=2)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 1000) * max(0.0, 1 - s / total))
    crit = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, (src, tgt) in enumerate(train_dl):
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            logits = model(src, tgt[:, :-1])
            loss = crit(logits.float().flatten(0, 1), tgt[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f}", flush=True)

        metrics = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
        save_full(model, opt, os.path.join(args.out, "last.pt"), epoch, itos)
        if metrics["seq_acc"] > best:
            best = metrics["seq_acc"]
            save_full(model, opt, os.path.join(args.out, "best.pt"), epoch, itos)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
