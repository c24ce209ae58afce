"""
Masked-language-model pretraining of a 650M-parameter protein encoder (ESM-2 style)
on UniRef50 crops, DeepSpeed ZeRO stage 3, bf16.

    deepspeed --hostfile hostfile --num_nodes 4 --num_gpus 8 13_protein_mlm_zero3.py \
        --data /lustre/uniref50/tok_1024 --out /lustre/ckpt/prot650m --steps 500000
"""
import argparse
import glob
import json
import math
import os
import time

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>"] + list("LAGVSERTIDPKQNFYMHWCXBUZO") + [".", "-", "<null>", "<mask>"]
PAD, MASK, CLS, EOS = VOCAB.index("<pad>"), VOCAB.index("<mask>"), VOCAB.index("<cls>"), VOCAB.index("<eos>")


def ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.98], "eps": 1e-8,
                                                   "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                          "warmup_num_steps": args.warmup,
                                                          "total_num_steps": args.steps}},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }


class TokenShards(Dataset):
    """Pre-tokenised sequences in .npy shards, each row padded to max_len with PAD."""

    def __init__(self, root, split, max_len):
        self.shards = [np.load(f, mmap_mode="r") for f in sorted(glob.glob(os.path.join(root, f"{split}_*.npy")))]
        self.offsets = np.cumsum([0] + [s.shape[0] for s in self.shards])
        self.max_len = max_len

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, i):
        s = int(np.searchsorted(self.offsets, i, side="right") - 1)
        row = np.asarray(self.shards[s][i - self.offsets[s], : self.max_len], dtype=np.int64)
        return torch.from_numpy(row)


def mlm_mask(tokens, p=0.15, generator=None):
    labels = tokens.clone()
    special = (tokens == PAD) | (tokens == CLS) | (tokens == EOS)
    prob = torch.full(tokens.shape, p)
    prob[special] = 0.0
    chosen = torch.bernoulli(prob, generator=generator).bool()
    labels[~chosen] = -100
    r = torch.rand(tokens.shape, generator=generator)
    tokens = tokens.clone()
    tokens[chosen & (r < 0.8)] = MASK
    rand_tok = torch.randint(4, 29, tokens.shape, generator=generator)
    swap = chosen & (r >= 0.8) & (r < 0.9)
    tokens[swap] = rand_tok[swap]
    return tokens, labels


def collate(batch):
    tokens = torch.stack(batch)
    inp, labels = mlm_mask(tokens)
    return inp, labels


class ProteinEncoder(nn.Module):
    def __init__(self, dim=1280, layers=33, heads=20, max_len=1024):
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), dim, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, dim)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim), nn.Linear(dim, len(VOCAB)))

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.embed(tokens) + self.pos(pos)[None]
        h = self.encoder(h, src_key_padding_mask=tokens == PAD)
        return self.lm_head(self.norm(h))


@torch.no_grad()
def evaluate(engine, loader, device, max_batches=200):
    engine.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for i, (inp, labels) in enumerate(loader):
        if i == max_batches:
            break
        inp, labels = inp.to(device), labels.to(device)
        logits = engine(inp)
        tot[0] += F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1),
                                  ignore_index=-100, reduction="sum").double()
        tot[1] += (labels != -100).sum()
    dist.all_reduce(tot)
    engine.train()
    return math.exp(tot[0] / tot[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=500_000)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--save-every", type=int, default=5000)
    ap.add_argument("--local_rank", type=int, default=-1)     # filled in by the deepspeed launcher
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = TokenShards(args.data, "train", args.max_len)
    val_ds = TokenShards(args.data, "valid", args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_loader = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler, collate_fn=collate,
                              num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.micro_batch, sampler=DistributedSampler(val_ds, shuffle=False),
                            collate_fn=collate, num_workers=2)

    torch.manual_seed(0)
    model = ProteinEncoder(max_len=args.max_len)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args))

    _, client = engine.load_checkpoint(args.out)          # (None, None) if there is nothing to resume
    step = engine.global_steps
    epoch = client["epoch"] if client else 0
    if rank == 0:
        print(f"world {world}, global batch {args.micro_batch * args.grad_accum * world} seqs, start step {step}")

    t0 = time.time()
    while step < args.steps:
        train_sampler.set_epoch(epoch)
        for inp, labels in train_loader:
            inp, labels = inp.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            logits = engine(inp)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
            engine.backward(loss)
            engine.step()
            if engine.global_steps == step:          # still accumulating micro-batches
                continue
            step = engine.global_steps
            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} lr {engine.get_lr()[0]:.2e} "
                          f"{100 / (time.time() - t0):.2f} step/s", flush=True)
                t0 = time.time()
            if step % args.save_every == 0:
                ppl = evaluate(engine, val_loader, device)
                if rank == 0:
                    print(f"step {step} valid ppl {ppl:.3f}", flush=True)
                engine.save_checkpoint(args.out, tag=f"step{step}", client_state={"step": step, "epoch": epoch})
            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        export = os.path.join(args.out, "hf_export")
        os.makedirs(export, exist_ok=True)
        torch.save(engine.module.state_dict(), os.path.join(export, "pytorch_model.bin"))
        with open(os.path.join(export, "config.json"), "w") as f:
            json.dump({"dim": 1280, "layers": 33, "heads": 20, "vocab": VOCAB, "max_len": args.max_len}, f)
        print(f"exported weights to {export}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
