"""Joint forward / retro model: one shared SMILES encoder, one decoder per direction.

Each optimisation step alternates between a forward-prediction batch and a
retrosynthesis batch drawn from the same USPTO reactions.

torchrun --nproc_per_node=8 10_dual_direction_model.py --data_dir data/USPTO_480k --out runs/dual
"""
import argparse
import math
import os
import random
import re

import torch
import torch.distributed as dist
import torch.nn as nn
from rdkit import Chem, RDLogger
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")
RE_TOK = re.compile(r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|\%[0-9]{2}|[0-9])")
TASKS = ("forward", "retro")


def rand_smiles(smi):
    out = []
    for frag in smi.split("."):
        m = Chem.MolFromSmiles(frag)
        out.append(Chem.MolToSmiles(m, doRandom=True, canonical=False) if m is not None else frag)
    random.shuffle(out)
    return ".".join(out)


class DirectionalPairs(Dataset):
    def __init__(self, rxns, stoi, task, augment):
        self.rxns, self.stoi, self.task, self.augment = rxns, stoi, task, augment

    def __len__(self):
        return len(self.rxns)

    def ids(self, smi):
        return [1] + [self.stoi.get(t, 3) for t in RE_TOK.findall(smi)] + [2]

    def __getitem__(self, i):
        reactants, product = self.rxns[i]
        src, tgt = (reactants, product) if self.task == "forward" else (product, reactants)
        if self.augment:
            src = rand_smiles(src)
        return torch.tensor(self.ids(src)), torch.tensor(self.ids(tgt))


def collate(batch):
    s, t = zip(*batch)
    return nn.utils.rnn.pad_sequence(s, True), nn.utils.rnn.pad_sequence(t, True)


def read_rxns(path):
    rxns = []
    with open(path) as f:
        for line in f:
            reac, _, prod = line.split()[0].split(">")
            rxns.append((reac, prod))
    return rxns


class DualDirectionModel(nn.Module):
    def __init__(self, V, d=256, heads=8, enc_layers=6, dec_layers=6, dropout=0.1):
        super().__init__()
        self.d = d
        self.embed = nn.Embedding(V, d, padding_idx=0)
        self.pos = nn.Embedding(512, d)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout, batch_first=True), enc_layers, norm=nn.LayerNorm(d))
        self.decoders = nn.ModuleDict({
            t: nn.TransformerDecoder(nn.TransformerDecoderLayer(d, heads, 4 * d, dropout, batch_first=True),
                                     dec_layers, norm=nn.LayerNorm(d))
            for t in TASKS
        })
        self.out = nn.Linear(d, V)

    def emb(self, x):
        return self.embed(x) * math.sqrt(self.d) + self.pos(torch.arange(x.size(1), device=x.device))

    def forward(self, src, tgt, task):
        src_pad = src.eq(0)
        mem = self.encoder(self.emb(src), src_key_padding_mask=src_pad)
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        h = self.decoders[task](self.emb(tgt), mem, tgt_mask=causal, tgt_key_padding_mask=tgt.eq(0),
                                memory_key_padding_mask=src_pad)
        return self.out(h)


@torch.no_grad()
def evaluate(model, loaders, device):
    model.eval()
    res = {}
    for task, loader in loaders.items():
        s = torch.zeros(3, device=device)
        for src, tgt in loader:
            src, tgt = src.to(device), tgt.to(device)
            logits = model(src, tgt[:, :-1], task)
            gold = tgt[:, 1:]
            ok = logits.argmax(-1).eq(gold) | gold.eq(0)
            s[0] += ok.all(1).sum()
            s[1] += gold.size(0)
            s[2] += nn.functional.cross_entropy(logits.flatten(0, 1), gold.flatten(), ignore_index=0,
                                                reduction="sum") / gold.ne(0).sum() * gold.size(0)
        dist.all_reduce(s)
        res[f"{task}/seq_acc"] = (s[0] / s[1]).item()
        res[f"{task}/loss"] = (s[2] / s[1]).item()
    model.train()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--out", default="runs/dual")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    with open(os.path.join(args.data_dir, "vocab.txt")) as f:
        itos = [l.strip() for l in f if l.strip()]
    stoi = {t: i for i, t in enumerate(itos)}
    train_rxns = read_rxns(os.path.join(args.data_dir, "train.txt"))
    val_rxns = read_rxns(os.path.join(args.data_dir, "valid.txt"))

    train_sets = {t: DirectionalPairs(train_rxns, stoi, t, augment=True) for t in TASKS}
    samplers = {t: DistributedSampler(ds, shuffle=True, seed=args.seed + k) for k, (t, ds) in enumerate(train_sets.items())}
    train_loaders = {t: DataLoader(train_sets[t], args.bs, sampler=samplers[t], collate_fn=collate, num_workers=4,
                                   pin_memory=True, drop_last=True) for t in TASKS}
    val_loaders = {}
    for t in TASKS:
        ds = DirectionalPairs(val_rxns, stoi, t, augment=False)
        val_loaders[t] = DataLoader(ds, 128, sampler=DistributedSampler(ds, shuffle=False), collate_fn=collate,
                                    num_workers=2)

    model = DDP(DualDirectionModel(len(itos)).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * (args.warmup / max(s + 1, args.warmup)) ** 0.5)
    crit = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    step = 0
    for epoch in range(args.epochs):
        for t in TASKS:
            samplers[t].set_epoch(epoch)
        model.train()
        for fwd_batch, retro_batch in zip(train_loaders["forward"], train_loaders["retro"]):
            for task, (src, tgt) in zip(TASKS, (fwd_batch, retro_batch)):
                src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
                logits = model(src, tgt[:, :-1], task)
                loss = crit(logits.flatten(0, 1), tgt[:, 1:].flatten())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                step += 1
                if rank == 0 and step % 500 == 0:
                    print(f"epoch {epoch} step {step} {task} loss {loss.item():.4f}", flush=True)

        metrics = evaluate(model, val_loaders, device)
        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "itos": itos},
                       os.path.join(args.out, "last.pt"))
            score = metrics["forward/seq_acc"] + metrics["retro/seq_acc"]
            if score > best:
                best = score
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
