#!/usr/bin/env python
"""QLoRA SFT of Llama-3-8B-Instruct with a hand-written DDP loop.

Launch (single node, 4 GPUs):
    torchrun --standalone --nproc_per_node 4 06_qlora_llama_ddp_loop.py --train data/train.jsonl --val data/val.jsonl
"""
import argparse
import json
import math
import os
import random
from contextlib import nullcontext

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training, set_peft_model_state_dict
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, get_linear_schedule_with_warmup


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Meta-Llama-3-8B-Instruct")
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", default="runs/llama3-qlora")
    ap.add_argument("--max_len", type=int, default=1536)
    ap.add_argument("--bsz", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--save_every", type=int, default=250)
    ap.add_argument("--resume", default=None, help="checkpoint dir written by this script")
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def encode(example, tok, max_len):
    msgs = example["messages"]
    prompt = tok.apply_chat_template(msgs[:-1], add_generation_prompt=True)
    full = tok.apply_chat_template(msgs)
    assert full[: len(prompt)] == prompt, "chat template is not prefix-stable"
    full = full[:max_len]
    labels = ([-100] * len(prompt) + full[len(prompt):])[: len(full)]
    return {"input_ids": full, "labels": labels}


def pad_batch(items, pad_id):
    n = max(len(x["input_ids"]) for x in items)
    out = {"input_ids": [], "labels": [], "attention_mask": []}
    for x in items:
        k = n - len(x["input_ids"])
        out["input_ids"].append(x["input_ids"] + [pad_id] * k)
        out["labels"].append(x["labels"] + [-100] * k)
        out["attention_mask"].append([1] * len(x["input_ids"]) + [0] * k)
    return {key: torch.tensor(v) for key, v in out.items()}


def load_jsonl(path, tok, max_len):
    with open(path) as f:
        rows = [json.loads(l) for l in f]
    data = [encode(r, tok, max_len) for r in rows]
    return [d for d in data if any(l != -100 for l in d["labels"])], rows


@torch.no_grad()
def eval_loss(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        ntok = (batch["labels"][:, 1:] != -100).sum()
        stats[0] += out.loss.double() * ntok
        stats[1] += ntok
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    model.train()
    return (stats[0] / stats[1]).item()


@torch.no_grad()
def sample(peft_model, tok, rows, device, n=4):
    peft_model.eval()
    texts = []
    for r in rows[:n]:
        ids = tok.apply_chat_template(r["messages"][:-1], add_generation_prompt=True, return_tensors="pt").to(device)
        gen = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=256,
                                  do_sample=False, eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")],
                                  pad_token_id=tok.pad_token_id)
        texts.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    peft_model.train()
    return texts


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = "<|finetune_right_pad_id|>" if "<|finetune_right_pad_id|>" in tok.get_vocab() else tok.eos_token
    train_data, _ = load_jsonl(args.train, tok, args.max_len)
    val_data, val_rows = load_jsonl(args.val, tok, args.max_len)
    # keep the validation set a multiple of the world size so no rank sees padded duplicates
    val_data = Subset(val_data, range(len(val_data) // world * world))

    train_sampler = DistributedSampler(train_data, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_data, shuffle=False)
    collate = lambda b: pad_batch(b, tok.pad_token_id)
    train_loader = DataLoader(train_data, batch_size=args.bsz, sampler=train_sampler, collate_fn=collate,
                              num_workers=2, pin_memory=True)
    val_loader = DataLoader(val_data, batch_size=args.bsz, sampler=val_sampler, collate_fn=collate)

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)
    # one full copy of the quantised model per process, on that process's own GPU
    base = AutoModelForCausalLM.from_pretrained(args.model, quantization_config=bnb, torch_dtype=torch.bfloat16,
                                                device_map={"": local_rank})
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=True,
                                           gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=32, lora_alpha=64, lora_dropout=0.05, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(base, lora)

    start_step = 0
    if args.resume:
        set_peft_model_state_dict(peft_model, load_file(os.path.join(args.resume, "adapter_model.safetensors"),
                                                        device=f"cuda:{local_rank}"))
    model = DDP(peft_model, device_ids=[local_rank], output_device=local_rank)

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(train_loader) // args.accum
    sched = get_linear_schedule_with_warmup(opt, args.warmup, total)
    if args.resume:
        state = torch.load(os.path.join(args.resume, "trainer_state.pt"), map_location="cpu")
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start_step = state["step"]

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, batch in enumerate(train_loader):
            boundary = (i + 1) % args.accum == 0
            if step < start_step:
                step += int(boundary)
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            # skip the gradient all-reduce on accumulation micro-steps
            ctx = model.no_sync() if not boundary else nullcontext()
            with ctx:
                loss = model(**batch).loss / args.accum
                loss.backward()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 10 == 0:
                print(f"epoch {epoch} step {step}/{total} loss(rank0) {loss.item() * args.accum:.4f} "
                      f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

            if step % args.save_every == 0:
                vl = eval_loss(model, val_loader, device)
                if rank == 0:
                    ckpt = os.path.join(args.out, f"step{step}")
                    model.module.save_pretrained(ckpt)
                    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step},
                               os.path.join(ckpt, "trainer_state.pt"))
                    print(f"[eval] step {step} val_loss {vl:.4f} ppl {math.exp(vl):.2f} -> {ckpt}", flush=True)
                    for t in sample(model.module, tok, val_rows, device, n=2):
                        print("  sample:", t[:300].replace("\n", " "), flush=True)
                dist.barrier()

    vl = eval_loss(model, val_loader, device)
    if rank == 0:
        print(f"[final] val_loss {vl:.4f}", flush=True)
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
