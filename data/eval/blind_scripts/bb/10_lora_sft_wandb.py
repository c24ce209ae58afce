"""LoRA SFT of Llama-3-8B on OpenHermes with packed sequences, torchrun + DDP, tracked in W&B.

    WANDB_PROJECT=hermes-lora torchrun --nproc_per_node=8 10_lora_sft_wandb.py --run_name l3-8b-r64
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import wandb
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Meta-Llama-3-8B")
    ap.add_argument("--dataset", default="teknium/OpenHermes-2.5")
    ap.add_argument("--run_name", default=None)
    ap.add_argument("--output_dir", default="runs/hermes-lora")
    ap.add_argument("--seq_len", type=int, default=4096)
    ap.add_argument("--micro_bsz", type=int, default=1)
    ap.add_argument("--accum", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--r", type=int, default=64)
    ap.add_argument("--alpha", type=int, default=128)
    ap.add_argument("--eval_every", type=int, default=250)
    ap.add_argument("--save_every", type=int, default=1000)
    ap.add_argument("--n_eval", type=int, default=4096)
    return ap.parse_args()


ROLE_MAP = {"system": "system", "human": "user", "gpt": "assistant"}


def to_text(ex, tok):
    msgs = [{"role": ROLE_MAP[t["from"]], "content": t["value"]} for t in ex["conversations"]]
    return {"text": tok.apply_chat_template(msgs, tokenize=False)}


def pack_texts(batch, tok, seq_len):
    ids = tok(batch["text"], add_special_tokens=False)["input_ids"]
    stream = []
    for x in ids:
        stream.extend(x)
        stream.append(tok.eos_token_id)
    n = len(stream) // seq_len
    chunks = [stream[i * seq_len:(i + 1) * seq_len] for i in range(n)]
    return {"input_ids": chunks, "labels": [c[:] for c in chunks], "attention_mask": [[1] * seq_len] * n}


@torch.no_grad()
def eval_loss(model, dl, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for b in dl:
        b = {k: v.to(device) for k, v in b.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            s[0] += model(**b).loss.float()
        s[1] += 1
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "sft"), name=args.run_name,
                     config={**vars(args), "world_size": world})

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.chat_template is None:
        tok.chat_template = (
            "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{{ m['content'] }}<|eot_id|>{% endfor %}"
        )

    if rank != 0:
        dist.barrier()
    raw = load_dataset(args.dataset, split="train").shuffle(seed=1234)
    raw = raw.map(to_text, fn_kwargs={"tok": tok}, remove_columns=raw.column_names, num_proc=32)
    eval_raw, train_raw = raw.select(range(args.n_eval)), raw.select(range(args.n_eval, len(raw)))
    pack_kw = {"tok": tok, "seq_len": args.seq_len}
    train_ds = train_raw.map(pack_texts, batched=True, batch_size=2000, fn_kwargs=pack_kw,
                             remove_columns=["text"], num_proc=32)
    eval_ds = eval_raw.map(pack_texts, batched=True, batch_size=2000, fn_kwargs=pack_kw, remove_columns=["text"])
    if rank == 0:
        dist.barrier()

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    eval_sampler = DistributedSampler(eval_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bsz, sampler=train_sampler,
                          collate_fn=default_data_collator, num_workers=4, pin_memory=True)
    eval_dl = DataLoader(eval_ds, batch_size=args.micro_bsz, sampler=eval_sampler, collate_fn=default_data_collator)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=0.05,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    total = math.ceil(len(train_dl) / args.accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, 100, total)
    if rank == 0:
        print(f"trainable params: {sum(p.numel() for p in trainable):,}; {total} optimizer steps", flush=True)

    step, micro = 0, 0
    tic = time.time()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for b in train_dl:
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            micro += 1
            boundary = micro % args.accum == 0
            if boundary:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**b).loss
                (loss / args.accum).backward()
            else:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(**b).loss
                    (loss / args.accum).backward()
                continue

            gnorm = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                elapsed = time.time() - tic
                wandb.log({"train/loss": l.item(), "train/grad_norm": gnorm.item(),
                           "train/lr": sched.get_last_lr()[0],
                           "perf/tokens_per_s": 10 * args.accum * args.micro_bsz * args.seq_len * world / elapsed},
                          step=step)
                tic = time.time()

            if step % args.eval_every == 0:
                vl = eval_loss(model, eval_dl, device)
                wandb.log({"eval/loss": vl, "eval/ppl": math.exp(vl)}, step=step)
                if rank == 0:
                    print(f"step {step}: eval loss {vl:.4f}", flush=True)

            if step % args.save_every == 0 and rank == 0:
                model.module.save_pretrained(os.path.join(args.output_dir, f"checkpoint-{step}"))

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
        tok.save_pretrained(os.path.join(args.output_dir, "final"))
    run.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
