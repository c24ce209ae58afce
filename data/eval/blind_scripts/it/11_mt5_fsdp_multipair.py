"""Multilingual fine-tuning of mT5-XL with FSDP over several language pairs.

Pairs are mixed with temperature sampling (T=5 by default). Each example is prefixed with
"translate <src> to <tgt>: ".

torchrun --nproc_per_node=8 11_mt5_fsdp_multipair.py --pairs en-de,en-cs,en-ja,en-sw --data data/mt5mix
"""
import argparse
import functools
import json
import os
import random

import numpy as np
import sacrebleu
import torch
import torch.distributed as dist
from torch.distributed.fsdp import (FullStateDictConfig, FullyShardedDataParallel as FSDP,
                                    MixedPrecision, ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoTokenizer, MT5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Block

LANG_NAMES = {"en": "English", "de": "German", "cs": "Czech", "ja": "Japanese", "sw": "Swahili"}


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="google/mt5-xl")
    ap.add_argument("--data", required=True)
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--temperature", type=float, default=5.0)
    ap.add_argument("--examples-per-epoch", type=int, default=400_000)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--bsz", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-len", type=int, default=192)
    ap.add_argument("--out", default="ckpt/mt5xl-mix")
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


def load_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(l) for l in f]


def prompt(src_lang, tgt_lang, text):
    return f"translate {LANG_NAMES[src_lang]} to {LANG_NAMES[tgt_lang]}: {text}"


def temperature_mixture(corpora, T, n, seed):
    """Draw n (pair, index) examples; identical on every rank for a given seed."""
    names = sorted(corpora)
    sizes = np.array([len(corpora[k]) for k in names], dtype=np.float64)
    p = (sizes / sizes.sum()) ** (1.0 / T)
    p /= p.sum()
    rng = np.random.default_rng(seed)
    which = rng.choice(len(names), size=n, p=p)
    return [(names[k], int(rng.integers(len(corpora[names[k]])))) for k in which]


class Mixture(torch.utils.data.Dataset):
    def __init__(self, corpora, items):
        self.corpora, self.items = corpora, items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        pair, j = self.items[i]
        s, t = pair.split("-")
        ex = self.corpora[pair][j]
        return prompt(s, t, ex[s]), ex[t]


def make_collate(tok, max_len):
    def collate(batch):
        enc = tok([b[0] for b in batch], text_target=[b[1] for b in batch], max_length=max_len,
                  truncation=True, padding=True, return_tensors="pt")
        enc["labels"][enc["labels"] == tok.pad_token_id] = -100
        return enc
    return collate


@torch.no_grad()
def evaluate(model, tok, dev, args, device, rank, world):
    model.eval()
    scores = {}
    for pair, rows in sorted(dev.items()):
        s, t = pair.split("-")
        data = [(i, prompt(s, t, r[s])) for i, r in enumerate(rows)]
        sampler = DistributedSampler(data, shuffle=False)  # padded -> same number of steps per rank
        local = []
        for batch in DataLoader(data, batch_size=32, sampler=sampler, collate_fn=lambda b: b):
            idx = [i for i, _ in batch]
            enc = tok([x for _, x in batch], return_tensors="pt", padding=True, truncation=True,
                      max_length=args.max_len).to(device)
            with FSDP.summon_full_params(model, writeback=False, recurse=False), \
                    torch.autocast("cuda", dtype=torch.bfloat16):
                out = model.generate(**enc, max_new_tokens=args.max_len, num_beams=1, synced_gpus=True)
            local.extend(zip(idx, tok.batch_decode(out, skip_special_tokens=True)))
        parts = [None] * world
        dist.all_gather_object(parts, local)
        hyp = {}
        for p in parts:
            hyp.update(p)
        hyps = [hyp[i] for i in range(len(rows))]
        refs = [r[t] for r in rows]
        tokenize = "ja-mecab" if t == "ja" else "13a"
        scores[pair] = sacrebleu.corpus_bleu(hyps, [refs], tokenize=tokenize).score
    model.train()
    return scores


def save_full_checkpoint(model, path, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save(state, path)
    dist.barrier()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    pairs = args.pairs.split(",")
    train = {p: load_jsonl(os.path.join(args.data, f"train.{p}.jsonl")) for p in pairs}
    dev = {p: load_jsonl(os.path.join(args.data, f"dev.{p}.jsonl")) for p in pairs}

    tok = AutoTokenizer.from_pretrained(args.model)
    model = MT5ForConditionalGeneration.from_pretrained(args.model)
    model.config.use_cache = True
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block})
    model = FSDP(model, auto_wrap_policy=wrap, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                                buffer_dtype=torch.bfloat16),
                 device_id=local_rank, limit_all_gathers=True)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    collate = make_collate(tok, args.max_len)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        items = temperature_mixture(train, args.temperature, args.examples_per_epoch, seed=args.seed + epoch)
        ds = Mixture(train, items)
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
        sampler.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=args.bsz, sampler=sampler, collate_fn=collate,
                            num_workers=4, drop_last=True)
        model.train()
        meter = torch.zeros(2, device=device)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optim.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            meter += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if step % 100 == 0:
                dist.all_reduce(meter)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {(meter[0] / meter[1]).item():.4f}", flush=True)
                meter.zero_()

        scores = evaluate(model, tok, dev, args, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} dev BLEU: " + ", ".join(f"{k}={v:.2f}" for k, v in scores.items()),
                  flush=True)
        save_full_checkpoint(model, os.path.join(args.out, f"epoch{epoch}.pt"), rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
