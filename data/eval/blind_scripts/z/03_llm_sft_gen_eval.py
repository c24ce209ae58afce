# -*- coding: utf-8 -*-
"""
小模型（Qwen2.5-0.5B）指令微调，训练过程中定期：
  1) 在验证集上算 loss / ppl（各卡结果 all_reduce）
  2) 抽一部分验证样本做 greedy 生成，统计 exact match

torchrun --nproc_per_node=4 03_llm_sft_gen_eval.py --train data/sft_train.jsonl --val data/sft_val.jsonl
"""
import argparse
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

IGNORE_INDEX = -100
PROMPT_TMPL = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-0.5B")
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", default="./ckpt/qwen_sft")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--bs", type=int, default=8, help="每卡 batch")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--gen-samples", type=int, default=256, help="参与生成评测的验证样本数")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(l) for l in f if l.strip()]


class SFTDataset(Dataset):
    def __init__(self, rows, tok, max_len):
        self.rows, self.tok, self.max_len = rows, tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        prompt = PROMPT_TMPL.format(q=r["instruction"])
        answer = r["output"] + "<|im_end|>"
        p_ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = self.tok(answer, add_special_tokens=False)["input_ids"]
        ids = (p_ids + a_ids)[: self.max_len]
        labels = ([IGNORE_INDEX] * len(p_ids) + a_ids)[: self.max_len]
        return {"input_ids": ids, "labels": labels}


def pad_collate(pad_id):
    def _fn(batch):
        L = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        lab = torch.full((len(batch), L), IGNORE_INDEX, dtype=torch.long)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            ids[i, :n] = torch.tensor(b["input_ids"])
            lab[i, :n] = torch.tensor(b["labels"])
            att[i, :n] = 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}
    return _fn


@torch.no_grad()
def eval_loss(model, loader, device):
    raw = model.module
    raw.eval()
    tot = torch.zeros(2, device=device)  # [loss*tokens, tokens]
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = raw(**batch)
        n_tok = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
        tot[0] += out.loss.float() * n_tok
        tot[1] += n_tok
    dist.all_reduce(tot)
    raw.train()
    return (tot[0] / tot[1]).item()


@torch.no_grad()
def eval_generate(model, tok, rows, device, rank, world_size, max_new_tokens):
    """每张卡负责 rows[rank::world_size]，左 padding 做批量 greedy 生成。"""
    model.eval()
    my_rows = rows[rank::world_size]
    hit = torch.zeros(2, device=device)  # [命中数, 样本数]
    tok.padding_side = "left"
    for s in range(0, len(my_rows), 16):
        chunk = my_rows[s: s + 16]
        prompts = [PROMPT_TMPL.format(q=r["instruction"]) for r in chunk]
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 use_cache=True, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for r, t in zip(chunk, texts):
            hit[0] += float(t.strip() == r["output"].strip())
            hit[1] += 1
    tok.padding_side = "right"
    dist.all_reduce(hit)
    model.train()
    return (hit[0] / hit[1].clamp(min=1)).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.config.use_cache = False
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    train_rows, val_rows = read_jsonl(args.train), read_jsonl(args.val)
    train_ds = SFTDataset(train_rows, tok, args.max_len)
    val_ds = SFTDataset(val_rows, tok, args.max_len)
    collate = pad_collate(tok.pad_token_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler,
                              collate_fn=collate, num_workers=2, drop_last=True)
    # 验证 loss 用按 token 加权求和，再 all_reduce，所以每卡直接切片不补齐
    val_loader = DataLoader(Subset(val_ds, list(range(rank, len(val_ds), world_size))),
                            batch_size=args.bs, collate_fn=collate, num_workers=2)
    gen_rows = random.Random(0).sample(val_rows, min(args.gen_samples, len(val_rows)))

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total_steps = len(train_loader) * args.epochs
    sched = get_cosine_schedule_with_warmup(optim, int(0.03 * total_steps), total_steps)

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    best_loss = float("inf")
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1

            if rank == 0 and step % 20 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                print(f"[epoch {epoch} step {step}] loss={loss.item():.4f} "
                      f"{(time.time() - t0) / 20:.2f}s/it", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                vloss = eval_loss(model, val_loader, device)
                em = eval_generate(model, tok, gen_rows, device, rank, world_size, args.max_new_tokens)
                if rank == 0:
                    print(f"[eval step {step}] val_loss={vloss:.4f} ppl={math.exp(vloss):.2f} EM={em:.4f}", flush=True)
                    writer.add_scalar("eval/loss", vloss, step)
                    writer.add_scalar("eval/em", em, step)
                    if vloss < best_loss:
                        best_loss = vloss
                        model.module.save_pretrained(os.path.join(args.out, "best"))
                        tok.save_pretrained(os.path.join(args.out, "best"))
                        print(f"保存最优模型，val_loss={vloss:.4f}", flush=True)
                dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
