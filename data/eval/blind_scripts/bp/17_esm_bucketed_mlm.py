"""ESM-2 style MLM pretraining with length bucketing and a per-step token budget.

Batches are formed over the whole dataset (same seed on every rank) and then dealt out
round-robin, so every rank sees the same number of batches per epoch. The loss is
normalised by the number of masked tokens over all ranks, which keeps the gradient
independent of how unevenly the masked tokens fall across GPUs.

    torchrun --nproc_per_node=8 17_esm_bucketed_mlm.py --fasta /data/uniref50_2M.fasta --out runs/esm_bucket
"""
import argparse
import math
import os
import random

import torch
import torch.distributed as dist
from Bio import SeqIO
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler
from transformers import EsmConfig, EsmForMaskedLM, EsmTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fasta", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default="facebook/esm2_t6_8M_UR50D")
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--max_tokens", type=int, default=12288)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--valid_frac", type=float, default=0.005)
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


class DistributedTokenBudgetSampler(Sampler):
    def __init__(self, lengths, max_tokens, num_replicas, rank, shuffle=True, seed=0, even=True):
        self.lengths, self.max_tokens = lengths, max_tokens
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.even = even

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _global_batches(self):
        rng = random.Random(self.seed + self.epoch)
        order = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(order)  # random tie-breaking among equal lengths
        order.sort(key=lambda i: self.lengths[i])
        batches, cur, longest = [], [], 0
        for i in order:
            longest_new = max(longest, self.lengths[i])
            if cur and longest_new * (len(cur) + 1) > self.max_tokens:
                batches.append(cur)
                cur, longest_new = [], self.lengths[i]
            cur.append(i)
            longest = longest_new
        if cur:
            batches.append(cur)
        if self.shuffle:
            rng.shuffle(batches)
        if self.even:
            # pad with repeats so the count divides evenly among ranks (needed for the backward all-reduce)
            rem = (-len(batches)) % self.num_replicas
            batches += batches[:rem]
        return batches

    def __iter__(self):
        return iter(self._global_batches()[self.rank::self.num_replicas])

    def __len__(self):
        return len(self._global_batches()[self.rank::self.num_replicas])


def make_collate(tok, max_len, mask_prob=0.15):
    aa_ids = torch.tensor([tok.convert_tokens_to_ids(a) for a in "LAGVSERTIDPKQNFYMHWC"])

    def collate(seqs):
        enc = tok(seqs, padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        ids = enc["input_ids"]
        labels = ids.clone()
        cand = torch.isin(ids, aa_ids) | (ids == tok.unk_token_id)
        sel = (torch.rand(ids.shape) < mask_prob) & cand
        labels[~sel] = -100
        r = torch.rand(ids.shape)
        ids[sel & (r < 0.8)] = tok.mask_token_id
        rnd = sel & (r >= 0.8) & (r < 0.9)
        ids[rnd] = aa_ids[torch.randint(len(aa_ids), (int(rnd.sum()),))]
        return ids, enc["attention_mask"], labels
    return collate


def masked_nll(model, ids, attn, labels):
    logits = model(input_ids=ids, attention_mask=attn).logits
    return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1),
                                             ignore_index=-100, reduction="sum")


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    seqs = [str(r.seq) for r in SeqIO.parse(args.fasta, "fasta")]
    random.Random(0).shuffle(seqs)  # fixed seed: identical split on every rank
    n_val = int(len(seqs) * args.valid_frac)
    val_seqs, train_seqs = seqs[:n_val], seqs[n_val:]
    lens = lambda ss: [min(len(s), args.max_len - 2) + 2 for s in ss]

    tok = EsmTokenizer.from_pretrained(args.tokenizer)
    collate = make_collate(tok, args.max_len)
    train_sampler = DistributedTokenBudgetSampler(lens(train_seqs), args.max_tokens, world, rank, seed=0)
    # no padding for validation: each sequence is scored once, ranks may run a different number of batches
    val_sampler = DistributedTokenBudgetSampler(lens(val_seqs), args.max_tokens, world, rank, shuffle=False,
                                                even=False)
    train_loader = DataLoader(train_seqs, batch_sampler=train_sampler, collate_fn=collate, num_workers=4,
                              pin_memory=True)
    val_loader = DataLoader(val_seqs, batch_sampler=val_sampler, collate_fn=collate, num_workers=2)

    cfg = EsmConfig(vocab_size=tok.vocab_size, hidden_size=640, num_hidden_layers=30, num_attention_heads=20,
                    intermediate_size=2560, max_position_embeddings=args.max_len + 2,
                    position_embedding_type="rotary", pad_token_id=tok.pad_token_id,
                    mask_token_id=tok.mask_token_id, token_dropout=True, emb_layer_norm_before=False)
    model = EsmForMaskedLM(cfg)
    model.esm.contact_head.requires_grad_(False)
    model = DDP(model.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                            betas=(0.9, 0.98), weight_decay=0.01)
    total = args.epochs * len(train_loader) // args.accum
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, max(0.1, 1 - (s - args.warmup) / max(1, total - args.warmup))))

    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (ids, attn, labels) in enumerate(train_loader):
            ids, attn, labels = ids.to(device), attn.to(device), labels.to(device)
            n_masked = (labels != -100).sum().float()
            dist.all_reduce(n_masked)
            sync = (it + 1) % args.accum == 0
            with (model.no_sync() if not sync else torch.enable_grad()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    nll = masked_nll(model, ids, attn, labels)
                # DDP averages over ranks, so scale by world to get sum / global count
                (nll * world / (n_masked * args.accum)).backward()
            if sync:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {(nll / (n_masked / world)).item():.4f}",
                      flush=True)

        model.eval()
        tot = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for ids, attn, labels in val_loader:
                ids, attn, labels = ids.to(device), attn.to(device), labels.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    tot[0] += masked_nll(model, ids, attn, labels).double()
                tot[1] += (labels != -100).sum()
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} valid ppl {math.exp((tot[0] / tot[1]).item()):.3f}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
