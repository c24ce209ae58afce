#!/usr/bin/env python
"""LoRA SFT for Qwen2.5-7B on a domain QA set, with sample generations after every epoch.

  torchrun --nproc_per_node 8 15_qwen25_lora_samples.py --train data/qa_train.jsonl --heldout data/qa_heldout.jsonl
"""
import argparse
import json
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

SYSTEM = "You are a precise assistant for internal documentation questions. Answer concisely."


def cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-7B")
    ap.add_argument("--train", required=True)
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--out", default="runs/qwen25-qa-lora")
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--num_samples", type=int, default=6)
    ap.add_argument("--seed", type=int, default=2024)
    return ap.parse_args()


def chat(q, a=None):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
    if a is not None:
        msgs.append({"role": "assistant", "content": a})
    return msgs


def encode(rec, tok, max_len):
    prompt = tok.apply_chat_template(chat(rec["question"]), add_generation_prompt=True)
    full = tok.apply_chat_template(chat(rec["question"], rec["answer"]))
    labels = [-100] * len(prompt) + full[len(prompt):]
    return {"input_ids": full[:max_len], "labels": labels[:max_len]}


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


class PadCollator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, feats):
        n = max(len(f["input_ids"]) for f in feats)
        ids = torch.full((len(feats), n), self.pad_id, dtype=torch.long)
        labels = torch.full((len(feats), n), -100, dtype=torch.long)
        mask = torch.zeros((len(feats), n), dtype=torch.long)
        for i, f in enumerate(feats):
            k = len(f["input_ids"])
            ids[i, :k] = torch.tensor(f["input_ids"])
            labels[i, :k] = torch.tensor(f["labels"])
            mask[i, :k] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@torch.no_grad()
def heldout_loss(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for b in loader:
        b = {k: v.to(device) for k, v in b.items()}
        loss = model(**b).loss
        n = (b["labels"][:, 1:] != -100).sum()
        t[0] += loss.float() * n
        t[1] += n
    dist.all_reduce(t)
    model.train()
    return (t[0] / t[1]).item()


@torch.no_grad()
def generate_samples(model, tok, records, device, max_new_tokens=256):
    model.eval()
    results = []
    for rec in records:
        enc = tok.apply_chat_template(chat(rec["question"]), add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True).to(device)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        results.append({"question": rec["question"], "reference": rec["answer"],
                        "generated": tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)})
    model.train()
    return results


def main():
    args = cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = "<|endoftext|>"
    train_recs, held_recs = read_jsonl(args.train), read_jsonl(args.heldout)
    train_data = [encode(r, tok, args.max_len) for r in train_recs]
    held_data = [encode(r, tok, args.max_len) for r in held_recs]

    collator = PadCollator(tok.pad_token_id)
    sampler = DistributedSampler(train_data, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_data, batch_size=args.bs, sampler=sampler, collate_fn=collator, num_workers=2)
    held_dl = DataLoader(held_data, batch_size=args.bs, sampler=DistributedSampler(held_data, shuffle=False),
                         collate_fn=collator)

    base = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                attn_implementation="flash_attention_2")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, lora).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    n_steps = args.epochs * (len(train_dl) // args.accum)
    sched = get_cosine_schedule_with_warmup(opt, max(1, n_steps // 30), n_steps)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for i, b in enumerate(train_dl):
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            sync_now = (i + 1) % args.accum == 0
            with (nullcontext() if sync_now else model.no_sync()):
                loss = model(**b).loss
                (loss / args.accum).backward()
            if not sync_now:
                continue
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{n_steps} loss {avg.item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {time.time() - tic:.1f}s", flush=True)
                tic = time.time()

        hl = heldout_loss(model, held_dl, device)
        if rank == 0:
            print(f"== epoch {epoch} heldout loss {hl:.4f}", flush=True)
            samples = generate_samples(model, tok, held_recs[: args.num_samples], device)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"samples_epoch{epoch}.jsonl"), "w") as f:
                for s in samples:
                    f.write(json.dumps(s, ensure_ascii=False) + "\n")
            model.module.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
        dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
