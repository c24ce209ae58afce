"""Masked-LM pretraining of a 350M encoder with FSDP2.

Usage (single node, 8 GPUs):
    torchrun --standalone --nproc_per_node=8 06_encoder_mlm_fsdp2.py --train-dir /datasets/enc/train_arrow
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoTokenizer, DataCollatorForLanguageModeling


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-dir", required=True)
    p.add_argument("--val-dir", default=None)
    p.add_argument("--tokenizer", default="FacebookAI/roberta-base")
    p.add_argument("--ckpt-dir", default="/checkpoints/enc-350m")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--warmup", type=int, default=10000)
    p.add_argument("--total-steps", type=int, default=250000)
    p.add_argument("--mlm-prob", type=float, default=0.15)
    p.add_argument("--save-every", type=int, default=5000)
    p.add_argument("--eval-every", type=int, default=2500)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class EncoderLayer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln1 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, 4 * d)
        self.ff2 = nn.Linear(4 * d, d)
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x, key_padding_mask):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        mask = key_padding_mask[:, None, None, :].to(torch.bool)  # True = attend
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.ln1(x + self.out(a.transpose(1, 2).reshape(B, T, D)))
        return self.ln2(x + self.ff2(F.gelu(self.ff1(x))))


class Encoder(nn.Module):
    def __init__(self, vocab, d, n_layers, h, max_len):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.emb_ln = nn.LayerNorm(d)
        self.layers = nn.ModuleList([EncoderLayer(d, h) for _ in range(n_layers)])
        self.mlm_dense = nn.Linear(d, d)
        self.mlm_ln = nn.LayerNorm(d)
        self.decoder = nn.Linear(d, vocab)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, input_ids, attention_mask):
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.emb_ln(self.emb(input_ids) + self.pos(pos))
        for layer in self.layers:
            x = layer(x, attention_mask)
        return self.decoder(self.mlm_ln(F.gelu(self.mlm_dense(x))))


def lr_lambda(step, warmup, total):
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda")

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    collator = DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=args.mlm_prob,
                                               pad_to_multiple_of=8)
    train_ds = load_from_disk(args.train_dir).with_format("torch", columns=["input_ids"])
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, collate_fn=collator,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = None
    if args.val_dir:
        val_ds = load_from_disk(args.val_dir).with_format("torch", columns=["input_ids"])
        val_loader = DataLoader(val_ds, batch_size=args.batch_size, collate_fn=collator,
                                sampler=DistributedSampler(val_ds, shuffle=False), num_workers=2)

    torch.manual_seed(0)
    model = Encoder(len(tok), args.hidden, args.layers, args.heads, args.max_len)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)

    no_decay = ("bias", "ln", "emb_ln")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)

    step = 0
    meta_path = os.path.join(args.ckpt_dir, "latest.txt")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            step = int(f.read())
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=os.path.join(args.ckpt_dir, f"step{step}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed at step {step}")

    def evaluate():
        model.eval()
        acc = torch.zeros(3, device=dev)
        with torch.no_grad():
            for batch in val_loader:
                ids = batch["input_ids"].to(dev)
                labels = batch["labels"].to(dev)
                logits = model(ids, (ids != tok.pad_token_id))
                m = labels != -100
                acc[0] += F.cross_entropy(logits[m].float(), labels[m], reduction="sum")
                acc[1] += (logits[m].argmax(-1) == labels[m]).sum()
                acc[2] += m.sum()
        dist.all_reduce(acc)
        model.train()
        return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()

    model.train()
    t0 = time.time()
    while step < args.total_steps:
        for batch in train_loader:
            ids = batch["input_ids"].to(dev, non_blocking=True)
            labels = batch["labels"].to(dev, non_blocking=True)
            logits = model(ids, (ids != tok.pad_token_id))
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            lr = args.lr * lr_lambda(step, args.warmup, args.total_steps)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} mlm_loss {l.item():.4f} lr {lr:.2e} "
                          f"({(time.time() - t0) / 50:.3f}s/it)", flush=True)
                t0 = time.time()
            if val_loader is not None and step % args.eval_every == 0:
                vl, va = evaluate()
                if rank == 0:
                    print(f"step {step} val_loss {vl:.4f} val_acc {va:.4f} ppl {math.exp(vl):.2f}")
            if step % args.save_every == 0:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd},
                         checkpoint_id=os.path.join(args.ckpt_dir, f"step{step}"))
                if rank == 0:
                    with open(meta_path, "w") as f:
                        f.write(str(step))
            if step >= args.total_steps:
                break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
