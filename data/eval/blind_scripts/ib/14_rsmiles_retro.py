"""Root-aligned SMILES style augmentation for retrosynthesis.

Every epoch the training set is re-drawn: each product gets a new random root
atom, and the reactant SMILES are rooted at the matching mapped atom so source
and target stay aligned (R-SMILES, Zhong et al. 2022, simplified).

torchrun --nproc_per_node=8 14_rsmiles_retro.py --data data/uspto50k_mapped --logdir tb/rsmiles
"""
import argparse
import math
import os
import random
import re
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
from rdkit import Chem, RDLogger
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

RDLogger.DisableLog("rdApp.*")
SMI_TOK = re.compile(r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|\%[0-9]{2}|[0-9])")


def clear_maps(mol):
    mol = Chem.Mol(mol)
    for a in mol.GetAtoms():
        a.SetAtomMapNum(0)
    return mol


def rooted_pair(prod_mapped, reac_mapped, rng):
    """Random root atom on the product, reactant fragment containing it rooted at the same mapped atom."""
    pm, rm = Chem.MolFromSmiles(prod_mapped), Chem.MolFromSmiles(reac_mapped)
    root = rng.randrange(pm.GetNumAtoms())
    root_map = pm.GetAtomWithIdx(root).GetAtomMapNum()
    prod = Chem.MolToSmiles(clear_maps(pm), rootedAtAtom=root, canonical=False)
    frags = []
    for frag in Chem.GetMolFrags(rm, asMols=True):
        idx = [a.GetIdx() for a in frag.GetAtoms() if a.GetAtomMapNum() == root_map]
        if idx:
            frags.insert(0, Chem.MolToSmiles(clear_maps(frag), rootedAtAtom=idx[0], canonical=False))
        else:
            frags.append(Chem.MolToSmiles(clear_maps(frag), doRandom=True, canonical=False))
    return prod, ".".join(frags)


class RSmilesDataset(Dataset):
    def __init__(self, mapped_pairs, stoi):
        self.mapped = mapped_pairs
        self.stoi = stoi
        self.current = [(Chem.MolToSmiles(clear_maps(Chem.MolFromSmiles(p))),
                         Chem.MolToSmiles(clear_maps(Chem.MolFromSmiles(r)))) for p, r in mapped_pairs]

    def resample(self, seed):
        rng = random.Random(seed)
        self.current = [rooted_pair(p, r, rng) for p, r in self.mapped]

    def __len__(self):
        return len(self.current)

    def ids(self, s):
        return [1] + [self.stoi.get(t, 3) for t in SMI_TOK.findall(s)] + [2]

    def __getitem__(self, i):
        p, r = self.current[i]
        return torch.tensor(self.ids(p)), torch.tensor(self.ids(r))


def collate(batch):
    s, t = zip(*batch)
    return nn.utils.rnn.pad_sequence(s, True), nn.utils.rnn.pad_sequence(t, True)


def read_mapped(csv):
    df = pd.read_csv(csv)
    out = []
    for rxn in df["reactants>reagents>production"]:
        r, _, p = rxn.split(">")
        if Chem.MolFromSmiles(r) is not None and Chem.MolFromSmiles(p) is not None:
            out.append((p, r))
    return out


class RetroModel(nn.Module):
    def __init__(self, V, d=512, L=6, H=8, ff=2048, p=0.1):
        super().__init__()
        self.d = d
        self.emb = nn.Embedding(V, d, padding_idx=0)
        pe = torch.zeros(1024, d)
        pos = torch.arange(1024).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe)
        self.drop = nn.Dropout(p)
        self.transformer = nn.Transformer(d, H, L, L, ff, p, batch_first=True)
        self.generator = nn.Linear(d, V)

    def forward(self, src, tgt):
        e = lambda x: self.drop(self.emb(x) * math.sqrt(self.d) + self.pe[: x.size(1)])
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        h = self.transformer(e(src), e(tgt), tgt_mask=mask, src_key_padding_mask=src.eq(0),
                             tgt_key_padding_mask=tgt.eq(0), memory_key_padding_mask=src.eq(0))
        return self.generator(h)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    st = torch.zeros(5, device=device)
    for src, tgt in loader:
        src, tgt = src.to(device), tgt.to(device)
        logits = model(src, tgt[:, :-1])
        gold = tgt[:, 1:]
        mask = gold.ne(0)
        eq = logits.argmax(-1).eq(gold)
        st[0] += nn.functional.cross_entropy(logits.flatten(0, 1), gold.flatten(), ignore_index=0, reduction="sum")
        st[1] += (eq & mask).sum()
        st[2] += mask.sum()
        st[3] += (eq | ~mask).all(1).float().sum()
        st[4] += gold.size(0)
    dist.all_reduce(st)
    model.train()
    return {"loss": (st[0] / st[2]).item(), "tok_acc": (st[1] / st[2]).item(),
            "seq_acc_tf": (st[3] / st[4]).item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--logdir", default="tb/rsmiles")
    ap.add_argument("--ckpt", default="ckpt/rsmiles")
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=33)
    ap.add_argument("--save_every", type=int, default=20)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    with open(os.path.join(args.data, "vocab.txt")) as f:
        itos = [l.rstrip("\n") for l in f]
    stoi = {t: i for i, t in enumerate(itos)}
    train_ds = RSmilesDataset(read_mapped(os.path.join(args.data, "raw_train.csv")), stoi)
    val_ds = RSmilesDataset(read_mapped(os.path.join(args.data, "raw_val.csv")), stoi)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=128, sampler=DistributedSampler(val_ds, shuffle=False),
                        collate_fn=collate, num_workers=2)

    model = DDP(RetroModel(len(itos)).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.998))
    crit = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
    writer = SummaryWriter(args.logdir) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.ckpt, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        train_ds.resample(seed=args.seed * 1000 + epoch)
        model.train()
        t0 = time.time()
        for src, tgt in train_dl:
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            logits = model(src, tgt[:, :-1])
            loss = crit(logits.flatten(0, 1), tgt[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if writer is not None and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)

        metrics = validate(model, val_dl, device)
        if rank == 0:
            for k, v in metrics.items():
                writer.add_scalar(f"val/{k}", v, step)
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()),
                  flush=True)
            if (epoch + 1) % args.save_every == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                            "step": step}, os.path.join(args.ckpt, f"epoch{epoch + 1}.pt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
