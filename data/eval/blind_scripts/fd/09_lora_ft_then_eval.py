#!/usr/bin/env python
"""LoRA-tune a causal LM on task data for a few hundred steps, then evaluate it.

    torchrun --nproc_per_node=8 09_lora_ft_then_eval.py --model meta-llama/Llama-2-7b-hf \
        --train_file data/task_train.jsonl --eval_file data/task_test.jsonl \
        --output_dir runs/lora_task [--resume runs/lora_task/ckpt_step400.pt]
"""
import argparse
import json
import os
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--train_file", required=True)
    p.add_argument("--eval_file", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--resume", default=None)
    p.add_argument("--max_steps", type=int, default=600)
    p.add_argument("--save_every", type=int, default=200)
    p.add_argument("--per_device_bs", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--eval_bs", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=64)
    return p.parse_args()


class SFTData(Dataset):
    def __init__(self, path, tok, max_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        p_ids = self.tok(r["prompt"], add_special_tokens=True)["input_ids"]
        a_ids = self.tok(r["response"] + self.tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (p_ids + a_ids)[: self.max_len]
        labels = ([-100] * len(p_ids) + a_ids)[: self.max_len]
        return ids, labels


def pad_collate(batch, pad_id):
    L = max(len(x[0]) for x in batch)
    ids = torch.full((len(batch), L), pad_id)
    labels = torch.full((len(batch), L), -100)
    mask = torch.zeros((len(batch), L), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.output_dir, exist_ok=True)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or tok.unk_token

    base = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    lora_cfg = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.05,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          task_type="CAUSAL_LM")
    model = get_peft_model(base, lora_cfg).to(device)
    if rank == 0:
        model.print_trainable_parameters()

    start_step, ckpt = 0, None
    if args.resume:
        ckpt = torch.load(args.resume)
        set_peft_model_state_dict(model, ckpt["lora"])
        start_step = ckpt["step"]

    model = DDP(model, device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.max_steps)
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        del ckpt

    train_ds = SFTData(args.train_file, tok, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=17)
    loader = DataLoader(train_ds, batch_size=args.per_device_bs, sampler=sampler, num_workers=2,
                        collate_fn=partial(pad_collate, pad_id=tok.pad_token_id))

    model.train()
    step = start_step
    epoch = step // len(loader)
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            if step >= args.max_steps:
                break
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 20 == 0 and rank == 0:
                print(f"step {step} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
            if step % args.save_every == 0:
                if rank == 0:
                    torch.save({"lora": get_peft_model_state_dict(model.module),
                                "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(),
                                "step": step},
                               os.path.join(args.output_dir, f"ckpt_step{step}.pt"))
                dist.barrier()
        epoch += 1

    # ---------------- evaluation ----------------
    model.eval()
    peft_model = model.module
    tok.padding_side = "left"
    with open(args.eval_file) as f:
        eval_rows = [json.loads(l) for l in f]
    mine = list(range(rank, len(eval_rows), world))
    local = []
    with torch.no_grad():
        for s in range(0, len(mine), args.eval_bs):
            idx = mine[s : s + args.eval_bs]
            enc = tok([eval_rows[i]["prompt"] for i in idx], return_tensors="pt",
                      padding=True).to(device)
            out = peft_model.generate(**enc, max_new_tokens=args.max_new_tokens,
                                      do_sample=False, pad_token_id=tok.pad_token_id)
            preds = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            local.extend((i, p.strip()) for i, p in zip(idx, preds))

    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    if rank == 0:
        preds = dict(x for part in gathered for x in part)
        em = sum(preds[i] == eval_rows[i]["response"].strip() for i in preds) / len(eval_rows)
        print(f"exact match: {em:.4f} ({len(preds)} examples)")
        with open(os.path.join(args.output_dir, "eval.json"), "w") as f:
            json.dump({"exact_match": em, "step": step, "n": len(preds)}, f, indent=2)
        peft_model.save_pretrained(os.path.join(args.output_dir, "final_adapter"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
