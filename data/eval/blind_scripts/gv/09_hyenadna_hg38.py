"""
HyenaDNA next-nucleotide pretraining on hg38 (32 kb windows).

Intervals come from the HyenaDNA sequences.bed (chr, start, end, split). The windows are
extracted once, tokenized at character level and cached as a uint8 tensor so later runs
skip the FASTA parsing.

    torchrun --nproc_per_node=8 09_hyenadna_hg38.py --fasta /data/hg38/hg38.ml.fa \
        --bed /data/hg38/human-sequences.bed --max_len 32768
"""
import argparse
import math
import os
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pyfaidx import Fasta
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from standalone_hyenadna import CharacterTokenizer, HyenaDNAModel


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--fasta", required=True)
    p.add_argument("--bed", required=True)
    p.add_argument("--cache_dir", default="cache/hg38")
    p.add_argument("--max_len", type=int, default=32768)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--n_layer", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--warmup_steps", type=int, default=1000)
    p.add_argument("--rc_aug", action="store_true", help="reverse-complement augmentation")
    p.add_argument("--ckpt_dir", default="ckpt/hyenadna_32k")
    return p.parse_args()


def extract_windows(fasta_path, bed_path, split, max_len, tokenizer):
    genome = Fasta(fasta_path, one_based_attributes=False)
    bed = pd.read_csv(bed_path, sep="\t", names=["chr", "start", "end", "split"])
    bed = bed[bed["split"] == split]
    rows = []
    for chrom, start, end in zip(bed["chr"], bed["start"], bed["end"]):
        mid = (start + end) // 2
        left = max(0, mid - max_len // 2)
        seq = str(genome[chrom][left:left + max_len + 1]).upper()
        if len(seq) < max_len + 1:
            seq = seq + "N" * (max_len + 1 - len(seq))
        ids = tokenizer(seq, add_special_tokens=False)["input_ids"]
        rows.append(torch.tensor(ids, dtype=torch.uint8))
    return torch.stack(rows)


def load_split(args, split, tokenizer):
    os.makedirs(args.cache_dir, exist_ok=True)
    cache = os.path.join(args.cache_dir, f"{split}_{args.max_len}.pt")
    if os.path.exists(cache):
        return torch.load(cache, map_location="cpu")
    data = extract_windows(args.fasta, args.bed, split, args.max_len, tokenizer)
    torch.save(data, cache)
    return data


class GenomeWindows(Dataset):
    def __init__(self, data, rc_aug, comp_table):
        self.data = data
        self.rc_aug = rc_aug
        self.comp = comp_table

    def __len__(self):
        return self.data.size(0)

    def __getitem__(self, i):
        x = self.data[i].long()
        if self.rc_aug and torch.rand(()) < 0.5:
            x = self.comp[x.flip(0)]
        return x


class HyenaDNALM(nn.Module):
    def __init__(self, d_model, n_layer, max_len, vocab_size):
        super().__init__()
        self.backbone = HyenaDNAModel(d_model=d_model, n_layer=n_layer, d_inner=4 * d_model,
                                      vocab_size=vocab_size, layer={"_name_": "hyena", "emb_dim": 5,
                                                                   "filter_order": 64, "l_max": max_len + 2,
                                                                   "local_order": 3, "modulate": True},
                                      resid_dropout=0.0, embed_dropout=0.1, use_head=False)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.backbone.backbone.embeddings.word_embeddings.weight

    def forward(self, x):
        return self.lm_head(self.backbone(x))


def main():
    args = get_args()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    tokenizer = CharacterTokenizer(characters=["A", "C", "G", "T", "N"],
                                   model_max_length=args.max_len + 2, add_special_tokens=False)
    vocab = tokenizer.vocab_size
    vocab_padded = int(math.ceil(vocab / 8) * 8)
    # token id -> id of the complementary base, for reverse-complement augmentation
    comp = torch.arange(vocab_padded)
    for a, b in zip("ACGT", "TGCA"):
        comp[tokenizer._convert_token_to_id(a)] = tokenizer._convert_token_to_id(b)

    train_data = load_split(args, "train", tokenizer)
    val_data = load_split(args, "valid", tokenizer)
    train_ds = GenomeWindows(train_data, args.rc_aug, comp)
    val_ds = GenomeWindows(val_data, False, comp)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=2)

    torch.manual_seed(0)
    model = HyenaDNALM(args.d_model, args.n_layer, args.max_len, vocab_padded).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.999))
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup_steps) *
        0.5 * (1.0 + math.cos(math.pi * min(1.0, s / total))))

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"train windows {len(train_ds)}, val windows {len(val_ds)}, world {world}")

    global_step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x in train_loader:
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, vocab_padded), x[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            global_step += 1
            if global_step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {global_step} loss {l.item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)")

        model.eval()
        stats = torch.zeros(3, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x in val_loader:
                x = x.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(x[:, :-1])
                tgt = x[:, 1:]
                stats[0] += F.cross_entropy(logits.float().reshape(-1, vocab_padded), tgt.reshape(-1),
                                            reduction="sum")
                stats[1] += (logits.argmax(-1) == tgt).sum()
                stats[2] += tgt.numel()
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} val loss {(stats[0] / stats[2]).item():.4f} "
                  f"acc {(stats[1] / stats[2]).item():.4f}")
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.ckpt_dir, f"epoch_{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
