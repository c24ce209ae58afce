#!/usr/bin/env python
# TIGER-large on the full catalogue with DeepSpeed ZeRO-3 + bf16.
# After training, the code-token embeddings are exported so that the serving side can build a
# dense item index (item vector = mean of its semantic-ID token embeddings) for hybrid retrieval.
#
#   deepspeed --num_gpus 8 14_tiger_deepspeed_z3_codebook.py --data data/steam --out ckpt/steam_tiger_l
import argparse
import json
import os
import time

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import T5Config, T5ForConditionalGeneration

PAD, EOS = 0, 1


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--K", type=int, default=256)
    p.add_argument("--d_model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--micro_bs", type=int, default=64)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


class Seqs(Dataset):
    def __init__(self, file, sem, K, split):
        with open(file) as f:
            seqs = json.load(f)
        self.sem, self.K = sem, K
        self.x = []
        for s in seqs:
            if split == "train":
                self.x += [(s[max(0, t - 20):t], s[t]) for t in range(1, len(s) - 2)]
            else:
                self.x.append((s[-22:-2], s[-2]))

    def tok(self, it):
        return [2 + l * self.K + int(c) for l, c in enumerate(self.sem[it])]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        h, t = self.x[i]
        return [v for it in h for v in self.tok(it)], self.tok(t) + [EOS]


def collate(b):
    L = max(len(s) for s, _ in b)
    src = torch.zeros(len(b), L, dtype=torch.long)
    for i, (s, _) in enumerate(b):
        src[i, :len(s)] = torch.tensor(s)
    return src, (src != PAD).long(), torch.tensor([t for _, t in b])


def main():
    args = parse()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    sem = np.load(os.path.join(args.data, "sem_ids.npy"))
    n_levels, n_items = sem.shape[1], sem.shape[0]
    train = Seqs(os.path.join(args.data, "seqs.json"), sem, args.K, "train")
    valid = Seqs(os.path.join(args.data, "seqs.json"), sem, args.K, "valid")
    tr_sampler = DistributedSampler(train, shuffle=True, seed=42)
    va_sampler = DistributedSampler(valid, shuffle=False, drop_last=True)
    tr_dl = DataLoader(train, batch_size=args.micro_bs, sampler=tr_sampler, collate_fn=collate,
                       num_workers=4, pin_memory=True, drop_last=True)
    va_dl = DataLoader(valid, batch_size=args.micro_bs, sampler=va_sampler, collate_fn=collate, num_workers=2)

    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.05}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": args.epochs * len(tr_dl) // args.accum,
                                 "warmup_num_steps": 1000}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 1e4,
                              "stage3_gather_16bit_weights_on_model_save": True},
    }

    cfg = T5Config(vocab_size=2 + n_levels * args.K, d_model=args.d_model, d_ff=4 * args.d_model, d_kv=64,
                   num_layers=args.layers, num_heads=args.d_model // 64, dropout_rate=0.1,
                   pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD)
    model = T5ForConditionalGeneration(cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    best = float("inf")
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        engine.train()
        t0 = time.time()
        agg = torch.zeros(2, device=device)
        for src, mask, lab in tr_dl:
            out = engine(input_ids=src.to(device), attention_mask=mask.to(device), labels=lab.to(device))
            engine.backward(out.loss)
            engine.step()
            agg += torch.stack([out.loss.detach().float(), torch.ones((), device=device)])

        engine.eval()
        ev = torch.zeros(3, device=device)
        with torch.no_grad():
            for src, mask, lab in va_dl:
                src, mask, lab = src.to(device), mask.to(device), lab.to(device)
                out = engine(input_ids=src, attention_mask=mask, labels=lab)
                exact = (out.logits.argmax(-1)[:, :n_levels] == lab[:, :n_levels]).all(-1).sum()
                ev += torch.stack([out.loss.float() * src.size(0), exact.float(),
                                   torch.tensor(float(src.size(0)), device=device)])
        dist.all_reduce(agg)
        dist.all_reduce(ev)
        val_loss = (ev[0] / ev[2]).item()
        if rank == 0:
            print(f"epoch {epoch} train {(agg[0] / agg[1]).item():.4f} val {val_loss:.4f} "
                  f"exact {(ev[1] / ev[2]).item():.4f} [{time.time() - t0:.0f}s]", flush=True)
        engine.save_checkpoint(args.out, tag="last")
        if val_loss < best:
            best = val_loss
            engine.save_16bit_model(os.path.join(args.out, "best"), "pytorch_model.bin")

    # ---- export code-token embeddings and the derived dense item index ----
    if rank == 0:
        W = engine.module.get_input_embeddings().weight.detach().float().cpu()
        code_emb = W[2:2 + n_levels * args.K].view(n_levels, args.K, -1)
        item_vecs = torch.stack([code_emb[l, torch.from_numpy(sem[:, l])] for l in range(n_levels)], 0).mean(0)
        np.save(os.path.join(args.out, "code_token_emb.npy"), code_emb.numpy())
        np.save(os.path.join(args.out, "item_dense_index.npy"), item_vecs.numpy())
        print(f"exported {n_items} item vectors of dim {item_vecs.size(1)}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
