"""ESM-style masked language model on UniRef50 sequences, sharded with FSDP.

    torchrun --standalone --nproc_per_node=8 07_protein_mlm_fsdp.py --config conf/esm_650m.yaml
"""
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

AA = "ACDEFGHIKLMNPQRSTVWYXBUZO"
PAD, CLS, EOS, MASK = 0, 1, 2, 3
VOCAB = {a: i + 4 for i, a in enumerate(AA)}
VOCAB_SIZE = 4 + len(AA)


class FastaDataset(Dataset):
    def __init__(self, path, max_len):
        self.seqs = []
        with open(path) as fh:
            cur = []
            for line in fh:
                if line.startswith(">"):
                    if cur:
                        self.seqs.append("".join(cur))
                    cur = []
                else:
                    cur.append(line.strip())
            if cur:
                self.seqs.append("".join(cur))
        self.max_len = max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        if len(s) > self.max_len - 2:
            g = torch.Generator().manual_seed(i)
            start = torch.randint(0, len(s) - self.max_len + 3, (1,), generator=g).item()
            s = s[start:start + self.max_len - 2]
        return torch.tensor([CLS] + [VOCAB.get(c, VOCAB["X"]) for c in s] + [EOS])


def mask_collate(batch, mask_prob=0.15):
    L = max(len(b) for b in batch)
    toks = torch.full((len(batch), L), PAD, dtype=torch.long)
    for i, b in enumerate(batch):
        toks[i, : len(b)] = b
    labels = toks.clone()
    special = (toks == PAD) | (toks == CLS) | (toks == EOS)
    sel = (torch.rand(toks.shape) < mask_prob) & ~special
    labels[~sel] = -100
    r = torch.rand(toks.shape)
    inp = toks.clone()
    inp[sel & (r < 0.8)] = MASK
    rand_tok = torch.randint(4, VOCAB_SIZE, toks.shape)
    swap = sel & (r >= 0.8) & (r < 0.9)
    inp[swap] = rand_tok[swap]
    return inp, labels


class Layer(nn.Module):
    def __init__(self, d, h, ff):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))

    def forward(self, x, pad_mask):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, key_padding_mask=pad_mask, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


class ProteinLM(nn.Module):
    def __init__(self, d=1280, layers=33, heads=20, max_len=1024):
        super().__init__()
        self.tok = nn.Embedding(VOCAB_SIZE, d, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, d)
        self.layers = nn.ModuleList([Layer(d, heads, 4 * d) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB_SIZE)

    def forward(self, tokens):
        pad = tokens == PAD
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for layer in self.layers:
            x = layer(x, pad)
        return self.lm_head(self.ln(x))


def save_checkpoint(model, optimizer, step, path, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save({"model": state, "step": step}, path)
        print(f"saved {path}", flush=True)
    dist.barrier()


@torch.no_grad()
def evaluate(model, loader, device, max_batches=200):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for i, (inp, lab) in enumerate(loader):
        if i >= max_batches:
            break
        inp, lab = inp.to(device), lab.to(device)
        logits = model(inp)
        tot[0] += F.cross_entropy(logits.float().view(-1, VOCAB_SIZE), lab.view(-1), ignore_index=-100,
                                  reduction="sum").double()
        tot[1] += (lab != -100).sum()
    dist.all_reduce(tot)
    model.train()
    return math.exp((tot[0] / tot[1]).item())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    train_ds = FastaDataset(cfg["train_fasta"], cfg["max_len"])
    val_ds = FastaDataset(cfg["val_fasta"], cfg["max_len"])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.get("seed", 0))
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["micro_batch"], sampler=train_sampler,
                          collate_fn=mask_collate, num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=cfg["micro_batch"], sampler=val_sampler,
                        collate_fn=mask_collate, num_workers=4, drop_last=True)

    model = ProteinLM(cfg["d_model"], cfg["n_layers"], cfg["n_heads"], cfg["max_len"])
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Layer})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    model = FSDP(model, auto_wrap_policy=wrap, mixed_precision=mp, device_id=local_rank,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    warm, total = cfg["warmup_steps"], cfg["max_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / warm if s < warm else max(0.1, 1 - (s - warm) / (total - warm)))

    out = cfg["output_dir"]
    if rank == 0:
        os.makedirs(out, exist_ok=True)
    accum = cfg.get("grad_accum", 1)
    step, epoch = 0, 0
    t0 = time.time()
    while step < total:
        train_sampler.set_epoch(epoch)
        for i, (inp, lab) in enumerate(train_dl):
            inp, lab = inp.to(device, non_blocking=True), lab.to(device, non_blocking=True)
            logits = model(inp)
            loss = F.cross_entropy(logits.float().view(-1, VOCAB_SIZE), lab.view(-1), ignore_index=-100)
            (loss / accum).backward()
            if (i + 1) % accum:
                continue
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 50:.2f}s/it", flush=True)
                t0 = time.time()
            if step % cfg["eval_every"] == 0:
                ppl = evaluate(model, val_dl, device)
                if rank == 0:
                    print(f"step {step} val ppl {ppl:.3f}", flush=True)
            if step % cfg["save_every"] == 0 or step == total:
                save_checkpoint(model, opt, step, os.path.join(out, f"step{step}.pt"), rank)
            if step >= total:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
