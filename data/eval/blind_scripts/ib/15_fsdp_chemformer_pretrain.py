"""Chemformer-style BART pretraining on ~10M SMILES (span masking + random SMILES).

The large config (d=1024, 12+12 layers) does not fit comfortably with plain DDP
at our batch sizes, so the model is sharded with FSDP.

torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
    15_fsdp_chemformer_pretrain.py --smiles /shared/zinc/zinc_10m.txt --out /shared/runs/chemformer_large
"""
import argparse
import functools
import math
import os
import random
import re
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from rdkit import Chem, RDLogger
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")
REGEX = re.compile(r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$|\%[0-9]{2}|[0-9])")
PAD, BOS, EOS, UNK, MASK = 0, 1, 2, 3, 4


class SmilesCorpus(Dataset):
    def __init__(self, path, stoi, mask_prob=0.15, max_len=256):
        with open(path) as f:
            self.smiles = [l.strip() for l in f if l.strip()]
        self.stoi, self.mask_prob, self.max_len = stoi, mask_prob, max_len

    def __len__(self):
        return len(self.smiles)

    def __getitem__(self, i):
        smi = self.smiles[i]
        mol = Chem.MolFromSmiles(smi)
        if mol is not None:
            smi = Chem.MolToSmiles(mol, doRandom=True, canonical=False)
        toks = [self.stoi.get(t, UNK) for t in REGEX.findall(smi)][: self.max_len - 2]
        corrupted, j = [], 0
        while j < len(toks):
            if random.random() < self.mask_prob:
                span = min(len(toks) - j, max(1, int(random.expovariate(1 / 3.0))))
                corrupted.append(MASK)
                j += span
            else:
                corrupted.append(toks[j])
                j += 1
        return torch.tensor([BOS] + corrupted + [EOS]), torch.tensor([BOS] + toks + [EOS])


def collate(batch):
    s, t = zip(*batch)
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
    model.eval()
    tot = torch.zeros(3, device=device)
    for src, tgt in loader:
        src, tgt = src.to(device), tgt.to(device)
        logits = model(src, tgt[:, :-1]).float()
        gold = tgt[:, 1:]
        tot[0] += nn.functional.cross_entropy(logits.flatten(0, 1), gold.flatten(), ignore_index=PAD, reduction="sum")
        tot[1] += (logits.argmax(-1).eq(gold) & gold.ne(PAD)).sum()
        tot[2] += gold.ne(PAD).sum()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smiles", required=True)
    ap.add_argument("--val_smiles", default="/shared/zinc/zinc_val_100k.txt")
    ap.add_argument("--vocab", default="/shared/zinc/vocab.txt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch_size", type=int, default=96)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=8000)
    ap.add_argument("--max_steps", type=int, default=400000)
    ap.add_argument("--eval_every", type=int, default=10000)
    ap.add_argument("--save_every", type=int, default=10000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    with open(args.vocab) as f:
        itos = [l.rstrip("\n") for l in f]
    stoi = {t: i for i, t in enumerate(itos)}
    train_ds = SmilesCorpus(args.smiles, stoi)
    val_ds = SmilesCorpus(args.val_smiles, stoi)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=8,
                          pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                        collate_fn=collate, num_workers=4)

    wrap_policy = functools.partial(transformer_auto_wrap_policy,
                                    transformer_layer_cls={nn.TransformerEncoderLayer, nn.TransformerDecoderLayer})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = FSDP(BartForSmiles(len(itos)), auto_wrap_policy=wrap_policy, mixed_precision=bf16,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=local_rank, use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1))))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters()) * world
        print(f"FSDP on {world} ranks, ~{n_params / 1e6:.0f}M params, {len(train_ds)} SMILES", flush=True)

    step, epoch = 0, 0
    model.train()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        t0 = time.time()
        for src, tgt in train_dl:
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            logits = model(src, tgt[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=PAD)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{100 / (time.time() - t0):.2f} it/s", flush=True)
                t0 = time.time()
            if step % args.eval_every == 0:
                vloss, vacc = evaluate(model, val_dl, device)
                if rank == 0:
                    print(f"step {step} val loss {vloss:.4f} token acc {vacc:.4f}", flush=True)
            if step % args.save_every == 0 and rank == 0:
                cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                    state = model.state_dict()
                torch.save({"model": state, "step": step, "itos": itos}, os.path.join(args.out, f"step_{step}.pt"))
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
