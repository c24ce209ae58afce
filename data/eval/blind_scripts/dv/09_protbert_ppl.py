"""ProtBERT-style MLM (space-separated residues, BERT WordPiece vocab of single AAs)
trained on BFD-filtered enzyme sequences.  Validation perplexity is used to pick the
checkpoint that goes into the EC-number fine-tuning runs.

    torchrun --nproc_per_node=4 09_protbert_ppl.py --config configs/protbert_enzymes.json
"""
import argparse
import json
import math
import os
import re
import time
from dataclasses import dataclass, field

import pandas as pd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast, DataCollatorForLanguageModeling
from transformers.optimization import get_linear_schedule_with_warmup


@dataclass
class Config:
    train_csv: str = "data/enzymes_train.csv"
    valid_csv: str = "data/enzymes_valid.csv"
    tokenizer: str = "Rostlab/prot_bert"
    out_dir: str = "runs/protbert_enz"
    max_len: int = 512
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    batch_size: int = 24
    lr: float = 2e-4
    warmup_ratio: float = 0.05
    epochs: int = 10
    grad_clip: float = 1.0
    fp16: bool = True
    log_every: int = 100
    extra: dict = field(default_factory=dict)


class SeqCSV(Dataset):
    def __init__(self, csv, tokenizer, max_len):
        df = pd.read_csv(csv, usecols=["sequence"])
        # ProtBERT expects space-separated residues with rare AAs mapped to X
        self.seqs = [" ".join(re.sub(r"[UZOB]", "X", s)) for s in df["sequence"].str.upper()]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        enc = self.tok(self.seqs[i], truncation=True, max_length=self.max_len, return_special_tokens_mask=True)
        return {k: v for k, v in enc.items()}


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank, dist.get_rank(), dist.get_world_size()


@torch.no_grad()
def evaluate(model, loader, device, fp16):
    model.eval()
    total_loss, total_tokens = 0.0, 0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
            out = model(**batch)
        n = (batch["labels"] != -100).sum().item()
        total_loss += out.loss.item() * n
        total_tokens += n
    model.train()
    avg = total_loss / max(total_tokens, 1)
    return avg, math.exp(avg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()
    cfg = Config()
    if args.config:
        with open(args.config) as fh:
            for k, v in json.load(fh).items():
                setattr(cfg, k, v)

    local_rank, rank, world = setup()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = BertTokenizerFast.from_pretrained(cfg.tokenizer, do_lower_case=False)
    bert_cfg = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                          num_attention_heads=cfg.heads, intermediate_size=4 * cfg.hidden,
                          max_position_embeddings=cfg.max_len, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM(bert_cfg).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_ds = SeqCSV(cfg.train_csv, tokenizer, cfg.max_len)
    valid_ds = SeqCSV(cfg.valid_csv, tokenizer, cfg.max_len)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler, collate_fn=collator,
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=2 * cfg.batch_size, sampler=valid_sampler,
                              collate_fn=collator, num_workers=2)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(x in n for x in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(x in n for x in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=cfg.lr)
    total_steps = cfg.epochs * len(train_loader)
    sched = get_linear_schedule_with_warmup(opt, int(cfg.warmup_ratio * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.fp16)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"{len(train_ds)} train / {len(valid_ds)} valid sequences, {world} GPUs, {total_steps} steps")

    best_ppl, step = float("inf"), 0
    history = []
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.fp16):
                loss = model(**batch).loss
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if rank == 0 and step % cfg.log_every == 0:
                print(f"epoch {epoch} step {step}/{total_steps} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)", flush=True)

        val_loss, val_ppl = evaluate(model, valid_loader, device, cfg.fp16)
        if rank == 0:
            print(f"== epoch {epoch}: valid loss {val_loss:.4f}, perplexity {val_ppl:.3f}", flush=True)
            history.append({"epoch": epoch, "step": step, "valid_loss": val_loss, "valid_ppl": val_ppl})
            with open(os.path.join(cfg.out_dir, "metrics.json"), "w") as fh:
                json.dump(history, fh, indent=1)
            model.module.save_pretrained(os.path.join(cfg.out_dir, "last"))
            if val_ppl < best_ppl:
                best_ppl = val_ppl
                model.module.save_pretrained(os.path.join(cfg.out_dir, "best"))
                tokenizer.save_pretrained(os.path.join(cfg.out_dir, "best"))
                print(f"   new best perplexity {best_ppl:.3f}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
