# Molecular Transformer (Schwaller et al. 2019) reimplementation, USPTO-STEREO mixed.
#
#   torchrun --nproc_per_node=8 07_molecular_transformer_train.py --config configs/mt_stereo.yaml
import argparse
import math
import os
import random
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from rdkit import Chem, RDLogger
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")

DEFAULTS = {
    "data_dir": "data/STEREO_mixed",
    "save_dir": "experiments/mt_stereo",
    "d_model": 256,
    "layers": 4,
    "heads": 8,
    "ff": 2048,
    "dropout": 0.1,
    "batch_size": 128,
    "epochs": 120,
    "factor": 2.0,
    "warmup": 8000,
    "max_seq_len": 300,
    "augment_prob": 0.5,
    "seed": 42,
}
TOK = re.compile(r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|\%[0-9]{2}|[0-9])")


def load_config(path):
    cfg = dict(DEFAULTS)
    if path:
        with open(path) as f:
            cfg.update(yaml.safe_load(f) or {})
    return argparse.Namespace(**cfg)


def read_pairs(data_dir, split):
    with open(os.path.join(data_dir, f"src-{split}.txt")) as f:
        src = ["".join(l.split()) for l in f]
    with open(os.path.join(data_dir, f"tgt-{split}.txt")) as f:
        tgt = ["".join(l.split()) for l in f]
    return list(zip(src, tgt))


def randomize_reactants(smi):
    parts = []
    for frag in smi.split("."):
        m = Chem.MolFromSmiles(frag)
        parts.append(Chem.MolToSmiles(m, doRandom=True, canonical=False) if m is not None else frag)
    random.shuffle(parts)
    return ".".join(parts)


class Reactions(Dataset):
    def __init__(self, pairs, stoi, augment_prob=0.0):
        self.pairs, self.stoi, self.p = pairs, stoi, augment_prob

    def __len__(self):
        return len(self.pairs)

    def enc(self, s):
        return [1] + [self.stoi.get(t, 3) for t in TOK.findall(s)] + [2]

    def __getitem__(self, i):
        src, tgt = self.pairs[i]
        if self.p > 0 and random.random() < self.p:
            src = randomize_reactants(src)
        return torch.tensor(self.enc(src)), torch.tensor(self.enc(tgt))


def collate(batch):
    s, t = zip(*batch)
    return nn.utils.rnn.pad_sequence(s, True), nn.utils.rnn.pad_sequence(t, True)


class MT(nn.Module):
    def __init__(self, V, cfg):
        super().__init__()
        self.d = cfg.d_model
        self.embed = nn.Embedding(V, cfg.d_model, padding_idx=0)
        pe = torch.zeros(2048, cfg.d_model)
        position = torch.arange(2048).unsqueeze(1)
        div = torch.exp(torch.arange(0, cfg.d_model, 2) * -(math.log(10000.0) / cfg.d_model))
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div)
        self.register_buffer("pe", pe)
        self.dropout = nn.Dropout(cfg.dropout)
        self.transformer = nn.Transformer(cfg.d_model, cfg.heads, cfg.layers, cfg.layers, cfg.ff, cfg.dropout,
                                          batch_first=True)
        self.generator = nn.Linear(cfg.d_model, V)

    def emb(self, x):
        return self.dropout(self.embed(x) * math.sqrt(self.d) + self.pe[: x.size(1)])

    def forward(self, src, tgt):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        h = self.transformer(self.emb(src), self.emb(tgt), tgt_mask=causal, src_key_padding_mask=src.eq(0),
                             tgt_key_padding_mask=tgt.eq(0), memory_key_padding_mask=src.eq(0))
        return self.generator(h)


def noam_lambda(cfg):
    def f(step):
        step += 1
        return cfg.factor * cfg.d_model ** -0.5 * min(step ** -0.5, step * cfg.warmup ** -1.5)
    return f


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    tot = torch.zeros(3, device=device)
    crit = nn.CrossEntropyLoss(ignore_index=0, reduction="sum")
    for src, tgt in loader:
        src, tgt = src.to(device), tgt.to(device)
        logits = model(src, tgt[:, :-1])
        gold = tgt[:, 1:]
        tot[0] += crit(logits.flatten(0, 1), gold.flatten())
        tot[1] += (logits.argmax(-1).eq(gold) & gold.ne(0)).sum()
        tot[2] += gold.ne(0).sum()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cfg = load_config(ap.parse_args().config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed + rank)

    with open(os.path.join(cfg.data_dir, "vocab.txt")) as f:
        itos = [l.rstrip("\n") for l in f]
    stoi = {t: i for i, t in enumerate(itos)}
    train = Reactions(read_pairs(cfg.data_dir, "train"), stoi, cfg.augment_prob)
    val = Reactions(read_pairs(cfg.data_dir, "val"), stoi)

    sampler = DistributedSampler(train, shuffle=True, seed=cfg.seed)
    train_loader = DataLoader(train, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val, batch_size=cfg.batch_size, sampler=DistributedSampler(val, shuffle=False),
                            collate_fn=collate, num_workers=2)

    model = DDP(MT(len(itos), cfg).to(device), device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.998), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, noam_lambda(cfg))
    criterion = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.0)

    if rank == 0:
        os.makedirs(cfg.save_dir, exist_ok=True)
        with open(os.path.join(cfg.save_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(vars(cfg), f)

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, n_steps, skipped = time.time(), 0, 0
        for src, tgt in train_loader:
            if max(src.size(1), tgt.size(1)) > cfg.max_seq_len:
                skipped += 1
                continue
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            logits = model(src, tgt[:, :-1])
            loss = criterion(logits.flatten(0, 1), tgt[:, 1:].flatten())
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            n_steps += 1
            if rank == 0 and n_steps % 200 == 0:
                print(f"epoch {epoch} step {n_steps} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}",
                      flush=True)

        val_loss, val_acc = validate(model, val_loader, device)
        if rank == 0:
            print(f"== epoch {epoch} done in {time.time() - t0:.0f}s (skipped {skipped}) "
                  f"val_loss {val_loss:.4f} val_tok_acc {val_acc:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "vocab": itos},
                       os.path.join(cfg.save_dir, f"model_epoch_{epoch}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
