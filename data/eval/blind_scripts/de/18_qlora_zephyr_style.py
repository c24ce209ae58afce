"""
Zephyr-style QLoRA SFT (4-bit NF4 base + LoRA adapters) on UltraChat, plain DDP loop.

  torchrun --nproc_per_node 4 18_qlora_zephyr_style.py --output_dir runs/zephyr-qlora
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    DataCollatorForSeq2Seq,
    get_cosine_schedule_with_warmup,
)

ZEPHYR_TEMPLATE = (
    "{% for message in messages %}\n"
    "{% if message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}\n"
    "{% endfor %}"
)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_id", default="mistralai/Mistral-7B-v0.3")
    ap.add_argument("--dataset", default="HuggingFaceH4/ultrachat_200k")
    ap.add_argument("--output_dir", default="runs/zephyr-qlora")
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--max_train_samples", type=int, default=100_000)
    ap.add_argument("--max_eval_samples", type=int, default=2_000)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--grad_accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--save_steps", type=int, default=500)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def make_tokenize(tok, max_len):
    def fn(ex):
        msgs = ex["messages"]
        ids = tok.apply_chat_template(msgs, tokenize=True)
        labels = [-100] * len(ids)
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            start = len(tok.apply_chat_template(msgs[:i], tokenize=True, add_generation_prompt=True))
            end = len(tok.apply_chat_template(msgs[: i + 1], tokenize=True))
            labels[start:end] = ids[start:end]
        ids, labels = ids[:max_len], labels[:max_len]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}
    return fn


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    agg = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        n = (batch["labels"][:, 1:] != -100).sum()
        agg += torch.stack([loss.float() * n, n.float()])
    dist.all_reduce(agg)
    model.train()
    return (agg[0] / agg[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model_id)
    tok.chat_template = ZEPHYR_TEMPLATE
    tok.pad_token = tok.eos_token
    tok.padding_side = "right"

    fn = make_tokenize(tok, args.max_len)
    # rank 0 downloads and fills the datasets cache first, the others reuse it
    if rank != 0:
        dist.barrier()
    raw = load_dataset(args.dataset)
    train_raw = raw["train_sft"].shuffle(seed=args.seed).select(range(args.max_train_samples))
    eval_raw = raw["test_sft"].select(range(args.max_eval_samples))
    train_ds = train_raw.map(fn, remove_columns=train_raw.column_names, num_proc=8)
    eval_ds = eval_raw.map(fn, remove_columns=eval_raw.column_names, num_proc=8)
    if rank == 0:
        dist.barrier()

    collator = DataCollatorForSeq2Seq(tok, padding="longest", label_pad_token_id=-100, pad_to_multiple_of=8)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collator,
                          num_workers=2, pin_memory=True, drop_last=True)
    eval_dl = DataLoader(eval_ds, batch_size=args.batch_size, collate_fn=collator,
                         sampler=DistributedSampler(eval_ds, shuffle=False))

    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )
    model = AutoModelForCausalLM.from_pretrained(
        args.model_id,
        quantization_config=bnb_config,
        torch_dtype=torch.bfloat16,
        attn_implementation="flash_attention_2",
        device_map={"": 0},
    )
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=64, lora_alpha=16, lora_dropout=0.1, bias="none",
                                             task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    if rank == 0:
        model.print_trainable_parameters()
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    total = args.epochs * len(train_dl) // args.grad_accum
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.1 * total), total)

    step, t_last = 0, time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for it, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss / args.grad_accum
            loss.backward()
            if (it + 1) % args.grad_accum:
                continue
            torch.nn.utils.clip_grad_norm_(params, 0.3)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach() * args.grad_accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t_last:.1f}s", flush=True)
                t_last = time.time()
            if step % args.save_steps == 0:
                ev = evaluate(model, eval_dl, device)
                if rank == 0:
                    print(f"[eval] step {step} loss {ev:.4f} ppl {math.exp(ev):.2f}", flush=True)
                    model.module.save_pretrained(os.path.join(args.output_dir, f"checkpoint-{step}"))
                dist.barrier()

    ev = evaluate(model, eval_dl, device)
    if rank == 0:
        print(f"[final eval] loss {ev:.4f} ppl {math.exp(ev):.2f}", flush=True)
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
        tok.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
