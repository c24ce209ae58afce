"""
TIGER generative retrieval, larger T5 backbone sharded with FSDP.

Semantic IDs come from the frozen RQ-VAE (artifacts/<ds>/sem_ids.npy, 4 levels incl. the
collision level). Validation here is teacher-forced token loss / exact-match accuracy of
the next item's full semantic ID; beam-search recall is computed offline from the saved
full checkpoint.

  torchrun --standalone --nproc_per_node=8 07_tiger_fsdp_train.py --dataset beauty
"""
import argparse
import functools
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import T5Config, T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Block

PAD, EOS = 0, 1


class TigerData(Dataset):
    def __init__(self, seq_file, sem_ids, K, split, max_items=20):
        with open(seq_file) as f:
            seqs = [json.loads(l)["items"] for l in f]
        self.sem, self.K, self.max_items = sem_ids, K, max_items
        self.pairs = []
        for s in seqs:
            if split == "train":
                self.pairs += [(s[max(0, t - max_items):t], s[t]) for t in range(1, len(s) - 2)]
            elif split == "valid":
                self.pairs.append((s[-2 - max_items:-2], s[-2]))

    def toks(self, item):
        return [2 + l * self.K + int(c) for l, c in enumerate(self.sem[item])]

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        h, t = self.pairs[i]
        return [x for it in h for x in self.toks(it)], self.toks(t) + [EOS]


def collate(batch, max_src):
    n = len(batch)
    src = torch.full((n, max_src), PAD, dtype=torch.long)
    for i, (s, _) in enumerate(batch):
        s = s[-max_src:]
        src[i, :len(s)] = torch.tensor(s)
    labels = torch.tensor([t for _, t in batch], dtype=torch.long)
    return src, (src != PAD).long(), labels


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size(), local_rank


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="beauty")
    ap.add_argument("--root", default="data")
    ap.add_argument("--K", type=int, default=256)
    ap.add_argument("--d_model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--micro_bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--save_dir", default="checkpoints")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rank, world, local_rank = setup()
    torch.manual_seed(args.seed)
    device = torch.cuda.current_device()

    root = os.path.join(args.root, args.dataset)
    sem = np.load(os.path.join(root, "sem_ids.npy"))
    n_levels = sem.shape[1]
    train_ds = TigerData(os.path.join(root, "seqs.jsonl"), sem, args.K, "train")
    valid_ds = TigerData(os.path.join(root, "seqs.jsonl"), sem, args.K, "valid")
    max_src = 20 * n_levels
    coll = functools.partial(collate, max_src=max_src)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    va_sampler = DistributedSampler(valid_ds, shuffle=False, drop_last=True)
    tr_dl = DataLoader(train_ds, batch_size=args.micro_bs, sampler=tr_sampler, collate_fn=coll,
                       num_workers=6, pin_memory=True, drop_last=True)
    va_dl = DataLoader(valid_ds, batch_size=128, sampler=va_sampler, collate_fn=coll, num_workers=2)

    cfg = T5Config(vocab_size=2 + n_levels * args.K, d_model=args.d_model, d_ff=4 * args.d_model,
                   d_kv=args.d_model // args.heads, num_layers=args.layers, num_heads=args.heads,
                   dropout_rate=0.1, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD,
                   tie_word_embeddings=False)
    model = T5ForConditionalGeneration(cfg)
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap, mixed_precision=bf16, device_id=device,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(tr_dl),
                                                pct_start=0.05)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        n_params = sum(p.numel() for p in model.parameters()) * world
        print(f"~{n_params / 1e6:.1f}M params, {len(train_ds)} train pairs, world {world}")

    best_acc = 0.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        ls = torch.zeros(2, device=device)
        for src, mask, labels in tr_dl:
            src, mask, labels = src.to(device), mask.to(device), labels.to(device)
            loss = model(input_ids=src, attention_mask=mask, labels=labels).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            ls += torch.stack([loss.detach().float(), torch.ones((), device=device)])

        model.eval()
        ev = torch.zeros(3, device=device)
        with torch.no_grad():
            for src, mask, labels in va_dl:
                src, mask, labels = src.to(device), mask.to(device), labels.to(device)
                out = model(input_ids=src, attention_mask=mask, labels=labels)
                pred = out.logits.argmax(-1)[:, :n_levels]
                exact = (pred == labels[:, :n_levels]).all(-1).float().sum()
                ev += torch.stack([out.loss.float() * src.size(0), exact, torch.tensor(float(src.size(0)), device=device)])
        dist.all_reduce(ls)
        dist.all_reduce(ev)
        val_loss, val_acc = (ev[0] / ev[2]).item(), (ev[1] / ev[2]).item()
        if rank == 0:
            print(f"epoch {epoch:3d} train {ls[0].item() / ls[1].item():.4f} val_loss {val_loss:.4f} "
                  f"exact@1 {val_acc:.4f} ({time.time() - t0:.0f}s)", flush=True)

        if val_acc > best_acc:
            best_acc = val_acc
            if rank == 0:
                save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg):
                    state = model.state_dict()
                torch.save({"model": state, "config": cfg.to_dict(), "epoch": epoch, "exact": val_acc},
                           os.path.join(args.save_dir, f"tiger_{args.dataset}_best.pt"))
                print(f"  saved best (exact@1 {val_acc:.4f})")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
