"""
Domain-adaptive MLM pretraining (ModernBERT-base) on a folder of clinical notes (.txt).
Notes are tokenized once into a flat token cache next to the corpus, then packed
into 1024-token blocks.

torchrun --nnodes=1 --nproc_per_node=8 11_mlm_domain_adapt_cache.py \
    --corpus /data/notes_2024 --out /ckpt/modernbert_clinical
"""
import argparse
import glob
import hashlib
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForMaskedLM, AutoTokenizer, DataCollatorForLanguageModeling

CACHE_NAME = "tokens_{model}_{h}.npy"


def corpus_hash(files):
    h = hashlib.md5()
    for f in files:
        h.update(f.encode())
        h.update(str(os.path.getsize(f)).encode())
    return h.hexdigest()[:10]


def build_or_load_tokens(corpus_dir, tok, model_name, show_progress):
    files = sorted(glob.glob(os.path.join(corpus_dir, "**", "*.txt"), recursive=True))
    tag = model_name.replace("/", "_")
    cache = os.path.join(corpus_dir, CACHE_NAME.format(model=tag, h=corpus_hash(files)))
    if os.path.exists(cache):
        return np.load(cache, mmap_mode="r")

    pieces = []
    for f in tqdm(files, disable=not show_progress, desc="tokenizing"):
        with open(f, encoding="utf-8", errors="ignore") as fh:
            text = fh.read()
        ids = tok(text, add_special_tokens=False)["input_ids"]
        pieces.append(np.asarray(ids + [tok.sep_token_id], dtype=np.int32))
    arr = np.concatenate(pieces)
    np.save(cache, arr)
    return np.load(cache, mmap_mode="r")


class Blocks(Dataset):
    def __init__(self, tokens, block, cls_id, sep_id):
        self.t = tokens
        self.inner = block - 2
        self.n = len(tokens) // self.inner
        self.cls, self.sep = cls_id, sep_id

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = i * self.inner
        ids = [self.cls] + self.t[s : s + self.inner].tolist() + [self.sep]
        return {"input_ids": ids}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--model", default="answerdotai/ModernBERT-base")
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--mlm_prob", type=float, default=0.3)
    ap.add_argument("--out", default="/ckpt/mlm")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    tokens = build_or_load_tokens(args.corpus, tok, args.model, show_progress=(rank == 0))
    ds = Blocks(tokens, args.block, tok.cls_token_id, tok.sep_token_id)
    if rank == 0:
        print(f"{len(tokens):,} tokens -> {len(ds):,} blocks of {args.block}", flush=True)

    collator = DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=args.mlm_prob)
    sampler = DistributedSampler(ds, shuffle=True, seed=42, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, collate_fn=collator,
                    num_workers=6, pin_memory=True, drop_last=True)

    model = AutoModelForMaskedLM.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    total = len(dl) * args.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total,
                                                pct_start=0.06, anneal_strategy="linear")

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        window = torch.zeros(2, device=device)
        for batch in dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(**batch)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            window[0] += out.loss.detach()
            window[1] += 1
            if step % 100 == 0:
                dist.all_reduce(window)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} mlm_loss {window[0] / window[1]:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0):.0f}s", flush=True)
                window.zero_()

        if rank == 0:
            save_dir = os.path.join(args.out, f"epoch{epoch}")
            model.module.save_pretrained(save_dir)
            tok.save_pretrained(save_dir)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
